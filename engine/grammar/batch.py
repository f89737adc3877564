"""The constrained rows of one launched batch, and the bitmasks its forward applies.

Built by the scheduler only for a batch with a constrained request (`GrammarBatch.of` is None
otherwise, and nothing below runs). Rows without a grammar get all-ones rows. Masks are made on
the host from the matchers and copied to the device. A constrained batch runs without overlap
(scheduler.py): its masks need the matchers at the previous step's tokens.

Within a step the host work hides behind the device's: the tokens a mask depends on are read
with one copy enqueued before the forward that needs the mask (`read_paths`, `read_tree`), so
the host waits only for that copy, then fills the masks while the forward runs; the mask is
applied to the forward's logits after. The committed masks (`next_token_masks`) need no device
value and are filled after the forward is enqueued too (before the first part of a speculative
step, which applies them to the stashed first draft level).

Captured steps (CUDA graphs of greedy constrained decode steps, runtime/cuda_graph.py) read and
write fixed addresses: `StepBuffers` holds them. The reads copy into its pinned `reads` (the
copy is part of a graph; the caller marks it `copied` after the replay) and the masks are filled
into its pinned `host` and copied into its `device` rows, which the next part applies. Rows of a
padded bucket past the batch stay all-allowed. A speculative step's eager parts (sampled
constrained batches, engines without graphs) use the same buffers, so both run one code path.

Node layout of `path_masks`: per request, candidates 0..C-1 with a token each and a parent
candidate (-1: the root, i.e. the committed tokens); a mask is asked for candidate c (the state
after the tokens on its path, itself included) or for -1 (the committed state).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from specserve.engine.grammar.bitmask import bitmask_width
from specserve.engine.grammar.request_grammar import ALL_ALLOWED, RequestGrammar


class StepBuffers:
    """The fixed buffers of constrained steps: `device` [rows, W] the masks a part applies,
    `host` [rows, W] their pinned twin, `reads` the pinned host copy of drafted tokens.

    One set of each serves a whole step: every mask set is applied by its part before the next
    set is copied in (stream order), and the host fills `host` / reads `reads` only after an
    event that follows the previous copy out of it."""

    def __init__(self, rows: int, width: int, read_size: int, device):
        device = torch.device(device)
        pin = device.type == "cuda"
        self.rows = rows
        self.device = torch.full((rows, width), ALL_ALLOWED, dtype=torch.int32, device=device)
        self.host = torch.empty((rows, width), dtype=torch.int32, pin_memory=pin)
        self.reads = torch.empty(read_size, dtype=torch.int64, pin_memory=pin)


class HostRead:
    """Device tensors read on the host without draining the stream: one copy into pinned
    memory is enqueued now (before the forward that needs the result), `lists` waits for that
    copy only. `into` (StepBuffers.reads) is a fixed buffer: the copy may be captured in a
    graph, so the caller calls `copied` once it is enqueued (after the replay)."""

    def __init__(self, *tensors: torch.Tensor, into: Optional[torch.Tensor] = None):
        self._shapes = [t.shape for t in tensors]
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
        self._event = None
        self._cuda = flat.is_cuda
        if into is not None:
            host = into[:flat.shape[0]]
            host.copy_(flat, non_blocking=True)
            flat = host
        elif self._cuda:
            host = torch.empty(flat.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            flat = host
            self.copied()
        self._host = flat

    def copied(self) -> None:
        """The copy is enqueued: `lists` waits for the stream up to here."""
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def lists(self) -> list[list]:
        if self._event is not None:
            self._event.synchronize()
        sizes = [s.numel() for s in self._shapes]
        return [part.view(shape).tolist() for part, shape in zip(self._host.split(sizes), self._shapes)]


class GrammarBatch:
    def __init__(self, grammars: Sequence[Optional[RequestGrammar]], vocab_size: int, device):
        self.grammars = list(grammars)
        self.width = bitmask_width(vocab_size)
        self.device = torch.device(device)
        # Per request, the masks made during this step by path (drafts, then the verify).
        self._memos: list[dict] = [{} for _ in self.grammars]

    @staticmethod
    def of(grammars: Sequence[Optional[RequestGrammar]], vocab_size: int,
           device) -> Optional["GrammarBatch"]:
        return GrammarBatch(grammars, vocab_size, device) if any(g is not None for g in grammars) else None

    def _host(self, rows: int, out: Optional[StepBuffers]) -> torch.Tensor:
        host = torch.empty((rows, self.width), dtype=torch.int32) if out is None else out.host[:rows]
        return host.fill_(ALL_ALLOWED)

    def _to_device(self, host: torch.Tensor, out: Optional[StepBuffers]) -> torch.Tensor:
        if out is not None:
            rows = out.device[:host.shape[0]]
            rows.copy_(host, non_blocking=True)
            return rows
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def next_token_masks(self, out: Optional[StepBuffers] = None, requests: Optional[int] = None) -> torch.Tensor:
        """[bs, W] on the device: each request's allowed next tokens (schedule side). `out`: into
        its fixed rows, `requests` of them (a padded bucket; rows past the batch allow all)."""
        host = self._host(requests or len(self.grammars), out)
        for b, g in enumerate(self.grammars):
            if g is not None:
                g.fill_tree_masks(host, {-1: b}, (), (), self._memos[b])
        return self._to_device(host, out)

    @staticmethod
    def read_paths(tokens: torch.Tensor, parents: torch.Tensor, which: torch.Tensor,
                   into: Optional[torch.Tensor] = None) -> HostRead:
        """Start reading a draft tree for `path_masks`: enqueue it before the forward whose
        logits the masks apply to."""
        return HostRead(tokens, parents, which, into=into)

    @staticmethod
    def read_tree(tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                  into: Optional[torch.Tensor] = None) -> HostRead:
        """Start reading a verify tree (node 0 the root, the last committed token; node i the
        state after its draft ancestors and itself) for `path_masks`."""
        bs, D = tree_tokens.shape
        which = torch.arange(-1, D - 1, device=tree_tokens.device).expand(bs, D)
        # Node i > 0 is candidate i - 1; its parent node p is candidate p - 1 (-1: the root).
        return GrammarBatch.read_paths(tree_tokens[:, 1:], tree_parents[:, 1:] - 1, which, into)

    def path_masks(self, paths: HostRead, out: Optional[StepBuffers] = None) -> torch.Tensor:
        """[bs * M, W] on the device: for each request b and each of its M asked candidates
        which[b, m], the tokens allowed after that candidate's path (`paths` from read_paths or
        read_tree; with `out`, bs is the read's, a padded bucket's rows past the batch allow all)."""
        tokens, parents, which = paths.lists()
        M = len(which[0]) if which else 0
        host = self._host(len(which) * M, out)
        for b, g in enumerate(self.grammars):
            if g is not None:
                g.fill_tree_masks(host, {node: b * M + m for m, node in enumerate(which[b])},
                                  tokens[b], parents[b], self._memos[b])
        return self._to_device(host, out)
