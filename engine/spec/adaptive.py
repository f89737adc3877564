"""Adaptive speculation's choice: per step, the draft shape (depth, and with a tree config the
width: chain or tree) that emits the most tokens per second for this batch size at the
acceptance measured so far, plain decoding (depth 0) when it wins.

Speculation pays only while a step's extra tokens outweigh its extra cost: an H100 bs=64 chain
step of 3 drafts costs 1.55x a plain step (8B, issue E32), so below 1.55 tokens a step it is a
loss, while at bs=1 it costs ~1.1x. A tree of width k costs more again (its draft forwards run
k branches and its verify up to num_draft_tokens nodes) and accepts a level where any of its k
candidates matches. `StepTimes` holds the step time of every (batch-size bucket, shape) the
engine can run, measured at start-up; `AcceptanceEstimate` the per-level acceptance rate of
one width, from the accept lengths the scheduler reads anyway (no host sync); and
`ShapePolicy.choose` their best trade-off for the requests of a step. The choice changes only
which drafts are verified, never which tokens are emitted (the verifier accepts the target's
own tokens).
"""
from __future__ import annotations

import bisect
from typing import Mapping, NamedTuple, Sequence


class DraftShape(NamedTuple):
    """A decode step's draft shape: `depth` draft levels of `width` candidates each (width 1: a
    chain of `depth` drafts; wider: a tree, of which up to num_draft_tokens nodes are verified).
    Shapes sort cheapest first: shallower, then narrower."""

    depth: int
    width: int = 1

    def __str__(self) -> str:
        """A chain of 3: "3"; a tree of 3 levels of width 2: "3x2" (bench JSON, logs)."""
        return str(self.depth) if self.width == 1 else f"{self.depth}x{self.width}"


PLAIN = DraftShape(0, 1)  # a plain decode step: the bonus token alone, verified


def expected_tokens(accept_rate: float, depth: int) -> float:
    """Tokens a step of `depth` draft levels emits when each level is accepted with probability
    `accept_rate` once its predecessors were: 1 + a + a^2 + ... + a^depth (in closed form: the
    policy prices every shape each step, on the schedule thread)."""
    if accept_rate == 1.0:
        return depth + 1.0
    return (1.0 - accept_rate ** (depth + 1)) / (1.0 - accept_rate)


def level_prior(draft_prior: float, width: int) -> float:
    """A width's prior per-level acceptance: any of its `width` candidates accepted, each
    independently at `draft_prior` (a guess, optimistic where the candidates agree; the width's
    own steps replace it). With one prior for all widths a tree of never-measured acceptance
    would only ever cost more than the chain of its depth, and never be tried."""
    return 1.0 - (1.0 - draft_prior) ** width


