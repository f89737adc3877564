"""EngineWatchdog: tells from the engine process's heartbeats whether it is frozen or stuck.

A thread of the engine process sends a Heartbeat every `heartbeat_interval_s`, carrying how many
iterations the engine's main loop has completed. One signal alone cannot tell a frozen process
from a long step, so two timeouts read two signals:

- No heartbeat for `heartbeat_timeout_s` (default 4 s): the whole process is frozen (SIGSTOP, a
  debugger, a machine swapping itself to death). The heartbeat thread does not wait for the main
  loop (only for the GIL, which torch releases in its kernels and waits), so a long legitimate
  step (a big prefill, the first compile of a kernel) does not delay a beat, and this timeout can
  be short: with the defaults, a frozen engine is noticed within 5 s.
- Heartbeats, but the loop count unchanged for `stall_timeout_s` (default 300 s): the main loop
  is stuck inside a step (a deadlock, a hung collective or GPU kernel), where only the heartbeat
  thread still runs. An idle loop still counts (it wakes every idle poll), so an unchanged count
  always means a step that has not returned, but a legitimate step can be long: this timeout
  must exceed the longest one, and a stuck engine is noticed that late.

When either trips, the server treats the engine as dead: health NOT_SERVING, calls in flight end
with UNAVAILABLE, the engine process is killed. The server does not restart the engine; the
orchestrator restarts the server (docs/architecture.md, "Operating the server").
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable, Optional

# Heartbeats per heartbeat timeout, and watchdog checks per heartbeat timeout: one late beat is
# no alarm, and a trip is noticed within an eighth of the timeout.
BEATS_PER_TIMEOUT = 8


class WatchdogState(enum.Enum):
    STARTING = "starting"          # the engine is loading and warming up; not watched yet
    OK = "ok"
    UNRESPONSIVE = "unresponsive"  # no heartbeat: the process is frozen
    STALLED = "stalled"            # heartbeats, but the main loop is stuck in a step


@dataclass(frozen=True)
class WatchdogReport:
    state: WatchdogState
    heartbeat_age_s: float  # since the last heartbeat (0 while starting)
    loop_stall_s: float     # since the engine's main loop last completed an iteration


class EngineWatchdog:
    def __init__(self, heartbeat_timeout_s: float, stall_timeout_s: Optional[float],
                 clock: Callable[[], float] = time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.state = WatchdogState.STARTING
        self._clock = clock
        self._last_heartbeat = 0.0
        self._last_progress = 0.0
        self._loop_iterations: Optional[int] = None

    @property
    def heartbeat_interval_s(self) -> float:
        """How often the engine sends a heartbeat, and how often the server checks."""
        return self.heartbeat_timeout_s / BEATS_PER_TIMEOUT

    def arm(self) -> None:
        """Start watching (the engine is ready); the timeouts count from now."""
        self.state = WatchdogState.OK
        self._last_heartbeat = self._last_progress = self._clock()

    def on_heartbeat(self, loop_iterations: int) -> None:
        now = self._clock()
        self._last_heartbeat = now
        if loop_iterations != self._loop_iterations:
            self._loop_iterations = loop_iterations
            self._last_progress = now

    def check(self) -> Optional[str]:
        """Why the engine is to be treated as dead (once, on the check that trips), else None."""
        if self.state is not WatchdogState.OK:
            return None
        report = self.report()
        if report.heartbeat_age_s > self.heartbeat_timeout_s:
            self.state = WatchdogState.UNRESPONSIVE
            return (f"engine process unresponsive: no heartbeat for {report.heartbeat_age_s:.1f} s "
                    f"(engine_heartbeat_timeout_s={self.heartbeat_timeout_s:g})")
        if self.stall_timeout_s is not None and report.loop_stall_s > self.stall_timeout_s:
            self.state = WatchdogState.STALLED
            return (f"engine stalled: its loop has not finished a step for "
                    f"{report.loop_stall_s:.1f} s (engine_stall_timeout_s={self.stall_timeout_s:g})")
        return None

    def report(self) -> WatchdogReport:
        if self.state is WatchdogState.STARTING:
            return WatchdogReport(self.state, 0.0, 0.0)
        now = self._clock()
        return WatchdogReport(self.state, now - self._last_heartbeat, now - self._last_progress)
