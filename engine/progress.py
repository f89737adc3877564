"""Progress of the long start-up phases (a checkpoint's tensors, CUDA graph capture, warm-up),
which take minutes on a large model: a tqdm bar on a terminal, else (a log file, a container's
log) a line every LOG_INTERVAL_S and one at the end, as vLLM and SGLang show theirs.

Shown only where this module's logger logs INFO, i.e. in the engine process: tensor-parallel
followers (engine/tp.py) configure no logging, so N ranks do not draw N bars, and neither does
an Engine built in a program that did not ask for INFO logs."""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Iterable, Iterator, Optional, TypeVar

from tqdm import tqdm

logger = logging.getLogger("specserve.engine.progress")

LOG_INTERVAL_S = 10.0  # without a terminal: a progress line at most this often

T = TypeVar("T")


def progress(items: Iterable[T], total: int, what: str, unit: str,
             interval_s: Optional[float] = None,
             clock: Callable[[], float] = time.monotonic) -> Iterator[T]:
    """Yield the items, showing `what` advance over `total` `unit`s (e.g. "tensors");
    interval_s: between log lines (None: LOG_INTERVAL_S)."""
    if not logger.isEnabledFor(logging.INFO):
        yield from items
        return
    if sys.stderr.isatty():
        yield from tqdm(items, total=total, desc=what, unit=f" {unit}", file=sys.stderr,
                        dynamic_ncols=True)
        return
    interval_s = LOG_INTERVAL_S if interval_s is None else interval_s
    started = last = clock()
    done = 0
    for item in items:
        yield item
        done += 1
        now = clock()
        if now - last >= interval_s and done < total:
            logger.info("%s: %d/%d %s (%d%%) after %.0f s", what, done, total, unit,
                        100 * done // max(total, 1), now - started)
            last = now
    logger.info("%s: %d %s in %.1f s", what, done, unit, clock() - started)
