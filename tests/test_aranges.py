"""The cached index ranges a speculative step uses instead of per-step aranges."""
from __future__ import annotations

import torch

from specserve.engine.aranges import arange


def test_arange_is_made_once_per_length_and_device():
    a = arange(7, "cpu")
    assert torch.equal(a, torch.arange(7)) and a.dtype == torch.int64
    assert arange(7, torch.device("cpu")) is a
    assert torch.equal(arange(3, "cpu"), torch.arange(3)) and arange(0, "cpu").numel() == 0
