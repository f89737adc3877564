"""The grammar process: every matcher of the engine, and grammar compilation, in a process of
its own, so that mask work never shares the scheduler's GIL (issue E23: run as CUDA host
callbacks in the engine process, the matcher calls fought the scheduler thread for the GIL and
a bs=16 constrained step took 1.45x an unconstrained one).

Engine side, `GrammarService` (one per rank, built with the scheduler; the process starts in
the background with the first constrained request, forked from a forkserver that preloaded
torch and xgrammar; messages sent meanwhile wait for it, and the request waits for its
grammar anyway. Like any spawned process, it needs the main module's `if __name__ ==
"__main__"` guard):
* control messages in launch order over a pipe, never waited on: `add` (compile a request's
  grammar, make its matcher), `plan` (per launched constrained step: which batch rows are
  which requests, and the step's kind), `drop` (finished or aborted);
* `poll` (each scheduler step, without blocking): `compiled` (the request may be admitted, or
  failed to compile) and `error` (a matcher refused a committed token: the request fails);
* `device`: the channel primitives (channel.py) the workers call inside the step's forward.

The process runs each plan's phases in order, busy-polling the device flag while a plan is in
progress: `one` (plain decode, extend): committed masks, then the sampled tokens; `spec`:
committed masks (the first draft level is drafted again under them), per draft step the masks
of the frontier's paths, the verify tree's masks, then the accepted tokens (matchers advance;
rejected drafts were walked and rolled back). After the accepted tokens it fills each
request's next committed mask at once (memoised), while the device runs the draft-extend.

Budget: a grammar must compile within `compile_seconds` of its compilation's start (the
process checks between messages); past it the request fails with INVALID_ARGUMENT naming the
field, and a compile still running STUCK_FACTOR times that long (xgrammar cannot be interrupted)
makes the process exit, to be restarted. A request dropped while its grammar waits for a compile
thread cancels that compile (unless another request waits for the same grammar).

Supervision: if the process dies, a monitor thread releases the channel (all-allowed masks,
every wait passes: the device never hangs) and sets `dead`; the scheduler then fails every
constrained request (UNAVAILABLE, KV freed) and, once no constrained step is in flight, calls
`restart`: the channel's host flag is set to the device's last phase and a new process starts
from there (at most once per RESTART_INTERVAL_SECONDS). `start` begins the process and its
warm-up (a small schema compiled, which builds xgrammar's tokenizer tables) at engine start;
`health` says whether it is serving, for the server's health service and metrics.
"""
from __future__ import annotations

import collections
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from multiprocessing.shared_memory import SharedMemory
from typing import NamedTuple, Optional

from specserve.engine.config import GrammarSpec
from specserve.engine.grammar.batch import GrammarBatch
from specserve.engine.grammar.channel import (DEVICE_FLAG, HOST_FLAG, TIMED_OUT, ChannelLayout,
                                              DeviceChannel, HostViews)
from specserve.engine.grammar.compiler import GrammarCompiler
from specserve.engine.grammar.request_grammar import RequestGrammar
from specserve.engine.outputs import FinishError, GrammarHealth

logger = logging.getLogger("specserve.engine")

ONE, SPEC = "one", "spec"   # plan kinds: one token per row (decode, extend) / a speculative step
GONE = FinishError("UNAVAILABLE", "structured_output: the grammar service is down (its process "
                                  "died and is being restarted); retry")
COMPILE_SECONDS = 10.0          # the default compile budget of one grammar
STUCK_FACTOR = 6                # a compile running this many budgets long: the process exits
RESTART_INTERVAL_SECONDS = 1.0  # at least this long between two starts of the process
WARM_SPEC = GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "string"}}}')


class GrammarSetup(NamedTuple):
    shm_name: str
    layout: ChannelLayout
    tokenizer_file: str
    vocab_size: int
    eos_ids: tuple
    tree: Optional[tuple]          # (topk, num_steps, num_draft_tokens); None: plain decoding
    spin_seconds: float            # busy-poll this long before sleeping between flag reads
    compile_seconds: float = COMPILE_SECONDS  # a grammar's compile budget