class StepTimes:
    """Seconds of a decode step by (batch size, draft shape), measured per batch-size bucket (the
    CUDA graphs' buckets); PLAIN is a plain decode step."""

    def __init__(self, seconds: Mapping[int, Mapping[DraftShape, float]]):
        """`seconds[bucket][shape]`: every bucket has the same shapes, PLAIN among them."""
        if not seconds:
            raise ValueError("step_times: no batch-size buckets")
        for shape in (shape for row in seconds.values() for shape in row):
            if not isinstance(shape, DraftShape) or shape.depth < 0 or shape.width < 1 \
                    or (shape.depth == 0 and shape != PLAIN):
                raise ValueError(f"step_times: a shape is a DraftShape of depth >= 0 and width >= 1, "
                                 f"depth 0 only as {PLAIN!r}; got {shape!r}")
        shapes = {tuple(sorted(row)) for row in seconds.values()}
        if len(shapes) != 1 or PLAIN not in next(iter(shapes)):
            raise ValueError(f"step_times: every bucket needs the same shapes, {PLAIN!r} (plain) among "
                             f"them; got {sorted(shapes)}")
        if any(not t > 0 for row in seconds.values() for t in row.values()):
            raise ValueError("step_times: a step time is not positive")
        self.buckets = sorted(seconds)
        self.shapes: tuple[DraftShape, ...] = next(iter(shapes))  # cheapest first
        self._seconds = {b: dict(row) for b, row in seconds.items()}
        self._measured = {b: dict(row) for b, row in seconds.items()}  # as given (start-up)

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket that holds the batch (a batch is padded up to it), or the
        largest past it."""
        return self.buckets[min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)]

    def seconds(self, batch_size: int, shape: DraftShape) -> float:
        return self._seconds[self.bucket(batch_size)][shape]

    def milliseconds(self) -> dict[int, dict[str, float]]:
        """The table in ms by bucket and shape name ("3": a chain of 3 drafts, "3x4": a tree
        of 3 levels of width 4), for logs and bench rows."""
        return {bucket: {str(shape): round(1000 * row[shape], 4) for shape in self.shapes}
                for bucket, row in sorted(self._seconds.items())}

    def row(self, batch_size: int) -> Mapping[DraftShape, float]:
        """Every shape's seconds at the batch's bucket (read only)."""
        return self._seconds[self.bucket(batch_size)]

    def observe(self, batch_size: int, shape: DraftShape, seconds: float, weight: float,
                relax: float = 0.0) -> None:
        """Move the bucket's time of `shape` toward a step's measured `seconds` by `weight`,
        and the bucket's other shapes by `relax` toward their start-up times plus the host's
        share that `shape`'s time now shows over its own start-up time (a step's wall time is
        its device time and the host's per-step work, the same at every shape). A shape priced
        too high is not run again, so never measured again: a sample counts as at most twice
        the current time (a pause of the host, a garbage collection or a new request's work,
        must not price a shape out at once), and the relaxing brings back one that a run of
        steps measured too high (a GPU run saw plain steps measure 1.3-1.6x their time while
        another part's host work delayed their reads) to be tried again."""
        bucket = self.bucket(batch_size)
        row, start = self._seconds[bucket], self._measured[bucket]
        row[shape] += weight * (min(seconds, 2 * row[shape]) - row[shape])
        host = max(row[shape] - start[shape], 0.0)  # wall time is never below device time
        for other in row:
            if other != shape:
                row[other] += relax * (start[other] + host - row[other])


class AcceptanceEstimate:
    """Per request row, the per-level acceptance rate of the steps of one draft width (a chain's
    per-draft rate; a tree's level is accepted where any of its candidates is): an
    exponentially weighted ratio of accepted levels to levels tried, over the row's steps (a
    request tries levels until the first rejection: k accepted of d tried counts k successes of
    k + 1 trials, or of d when all d were accepted). A row starts (`reset`: a request prefilled
    into it, again after a retraction) at the traffic's rate: every step's rows pooled, with the
    same decay per step, the prior until a draft was tried. Requests of one workload accept
    alike, so a new one starting at the prior (optimistic where drafts fail) would run a dozen
    losing deep steps before its own counts outweigh it. A batch's rate pools its rows' counts.

    A width is measured only by its own steps, so once the policy stops choosing it (its
    acceptance fell) its counts would keep the rate they fell to, however the traffic changed.
    So each step that drafts at another width moves this width's counts over the step's rows
    (and the traffic's) by `relax` toward a fresh row's one pseudo-trial at the prior: the rate
    drifts back to the prior and the counts' weight to one trial, so the width is tried again
    once that makes it the best, and one step of its own then measures it again. A width far
    from winning drifts long before it is retried; one close to winning is retried sooner, at a
    smaller loss. (Plain steps relax nothing: while plain wins, the policy's probe, the chain,
    keeps the acceptance measured, with its backoff.)"""

    def __init__(self, num_rows: int, prior: float = 0.5, decay: float = 0.9, relax: float = 0.01):
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior: must be in [0, 1], got {prior!r}")
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: must be in (0, 1), got {decay!r}")
        if not 0.0 <= relax <= 1.0:
            raise ValueError(f"relax: must be in [0, 1], got {relax!r}")
        self.prior = prior
        self.decay = decay
        self.relax_weight = relax
        # One pseudo-trial of weight 1 at the prior per row (row 0: padding, never read).
        self._accepted = [prior] * (num_rows + 1)
        self._tried = [1.0] * (num_rows + 1)
        self._traffic_accepted, self._traffic_tried = prior, 1.0

    def traffic_rate(self) -> float:
        return self._traffic_accepted / self._traffic_tried

    def reset(self, rows: Sequence[int]) -> None:
        start = self.traffic_rate()
        for r in rows:
            self._accepted[r], self._tried[r] = start, 1.0

    def rate(self, rows: Sequence[int]) -> float:
        return sum(self._accepted[r] for r in rows) / sum(self._tried[r] for r in rows)

    def update(self, depth: int, rows: Sequence[int], accept_lens: Sequence[int]) -> None:
        """A step of `depth` draft levels (this estimate's width) and the tokens each of its
        rows emitted (accepted levels + 1). A plain step (depth 0) says nothing about drafts."""
        if depth == 0:
            return
        accepted = tried = 0
        for r, n in zip(rows, accept_lens):
            self._accepted[r] = self.decay * self._accepted[r] + n - 1
            self._tried[r] = self.decay * self._tried[r] + min(n, depth)
            accepted, tried = accepted + n - 1, tried + min(n, depth)
        self._traffic_accepted = self.decay * self._traffic_accepted + accepted
        self._traffic_tried = self.decay * self._traffic_tried + tried

    def relax(self, rows: Sequence[int]) -> None:
        """A step of another width drafted these rows: their counts and the traffic's move by
        `relax` toward one pseudo-trial at the prior."""
        w, prior = self.relax_weight, self.prior
        for r in rows:
            self._accepted[r] += w * (prior - self._accepted[r])
            self._tried[r] += w * (1.0 - self._tried[r])
        self._traffic_accepted += w * (prior - self._traffic_accepted)
        self._traffic_tried += w * (1.0 - self._traffic_tried)


def observe_acceptance(estimates: Mapping[int, AcceptanceEstimate], shape: DraftShape, rows: Sequence[int],
                       accept_lens: Sequence[int]) -> None:
    """A decode step's accept lengths (one per row: accepted levels + 1): its width's estimate
    counts them; a drafting step relaxes every other width's over its rows."""
    for width, estimate in estimates.items():
        if width == shape.width:
            estimate.update(shape.depth, rows, accept_lens)
        elif shape.depth:
            estimate.relax(rows)


class ShapePolicy:
    """Chooses each step's draft shape: the most expected tokens per second, a costlier shape
    (`DraftShape` order: deeper, then wider) only where it beats the cheaper choice by
    `costlier_margin` (below). Each width's acceptance is its own `AcceptanceEstimate` (a chain
    and a tree of one depth accept differently), measured by the steps of that width alone
    and relaxed toward its prior by the other widths' (`observe_acceptance`).
    After `probe_every` plain steps in a row one step drafts at the cheapest shape (the chain
    of one draft), so that the acceptance keeps being measured while plain decoding wins
    (traffic changes phase); each probe that leaves plain decoding the best doubles the run
    before the next, up to `max_probe_every`, and any step the policy drafts for itself resets
    it. (At forced accept 1 on an H100, 8B shape, probes every 32 steps left adaptive at
    0.97-0.99x plain: a probe and its drafter-state refresh cost 1.3-1.8 plain steps.)

    The start-up table times each shape's step alone on the device. A decode loop's step costs
    the most of that and the host's own work per step (scheduling, launching, reading the
    result), which at small batches is the larger and much the same at every shape: on an
    H100 at bs=1 the demo pair's plain step took 0.39 ms of wall time and a 7-draft n-gram
    step 0.38 ms, while the device times price deeper drafts higher, and adaptive n-gram ran
    5.03 tokens a step (depth 4, whole copies: 5 a step plus the prefill's token) at 0.57x
    the fixed 7-draft chain. So each step's measured wall time (`observe`, the interval
    between result reads) moves the table by `observe_weight`: a shape not run yet keeps its
    device-only time, lower than its wall time, so the policy tries it and learns its price;
    one not run lately relaxes by `relax` a step observed in its bucket toward its device-only
    time plus the host time the running shape shows, and is tried again when that makes it the
    best.

    Wall times are noisy by a few %, and at bs=1 on an 8B target depths 0 and 1 cost within
    2 % of each other (6.15 / 6.28 ms on an H100): where no draft is accepted the two flipped on
    that noise (52 / 72 steps at forced accept 1), the deeper paying its drafts for nothing.
    Hence the margin: a near-tie goes to the cheaper shape, which also risks less when the
    acceptance falls."""

    def __init__(self, times: StepTimes, estimates: Mapping[int, AcceptanceEstimate], probe_every: int = 32,
                 observe_weight: float = 0.25, costlier_margin: float = 0.03, max_probe_every: int = 256,
                 relax: float = 0.01):
        """`estimates[width]`: the acceptance of each width of the table's shapes."""
        widths = sorted({shape.width for shape in times.shapes})
        if sorted(estimates) != widths:
            raise ValueError(f"estimates: one per width of the step times' shapes {widths}, got {sorted(estimates)}")
        if probe_every < 1:
            raise ValueError(f"probe_every: must be >= 1, got {probe_every!r}")
        if max_probe_every < probe_every:
            raise ValueError(f"max_probe_every: must be >= probe_every ({probe_every}), got {max_probe_every!r}")
        if not 0.0 <= observe_weight <= 1.0:
            raise ValueError(f"observe_weight: must be in [0, 1], got {observe_weight!r}")
        if not 0.0 <= relax <= 1.0:
            raise ValueError(f"relax: must be in [0, 1], got {relax!r}")
        if not costlier_margin >= 0.0:
            raise ValueError(f"costlier_margin: must be >= 0, got {costlier_margin!r}")
        self.times = times
        self.estimates = dict(estimates)
        self.probe_every = probe_every
        self.observe_weight = observe_weight
        self.relax = relax
        self.costlier_margin = costlier_margin
        self.max_probe_every = max_probe_every
        self._plain_steps = 0
        self._probe_after = probe_every  # plain steps in a row before the next probe

    def observe(self, batch_size: int, shape: DraftShape, seconds: float) -> None:
        """A chosen step's wall time: from its launch, or the previous result read if later,
        to its result read."""
        self.times.observe(batch_size, shape, seconds, self.observe_weight, self.relax)

    def best(self, batch_size: int, rates: Mapping[int, float]) -> DraftShape:
        """The shape of the most expected tokens per second at the per-level acceptance
        `rates[width]`, costlier ones taken only by more than the margin."""
        best, best_speed = None, 0.0
        seconds = self.times.row(batch_size)
        for shape in self.times.shapes:  # cheapest first
            speed = expected_tokens(rates[shape.width], shape.depth) / seconds[shape]
            if best is None or speed > best_speed * (1.0 + self.costlier_margin):
                best, best_speed = shape, speed
        return best

    def choose(self, rows: Sequence[int]) -> DraftShape:
        """The shape of a step over these request rows (`best` at their acceptance per width,
        or a probe after a run of plain steps)."""
        shape = self.best(len(rows), {width: est.rate(rows) for width, est in self.estimates.items()})
        if shape == PLAIN and len(self.times.shapes) > 1:
            self._plain_steps += 1
            if self._plain_steps > self._probe_after:
                self._plain_steps = 0
                self._probe_after = min(2 * self._probe_after, self.max_probe_every)
                return self.times.shapes[1]
            return PLAIN
        self._plain_steps = 0
        self._probe_after = self.probe_every
        return shape
