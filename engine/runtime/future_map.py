"""FutureMap: values the next iteration needs before the host has them.

Buffers are indexed by `req_pool_idx`. The forward that produces a value `stash`es it (only
the next forward reads it: stream order is enough) or `publish`es it (the schedule side
reads it: the `publish_ready` event fences it). A decode's input ids are the sentinels
`-req_pool_idx`, replaced on the forward stream by `resolve_input_ids`.

With SPECSERVE_DEBUG_FUTURE_MAP=1 (on in CI) every consumed slot is poisoned with -1 and
every gather asserts it reads a fresh value, which catches "read without a new stash".
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Optional

import torch

from specserve.engine.pdl import launch_options, wait_for_predecessor
from specserve.engine.runtime.device import DeviceContext

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build needs no Triton
    triton = None


class DraftState(NamedTuple):
    """EAGLE's per-request draft input for the next iteration: the draft's top-k next
    tokens with their probabilities, and the hidden state they came from."""

    topk_p: torch.Tensor       # [rows, topk] float32
    topk_index: torch.Tensor   # [rows, topk] int64
    hidden: torch.Tensor       # [rows, hidden_size]


class DraftInput(NamedTuple):
    """A draft model's row of a request's last plain step (adaptive speculation's depth 0),
    kept so the state that step did not draft can be drafted later (spec/eagle_drafter.py
    `ModelDrafter.refresh`): the token, its position and KV slot, the target's features."""

    tokens: torch.Tensor       # [rows] int64
    positions: torch.Tensor    # [rows] int64
    loc: torch.Tensor          # [rows] int64
    feats: torch.Tensor        # [rows, feature size]


def _put_rows(buffers: NamedTuple, rows: torch.Tensor, values: NamedTuple) -> None:
    for buf, value in zip(buffers, values):
        buf[rows] = value


def _take_rows(buffers: NamedTuple, rows: torch.Tensor):
    """The rows of every buffer, as the buffers' own NamedTuple."""
    return type(buffers)(*(buf[rows] for buf in buffers))


def debug_enabled() -> bool:
    return os.environ.get("SPECSERVE_DEBUG_FUTURE_MAP", "0") not in ("", "0")


class FutureMap:
    def __init__(self, num_rows: int, ctx: DeviceContext, needs_cpu_seq_lens: bool):
        device = ctx.device
        self.ctx = ctx
        self.needs_cpu_seq_lens = needs_cpu_seq_lens
        self.debug = debug_enabled()
        fill = -1 if self.debug else 0
        self.output_tokens_buf = torch.full((num_rows + 1,), fill, dtype=torch.int64, device=device)
        self.new_seq_lens_buf = torch.full((num_rows + 1,), fill, dtype=torch.int64, device=device)
        self.draft_state: Optional[DraftState] = None  # per row; see allocate_draft_state
        self.draft_input: Optional[DraftInput] = None  # per row; see allocate_draft_input
        self.publish_ready = None

    # --- forward side ------------------------------------------------------------------
    def resolve_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace negative sentinels `-req_pool_idx` with the stashed tokens."""
        if input_ids.is_cuda and triton is not None and not self.debug:
            return resolve_sentinels(input_ids, self.output_tokens_buf)  # one kernel, not five
        is_future = input_ids < 0
        rows = torch.where(is_future, -input_ids, 0)
        resolved = torch.where(is_future, self._consume(self.output_tokens_buf, rows, is_future), input_ids)
        return resolved

    def stash_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.output_tokens_buf[rows] = tokens

    def allocate_draft_state(self, topk: int, hidden_size: int, hidden_dtype: torch.dtype) -> None:
        num_rows, device = self.output_tokens_buf.shape[0], self.output_tokens_buf.device
        self.draft_state = DraftState(
            torch.zeros((num_rows, topk), dtype=torch.float32, device=device),
            torch.zeros((num_rows, topk), dtype=torch.int64, device=device),
            torch.zeros((num_rows, hidden_size), dtype=hidden_dtype, device=device))

    def stash_draft_state(self, rows: torch.Tensor, state: DraftState) -> None:
        """Forward-only values; only the next forward reads them, so stream order suffices."""
        _put_rows(self.draft_state, rows, state)

    def gather_draft_state(self, rows: torch.Tensor) -> DraftState:
        return _take_rows(self.draft_state, rows)

    def allocate_draft_input(self, feature_size: int, dtype: torch.dtype) -> None:
        num_rows, device = self.output_tokens_buf.shape[0], self.output_tokens_buf.device
        index = functools.partial(torch.zeros, num_rows, dtype=torch.int64, device=device)
        self.draft_input = DraftInput(index(), index(), index(),
                                      torch.zeros((num_rows, feature_size), dtype=dtype, device=device))

    def keep_draft_input(self, rows: torch.Tensor, kept: DraftInput) -> None:
        """Forward-only, as the draft state."""
        _put_rows(self.draft_input, rows, kept)

    def gather_draft_input(self, rows: torch.Tensor) -> DraftInput:
        return _take_rows(self.draft_input, rows)

    def new_publish_event(self):
        """Called on the schedule side when launching a forward that will `publish`: the
        next schedule step must wait for this forward's values, not an older one's."""
        self.publish_ready = self.ctx.new_event()
        return self.publish_ready

    def publish(self, rows: torch.Tensor, new_seq_lens: torch.Tensor) -> None:
        """Values the schedule side needs. The caller records the `new_publish_event` event
        right after (verify's end), so the host's next schedule overlaps the draft-extend."""
        self.new_seq_lens_buf[rows] = new_seq_lens

    # --- schedule side -----------------------------------------------------------------
    def resolve_seq_lens(self, rows: torch.Tensor):
        """The lengths the last forward published: (device tensor, host list or None).

        The schedule side waits for `publish_ready` (on CUDA a stream wait, not a host block)
        and gathers on the device. Only when some backend needs host lengths does the host
        block for them.
        """
        if self.publish_ready is not None:
            self.ctx.schedule_wait(self.publish_ready)
        seq_lens = self._consume(self.new_seq_lens_buf, rows, None)
        if not self.needs_cpu_seq_lens:
            return seq_lens, None
        return seq_lens, seq_lens.cpu().tolist()

    def _consume(self, buf: torch.Tensor, rows: torch.Tensor, where: Optional[torch.Tensor]):
        values = buf[rows]
        if self.debug:  # sync-free: an async assert, and a poison written through torch.where
            consumed = torch.ones_like(rows, dtype=torch.bool) if where is None else where
            torch._assert_async((values >= 0).logical_or(~consumed).all(),
                                "FutureMap: read a slot that was not stashed since its last read")
            buf[rows] = torch.where(consumed, -1, values)
        return values


if triton is not None:
    @triton.jit
    def _resolve_sentinels_kernel(ids, table, out, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_predecessor(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(ids + offs, mask=mask, other=0)
        future = x < 0
        stashed = tl.load(table + tl.where(future, -x, 0), mask=mask & future, other=0)
        tl.store(out + offs, tl.where(future, stashed, x), mask=mask)


def resolve_sentinels(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`table[-id]` where an id is negative, else the id: `resolve_input_ids` without the debug
    checks, in one Triton kernel (any device Triton runs on)."""
    ids = ids.contiguous()  # the kernel walks it flat
    out = torch.empty_like(ids)
    n = ids.numel()
    if n:
        block = max(16, min(1024, triton.next_power_of_2(n)))
        _resolve_sentinels_kernel[(triton.cdiv(n, block),)](
            ids, table, out, n, BLOCK=block, num_warps=1 if block <= 256 else 4,
            **launch_options(ids.device))
    return out