class GrammarState:
    """The engine's view of a request's grammar: compiled yet (admission waits), and why not."""

    __slots__ = ("ready", "error")

    def __init__(self):
        self.ready = False
        self.error: Optional[FinishError] = None


# --- the process ------------------------------------------------------------------------------
def run_grammar_process(setup: GrammarSetup, conn, start_seq: int = 0) -> None:
    """`start_seq`: the device's last published phase (a restarted process goes on from it)."""
    shm = SharedMemory(setup.shm_name)
    server = _Server(setup, HostViews(shm.buf, setup.layout), conn, start_seq)
    try:
        server.run()
    finally:
        conn.close()
        server.views = None   # the views over the block go first
        del server
        gc.collect()
        try:
            shm.close()
        except BufferError:
            pass


class _Server:
    def __init__(self, setup: GrammarSetup, views: HostViews, conn, start_seq: int):
        import torch

        self.setup = setup
        self.views = views
        self.conn = conn
        self.compiler = GrammarCompiler(setup.tokenizer_file, setup.vocab_size, setup.eos_ids)
        self.requests: dict = {}
        # Requests whose grammar is compiling: key -> its spec (the compile budget's clock).
        self.compiling: dict = {}
        self.seq = start_seq   # phases answered (the device's count when the process started)
        self._send_lock = threading.Lock()
        self._parent = os.getppid()
        self._scratch = torch.empty((1, setup.layout.width), dtype=torch.int32)

    def send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def run(self) -> None:
        while True:
            if not self.conn.poll(0.05 if self.compiling else 1.0):
                if os.getppid() != self._parent:
                    return
                self._check_budgets()
                continue
            try:
                msg = self.conn.recv()
            except EOFError:
                return
            if msg[0] == "stop":
                return
            getattr(self, "_on_" + msg[0])(*msg[1:])
            self._check_budgets()

    # --- control messages --------------------------------------------------------------------
    def _on_add(self, key, spec: GrammarSpec, stop_ids) -> None:
        g = RequestGrammar(self.compiler.compile(spec), stop_ids, spec.after_token_id)
        self.requests[key] = g
        self.compiling[key] = spec

        def compiled(future):
            if self.compiling.pop(key, None) is None:
                return  # failed over its budget, or dropped, meanwhile
            if future.cancelled():
                return
            error = future.exception()
            self.send(("compiled", key, None if error is None else
                       tuple(FinishError("INVALID_ARGUMENT", str(error)))))

        g.future.add_done_callback(compiled)

    def _on_drop(self, key) -> None:
        g = self.requests.pop(key, None)
        spec = self.compiling.pop(key, None)
        if g is None or spec is None:
            return
        if not any(self.requests[k].future is g.future for k in self.compiling):
            self.compiler.forget(spec, g.future)   # nobody waits for it: cancelled if queued

    def _on_warm(self) -> None:
        """Compile a small schema (the first compile builds xgrammar's tokenizer tables, seconds
        on a large vocabulary): the first request's grammar then compiles as fast as the next."""
        def warmed(future):
            error = future.exception()
            self.send(("warm", None if error is None else str(error)))

        self.compiler.compile(WARM_SPEC).add_done_callback(warmed)

    def _check_budgets(self) -> None:
        """Fail the requests whose grammar has compiled longer than its budget; exit if a
        compile seems stuck for good (the engine restarts the process)."""
        budget = self.setup.compile_seconds
        now = time.monotonic()
        for key, spec in list(self.compiling.items()):
            started = self.compiler.started_at(spec)
            if started is None or now - started <= budget:
                continue
            if self.compiling.pop(key, None) is None:
                continue  # it finished meanwhile
            self.requests[key].failed = "over its compile budget"
            self.send(("compiled", key, tuple(FinishError(
                "INVALID_ARGUMENT", f"structured_output.{spec.kind}: did not compile within the "
                                    f"{budget:g} s budget; simplify it"))))
        oldest = self.compiler.oldest_start()
        if oldest is not None and now - oldest > STUCK_FACTOR * budget:
            logger.error("a grammar has compiled for %.0f s: the grammar process exits, to be "
                         "restarted", now - oldest)
            os._exit(3)

    def _on_stats(self) -> None:
        self.send(("stats", {"requests": len(self.requests), "phase": self.seq,
                             "compiles_started": self.compiler.num_started}))

    def _on_plan(self, kind: str, rows: int, entries) -> None:
        grammars = [None] * rows
        for b, key in entries:
            grammars[b] = self.requests.get(key)
        batch = GrammarBatch(grammars)
        masks = self.views.masks
        self._await(0)
        batch.next_token_masks(masks[:rows])
        self._answer()
        if kind == SPEC:
            k, num_steps, D = self.setup.tree
            for j in range(1, num_steps):
                C = j if k == 1 else k + (j - 1) * k * k
                flat = self._await(rows * (2 * C + k))
                tokens, parents, which = _split(flat, rows, (C, C, k))
                batch.path_masks(masks[:rows * k], tokens, parents, which)
                self._answer()
            tokens, parents = _split(self._await(rows * 2 * D), rows, (D, D))
            batch.path_masks(masks[:rows * D], *GrammarBatch.tree_paths(tokens, parents))
            self._answer()
            tokens, lens = _split(self._await(rows * (D + 1)), rows, (D, 1))
            self._answer()
            accepted = {b: tokens[b][:lens[b][0]] for b, _ in entries}
        else:
            tokens = self._await(rows)
            self._answer()
            accepted = {b: tokens[b:b + 1] for b, _ in entries}
        self._commit(grammars, accepted)

    def _commit(self, grammars, accepted: dict) -> None:
        """Advance the matchers by their accepted tokens, then fill each one's next committed
        mask (memoised) while the device runs the rest of the step."""
        keys = {id(g): key for key, g in self.requests.items()}
        for b, tokens in accepted.items():
            g = grammars[b]
            if g is None or not g.usable:
                continue
            try:
                g.advance(tokens)
                g.fill_tree_masks(self._scratch, {-1: 0}, (), ())
            except Exception as e:  # the request fails; the others go on
                g.failed = str(e)
                if id(g) in keys:
                    self.send(("error", keys[id(g)], g.failed))

    # --- the device flags ----------------------------------------------------------------------
    def _await(self, n: int) -> list:
        """Wait until the device published the next phase; its first n input values."""
        target = self.seq + 1
        header = self.views.header
        if header[DEVICE_FLAG] < target:
            start = time.perf_counter()
            checked = start
            while header[DEVICE_FLAG] < target:
                now = time.perf_counter()
                if now - start > self.setup.spin_seconds:
                    time.sleep(5e-5)
                    if now - checked > 1.0:
                        checked = now
                        if os.getppid() != self._parent:
                            os._exit(0)
        return self.views.inputs[target % 2, :n].tolist() if n else []

    def _answer(self) -> None:
        """Masks (if any) are written: answer the phase."""
        self.seq += 1
        self.views.header[HOST_FLAG] = self.seq


