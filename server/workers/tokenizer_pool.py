"""Tokenizer worker processes: request preparation (parsing, chat templates, tokenising,
validation that needs the tokenizer) out of the server process and its GIL.

A small pool of spawned processes (`--tokenizer-workers N`). Each builds, once, the state the
prepare functions take (the core's `Served`: tokenizer, validator, chat template) from a
picklable factory; a call sends a picklable function (a module-level function or a method of a
picklable request body, with its request bytes) and gets its result back (a ValidatedRequest:
token ids and sampling parameters), or its exception (InvalidRequest) raised again here.

A worker that dies breaks the pool: the calls in it fail with `PoolBroken` (the core answers
UNAVAILABLE), and the next call starts a fresh pool. Preparation holds no request state and
nothing in the engine, so a restart loses nothing else.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, TypeVar

logger = logging.getLogger("specserve.server.tokenizer_pool")

T = TypeVar("T")

PARENT_CHECK_S = 1.0  # how long a worker outlives a server killed without a shutdown

_state: Any = None  # in a worker: what make_state built


class PoolBroken(Exception):
    """A tokenizer worker died while the call was in the pool."""


def _init(make_state: Callable[[], Any]) -> None:
    global _state
    # Out of the server's process group: Ctrl-C and a SIGTERM to the group (systemd, kill --
    # -PGID) do not reach the workers, and the server decides when they stop. Not by ignoring
    # SIGTERM: the executor ends the workers of a broken pool with it, and joins them (a worker
    # that ignored it hung the pool's shutdown and the interpreter's exit).
    os.setpgrp()
    # The executor's workers wait on a call queue whose write end each of them holds too (spawn
    # passes the queue whole), so a server killed without a shutdown (SIGKILL, the OOM killer)
    # would leave them waiting for good: they watch their parent instead.
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="exit-with-server",
                     daemon=True).start()
    _state = make_state()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


def _call(fn: Callable[[Any], T]) -> T:
    return fn(_state)


def _pid(_: Any, hold_s: float = 0.0) -> int:
    time.sleep(hold_s)  # held, so that the calls of a round spread over every started worker
    return os.getpid()


class TokenizerPool:
    def __init__(self, workers: int, make_state: Callable[[], Any]):
        self.workers = workers
        self.make_state = make_state
        self._executor: Optional[ProcessPoolExecutor] = None
        self._start()

    def _start(self) -> None:
        self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init, initargs=(self.make_state,))

    async def run(self, fn: Callable[[Any], T]) -> T:
        """fn(state) in a worker; its exception raised here; PoolBroken if a worker died."""
        executor = self._executor
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, _call, fn)
        except BrokenProcessPool:
            if self._executor is executor:  # the first call to see it restarts the pool
                logger.error("a tokenizer worker died; starting a new pool")
                executor.shutdown(wait=False, cancel_futures=True)
                self._start()
            raise PoolBroken("a tokenizer worker process died while preparing the request; "
                             "retry") from None

    async def pids(self, timeout_s: float = 30.0) -> list[int]:
        """The workers' pids; starts every worker and waits (up to timeout_s) until each has
        built its state and taken a call. A worker still starting takes none: each round's
        calls are held a little, so that a started one cannot answer them all."""
        loop = asyncio.get_running_loop()
        found: set[int] = set()
        hold = functools.partial(_pid, hold_s=0.02)
        deadline = loop.time() + timeout_s
        while len(found) < self.workers and loop.time() < deadline:
            found |= set(await asyncio.gather(*(loop.run_in_executor(self._executor, _call, hold)
                                                for _ in range(2 * self.workers))))
        return sorted(found)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
