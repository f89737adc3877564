"""What stops the engine process's Python threads other than its own work, measured, and the
collector's share kept short.

Two things pause them: the garbage collector (it holds the GIL for a whole collection, so every
thread waits) and Triton's just-in-time compiles (a kernel launched with a specialisation not
yet in its in-memory cache compiles, or loads from the disk cache, on the launching thread
before it launches). The step log (scheduler/step_log.py) charges each step with the pauses
since the step before, so that a step taking many times its prediction with no device wait can
be told apart: a collection, a compile, or neither. On an H100 serving 8B at 256 streams a
collection of the oldest generation took ~150 ms (once or twice a minute: the whole process's
objects, the model's, Triton's kernels', are walked), a chunk-gap p99 of its own; and a compile
in the middle of serving 0.8 s (a specialisation the warm-up had not made: engine/process.py
warms mixed steps up for that).

`freeze_startup_heap` moves every object alive after the warm-up out of the collector's reach
(gc.freeze: the objects of start-up live as long as the process), so later collections walk
only what serving allocates, as SGLang and vLLM do after their start-up.

`HostPauses` installs a `gc.callbacks` entry and Triton's `jit_cache_hook` /
`jit_post_compile_hook` (chaining whatever hooks were set before) while it is open; only the
step log opens one, so an engine without a log pays nothing. The callbacks run on whichever
thread collects or compiles (the scheduler's, the executor's); a lock guards the totals.
"""
from __future__ import annotations

import gc
import resource
import threading
import time
from typing import NamedTuple, Optional

# Compiled kernels named a step at most (a first step may compile dozens).
MAX_NAMED = 8


def freeze_startup_heap() -> None:
    """Collect once, then freeze what is left (the module's docstring): call when start-up,
    weights, graphs and warm-up, is over."""
    gc.collect()
    gc.freeze()


def _involuntary_switches() -> int:
    """The calling thread's involuntary context switches (Linux; 0 where not counted)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    return 0 if who is None else resource.getrusage(who).ru_nivcsw


class Pauses(NamedTuple):
    """The pauses since the previous `HostPauses.take`."""

    gc_s: float                # seconds in garbage collections
    gc_full: int               # of which collections of the oldest generation (the costly ones)
    compile_s: float           # seconds in Triton compiles (or disk-cache loads) of new specialisations
    compiled: tuple[str, ...]  # their kernels' names (at most MAX_NAMED)
    cpu_s: float               # CPU time of the thread that took them (the scheduler's), so that
    preempted: int             # a long interval with little of it was spent off the CPU: and how
                               # often the OS took the CPU from that thread (involuntary switches)


class HostPauses:
    """Totals of garbage collections and Triton compiles since the last `take` (the module's
    docstring); `close` removes the hooks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._local = threading.local()  # a thread's collection or compile in progress
        self._reset()
        self._cpu, self._preempted = time.thread_time(), _involuntary_switches()
        gc.callbacks.append(self._on_gc)
        self._chained: Optional[tuple] = None
        try:  # here, not at import: the server imports engine/process.py, which imports this
            from triton import knobs
        except ImportError:  # the CPU build needs no Triton
            knobs = None
        self._knobs = knobs
        if knobs is not None:
            runtime = knobs.runtime
            self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
            runtime.jit_cache_hook = self._on_compile_start
            runtime.jit_post_compile_hook = self._on_compile_end

    def _reset(self) -> None:
        self._gc_s, self._gc_full, self._compile_s, self._compiled = 0.0, 0, 0.0, []

    def take(self) -> Pauses:
        """The pauses since the last take; the CPU time and preemptions are the calling
        thread's (the scheduler thread's, which takes them once a step)."""
        cpu, preempted = time.thread_time(), _involuntary_switches()
        with self._lock:
            pauses = Pauses(self._gc_s, self._gc_full, self._compile_s, tuple(self._compiled),
                            cpu - self._cpu, preempted - self._preempted)
            self._reset()
            self._cpu, self._preempted = cpu, preempted
        return pauses

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._chained is not None:
            runtime = self._knobs.runtime
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._chained
            self._chained = None

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._local.gc_started = time.perf_counter()
            return
        started = getattr(self._local, "gc_started", None)
        if started is not None:
            self._local.gc_started = None
            with self._lock:
                self._gc_s += time.perf_counter() - started
                self._gc_full += info.get("generation") == 2

    def _on_compile_start(self, **kwargs):
        self._local.compile_started = time.perf_counter()
        before = self._chained[0] if self._chained else None
        return before(**kwargs) if before else None  # truthy: Triton skips the compile

    def _on_compile_end(self, **kwargs):
        started = getattr(self._local, "compile_started", None)
        if started is not None:
            self._local.compile_started = None
            fn = kwargs.get("fn")
            with self._lock:
                self._compile_s += time.perf_counter() - started
                if len(self._compiled) < MAX_NAMED:
                    self._compiled.append(getattr(fn, "name", "?"))
        after = self._chained[1] if self._chained else None
        return after(**kwargs) if after else None