def _split(flat: list, rows: int, widths: tuple) -> list:
    """The device's concatenation of [rows, w] tensors, back as per-row lists."""
    out, at = [], 0
    for w in widths:
        out.append([flat[at + b * w:at + (b + 1) * w] for b in range(rows)])
        at += rows * w
    return out


# --- the engine side --------------------------------------------------------------------------
_PRELOAD = ["specserve.engine.grammar.process", "xgrammar", "transformers"]


class GrammarService:
    """The engine's handle on the grammar process (see the module docstring)."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_ids, max_batch_size: int,
                 tree, device, compile_seconds: float = COMPILE_SECONDS):
        import torch

        device = torch.device(device)
        layout = ChannelLayout.of(max_batch_size, vocab_size, tree)
        self._shm = SharedMemory(create=True, size=layout.nbytes)
        self.views = HostViews(self._shm.buf, layout)
        self.views.header[:] = 0
        self.views.masks.fill_(-1)
        self.device = DeviceChannel.for_device(self.views, device)
        self.setup = GrammarSetup(
            self._shm.name, layout, tokenizer_file, vocab_size, tuple(eos_ids),
            None if tree is None else (tree.topk, tree.num_steps, tree.num_draft_tokens),
            spin_seconds=0.005 if device.type == "cuda" else 2e-4, compile_seconds=compile_seconds)
        self._proc = None
        self._conn = None
        self._closing = False
        self._gone = False
        self._inbox: collections.deque = collections.deque()
        self._lock = threading.Lock()     # orders sends: messages queued while it starts go first
        self._queued: list = []
        self._starting: Optional[threading.Thread] = None
        self._start_seq = 0           # the device's phase count when the process (re)starts
        self._last_start = -RESTART_INTERVAL_SECONDS
        self._warm = False            # the current process answered its warm-up
        self._warm_error: Optional[str] = None
        self.restarts = 0

    # --- the process's life ------------------------------------------------------------------
    def start(self) -> None:
        """Start the process now (it starts with the first message otherwise) and warm it up:
        `health` says serving once a small schema compiled. Once per process."""
        if self._starting is None:
            self._send(("warm",))

    def wait_warm(self, timeout: float) -> bool:
        """Wait (at engine start, nothing else running) for the warm-up to answer."""
        deadline = time.monotonic() + timeout
        while not self._warm and not self.dead and time.monotonic() < deadline:
            # poll() reads the warm-up's answer; anything else stays for the scheduler's poll.
            self._inbox.extendleft(reversed(self.poll(0.05)))
        return self._warm

    def health(self) -> GrammarHealth:
        if self.dead:
            return GrammarHealth(False, self.restarts, "its process died; restarting")
        if self._warm_error is not None:
            return GrammarHealth(False, self.restarts, f"its warm-up failed: {self._warm_error}")
        if not self._warm:
            return GrammarHealth(False, self.restarts, "starting")
        return GrammarHealth(True, self.restarts, "")

    @property
    def restartable(self) -> bool:
        """Its process is gone (the watcher released the channel) and may start again."""
        return (self._gone and not self._closing
                and time.monotonic() - self._last_start >= RESTART_INTERVAL_SECONDS)

    def restart(self) -> None:
        """Start a new process. The caller (the scheduler) makes sure no constrained step is in
        flight: the device's phase count is final, and the new process goes on from it."""
        with self._lock:
            header = self.views.header
            self._start_seq = int(header[DEVICE_FLAG])
            self.views.masks.fill_(-1)
            header[TIMED_OUT] = 0
            header[HOST_FLAG] = self._start_seq   # waits wait again: for the new process
            if self._conn is not None:
                self._conn.close()
            self._conn = self._proc = self._starting = None
            self._queued, self._inbox = [], collections.deque()
            self._warm, self._warm_error = False, None
            self._gone = False
            self.restarts += 1
        logger.warning("restarting the grammar process (restart %d)", self.restarts)
        self.start()

    def _start(self) -> None:
        """Off the scheduler thread (a cold forkserver imports torch: seconds)."""
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=run_grammar_process, args=(self.setup, child, self._start_seq),
                           daemon=True, name="specserve-grammar")
        try:
            proc.start()
        except Exception:
            logger.exception("the grammar process did not start: constrained requests fail")
            with self._lock:
                self._gone = True
                self.views.release()
            return
        child.close()
        logger.info("grammar process started (pid %d)", proc.pid)
        with self._lock:
            try:
                for msg in self._queued:
                    conn.send(msg)
            except (BrokenPipeError, OSError):
                pass  # the watcher marks it dead
            self._queued = []
            self._conn, self._proc = conn, proc
        threading.Thread(target=self._watch, args=(self._proc,), daemon=True,
                         name="specserve-grammar-watch").start()

    def _watch(self, proc) -> None:
        multiprocessing.connection.wait([proc.sentinel])
        if not self._closing:
            logger.error("the grammar process died (exit code %s): constrained requests fail", proc.exitcode)
            with self._lock:  # restart() resets the channel under it: never released after that
                self._gone = True         # before the release: a step that ran on it sees `dead`
                self.views.release()

    @property
    def dead(self) -> bool:
        """The process is gone, or a device wait gave up on it (its masks may be stale: poll()
        then kills it, and the watcher releases the channel)."""
        return self._gone or (self.views is not None and self.views.timed_out)

    @property
    def started(self) -> bool:
        """Anything was sent (messages may come back)."""
        return self._starting is not None

    def _send(self, msg) -> None:
        with self._lock:
            if self.dead:
                return
            if self._conn is None:
                self._queued.append(msg)
                if self._starting is None:
                    self._last_start = time.monotonic()
                    self._starting = threading.Thread(target=self._start, daemon=True,
                                                      name="specserve-grammar-start")
                    self._starting.start()
                return
            try:
                self._conn.send(msg)
            except (BrokenPipeError, OSError):
                pass  # the watcher marks it dead

    # --- control messages --------------------------------------------------------------------
    def add(self, key, spec: GrammarSpec, stop_ids) -> GrammarState:
        """Compile a request's grammar (a dead service sends nothing: the scheduler's next news
        says it is dead, which ends the request)."""
        self._send(("add", key, spec, sorted(stop_ids)))
        return GrammarState()

    def plan(self, kind: str, rows: int, keys) -> None:
        """A constrained step is being launched: batch row b is request keys[b] (None: no
        grammar); `rows` the rows its masks cover (a captured bucket's padded size)."""
        self._send(("plan", kind, rows, [(b, key) for b, key in enumerate(keys) if key is not None]))

    def drop(self, key) -> None:
        self._send(("drop", key))

    def poll(self, timeout: float = 0.0) -> list:
        """Messages from the process (compiled, error), waiting up to `timeout` for the first.
        A process that let a device wait give up is killed here (the watcher does the rest)."""
        if self._conn is None:
            time.sleep(timeout)   # still starting
        elif self.dead:
            if not self._gone and self._proc.is_alive():
                logger.error("the grammar process stopped answering: killed, constrained requests fail")
                self._proc.kill()
        else:
            try:
                if self._conn.poll(timeout):
                    while self._conn.poll():
                        self._inbox.append(self._conn.recv())
            except (EOFError, OSError):
                pass
        for m in self._inbox:
            if m[0] == "warm":
                self._warm, self._warm_error = m[1] is None, m[1]
        out = [m for m in self._inbox if m[0] not in ("stats", "warm")]
        stats = [m for m in self._inbox if m[0] == "stats"]
        self._inbox = collections.deque(stats)
        return out

    def stats(self, timeout: float = 30.0) -> dict:
        """What the process holds (tests): {"requests": live matchers, "phase": answered,
        "compiles_started": compilations begun}."""
        self._send(("stats",))
        self._starting.join()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._conn.poll(0.05):
                msg = self._conn.recv()
                if msg[0] == "stats":
                    return msg[1]
                self._inbox.append(msg)
        raise TimeoutError("the grammar process did not answer")

    def close(self) -> None:
        self._closing = True
        if self._starting is not None:
            self._starting.join()
        if self._proc is not None:
            if self._proc.is_alive():
                try:
                    self._conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
                self._proc.join(5)
                if self._proc.is_alive():
                    self._proc.kill()
                    self._proc.join(5)
            self._conn.close()
        self.device.close()
        self.device = None
        self.views = None
        try:
            self._shm.close()
        except BufferError:  # a tensor over the block is still alive somewhere: unlink only
            pass
        self._shm.unlink()
