"""Start-up progress (engine/progress.py): log lines without a terminal (every interval and at
the end), a tqdm bar on one, nothing where INFO is not logged; and the engine's start-up phases
on the CPU, a sharded checkpoint's tensors and the warm-up, report through it."""
from __future__ import annotations

import io
import logging
import os
import re

import pytest
import torch

from helpers import make_tiny_checkpoint
from specserve.engine import progress as progress_module
from specserve.engine.config import EngineConfig
from specserve.engine.process import start_warm_engine
from specserve.engine.progress import progress
from specserve.engine.runtime.cuda_graph import GraphedStep

LOGGER = "specserve.engine.progress"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    """Each reading is one second after the last."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_without_a_terminal_a_line_per_interval_and_one_at_the_end(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    items = list(range(7))
    # Clock: start at 1; item i done at i + 2. A line once 3 s have passed since the last.
    got = list(progress(items, len(items), "loading m", "tensors", interval_s=3.0, clock=_Clock()))
    assert got == items
    assert _messages(caplog) == [
        "loading m: 3/7 tensors (42%) after 3 s",
        "loading m: 6/7 tensors (85%) after 6 s",
        "loading m: 7 tensors in 8.0 s",
    ]


def test_on_a_terminal_a_tqdm_bar(caplog, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert list(progress(iter("abc"), 3, "capturing CUDA graphs (greedy decode)", "graphs")) == \
        ["a", "b", "c"]
    bar = terminal.getvalue()
    assert "capturing CUDA graphs (greedy decode)" in bar and "3/3" in bar and "graphs" in bar
    assert not _messages(caplog)  # the bar instead of log lines


def test_nothing_where_info_is_not_logged(caplog, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    caplog.set_level(logging.WARNING, logger=LOGGER)  # as a tensor-parallel follower's
    assert list(progress(range(4), 4, "warming up", "generations")) == [0, 1, 2, 3]
    assert terminal.getvalue() == "" and not _messages(caplog)


def test_loading_a_sharded_checkpoint_and_warming_up_report_progress(tmp_path, caplog,
                                                                     monkeypatch):
    model = make_tiny_checkpoint(str(tmp_path), "llama", sharded=True)
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)  # a line per item as well
    monkeypatch.setattr("sys.stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    engine = start_warm_engine(EngineConfig(model=model, device="cpu", dtype="float32",
                                            spec=None))
    try:
        num_tensors = len(dict(engine.core.runner.model.named_parameters()))
    finally:
        engine.shutdown()
    messages = _messages(caplog)
    name = os.path.basename(model)
    loading = [m for m in messages if m.startswith(f"loading {name}: ")]
    assert loading[-1].startswith(f"loading {name}: {num_tensors} tensors in "), messages
    # Every tensor but the last got a line of its own, counting up.
    counts = [int(re.match(rf"loading {name}: (\d+)/", m).group(1)) for m in loading[:-1]]
    assert counts == list(range(1, num_tensors)), messages
    warm = [m for m in messages if m.startswith("warming up: ")]
    assert warm and re.fullmatch(r"warming up: (\d+) generations in [\d.]+ s", warm[-1]), messages
    assert int(warm[-1].split()[2]) == len(warm)  # and one line per generation before it


def test_graph_capture_reports_each_bucket_largest_first(caplog, monkeypatch):
    """GraphedStep.capture_all's progress (a CPU stand-in for the CUDA capture of a bucket)."""
    captured = []

    class Recording(GraphedStep):
        def _capture(self, bs: int) -> None:
            captured.append(bs)

    monkeypatch.setattr("sys.stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    Recording([], None, pad={}, max_batch_size=10, device=torch.device("cpu")).capture_all(
        "greedy decode")
    assert captured == [10, 8, 4, 2, 1]
    [line] = _messages(caplog)
    assert line.startswith("capturing CUDA graphs (greedy decode): 5 graphs in "), line


@pytest.mark.parametrize("total", [0, 1])
def test_short_and_empty_phases_end_with_one_line(caplog, monkeypatch, total):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert list(progress(range(total), total, "x", "graphs", clock=_Clock())) == list(range(total))
    assert _messages(caplog) == [f"x: {total} graphs in {1.0 + total:.1f} s"]
