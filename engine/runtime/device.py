"""Streams and events: where forwards run, and how the scheduler waits for them.

On CUDA the scheduler thread enqueues its work on a schedule stream and forwards run on a
forward stream; events order the two. On the CPU an executor thread plays the forward
stream and events are threading events, so the overlap loop really runs concurrently in
CPU tests and races show up there, not only on GPUs.
"""
from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch


class ForwardFailed(RuntimeError):
    """A forward raised on the forward stream; the engine cannot continue."""


class DeviceContext:
    """Common interface; `for_device` picks the implementation."""

    device: torch.device

    @staticmethod
    def for_device(device: torch.device) -> "DeviceContext":
        return CudaDeviceContext(device) if device.type == "cuda" else CpuDeviceContext(device)

    def schedule_context(self):
        """Context the scheduler thread runs in (the schedule stream on CUDA)."""
        return contextlib.nullcontext()

    def launch(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the forward stream, after everything already scheduled."""
        raise NotImplementedError

    def new_event(self):
        raise NotImplementedError

    def schedule_wait(self, event) -> None:
        """Make later schedule-side work wait for `event` (a device-side wait on CUDA)."""
        raise NotImplementedError

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start a copy of a forward result to host memory (non-blocking into pinned memory)."""
        raise NotImplementedError

    def busy_seconds(self) -> float:
        """Time the forward stream spent running forwards so far (for occupancy)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _CpuEvent:
    def __init__(self, ctx: "CpuDeviceContext"):
        self._flag = threading.Event()
        self._ctx = ctx

    def record(self) -> None:
        self._flag.set()

    def synchronize(self) -> None:
        while not self._flag.wait(0.5):
            self._ctx.raise_if_failed()
        self._ctx.raise_if_failed()

    def query(self) -> bool:
        return self._flag.is_set()


class CpuDeviceContext(DeviceContext):
    """One executor thread is the forward stream; FIFO submission keeps stream order.

    SPECSERVE_FORWARD_DELAY="seed:max_ms" injects seeded random sleeps before and after each
    forward (tests use it to shake out ordering bugs in the overlap loop).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="forward-stream")
        self._error: BaseException | None = None
        self._busy = 0.0
        delay = os.environ.get("SPECSERVE_FORWARD_DELAY")
        self._delay_rng, self._max_delay = None, 0.0
        if delay:
            seed, max_ms = delay.split(":")
            self._delay_rng, self._max_delay = random.Random(int(seed)), float(max_ms) / 1000
        self._pending_events: list[_CpuEvent] = []

    def launch(self, fn):
        self.raise_if_failed()
        delays = (0.0, 0.0)
        if self._delay_rng is not None:
            delays = (self._delay_rng.uniform(0, self._max_delay), self._delay_rng.uniform(0, self._max_delay))
        self._executor.submit(self._run, fn, delays)

    def _run(self, fn, delays):
        if self._error is not None:
            return
        time.sleep(delays[0])
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                fn()
        except BaseException as e:  # surfaced to the scheduler at its next wait
            self._error = e
            for ev in list(self._pending_events):
                ev.record()
        self._busy += time.perf_counter() - start
        time.sleep(delays[1])

    def raise_if_failed(self):
        if self._error is not None:
            raise ForwardFailed(f"forward failed: {self._error!r}") from self._error

    def new_event(self):
        ev = _CpuEvent(self)
        self._pending_events.append(ev)
        if len(self._pending_events) > 64:
            self._pending_events = [e for e in self._pending_events if not e.query()]
        return ev

    def schedule_wait(self, event):
        event.synchronize()

    def to_host(self, t):
        # A copy, as on CUDA: the result is what the stream held at this point, whatever a
        # later forward writes where `t` lies (a captured graph's output, replayed again)
        return t.clone()

    def busy_seconds(self):
        return self._busy

    def close(self):
        self._executor.shutdown(wait=True)


class CudaDeviceContext(DeviceContext):
    def __init__(self, device: torch.device):
        self.device = device
        self.schedule_stream = torch.cuda.Stream(device)
        self.forward_stream = torch.cuda.Stream(device)
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._busy = 0.0

    def schedule_context(self):
        return torch.cuda.stream(self.schedule_stream)

    def launch(self, fn):
        self.forward_stream.wait_stream(self.schedule_stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.forward_stream), torch.inference_mode():
            start.record()
            fn()
            end.record()
        self._timings.append((start, end))

    def new_event(self):
        return torch.cuda.Event()

    def schedule_wait(self, event):
        self.schedule_stream.wait_event(event)

    def to_host(self, t):
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def busy_seconds(self):
        # Only fold in forwards that have finished; never block here.
        while self._timings and self._timings[0][1].query():
            start, end = self._timings.pop(0)
            self._busy += start.elapsed_time(end) / 1000
        return self._busy
