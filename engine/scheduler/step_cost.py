"""What a decode or mixed step costs as a function of its forward's token count, learnt online
from the steps the scheduler times (the mixed step's prompt budget reads it: mixed_batch.py).

The model: `seconds(n) = fixed + per_token * max(0, n - knee)`. Up to the knee a forward's
GEMMs are bound by reading the weights, so tokens there are nearly free (on an H100, 8B chain,
64 rows: 12.2 ms a decode step, 13.2 ms with 256 prompt tokens riding); above it every token
adds its compute. `fixed` holds everything the token count does not move (the weights' read,
the draft steps, the host's per-step work), `per_token` the slope, both fitted; the knee is a
prior (the fit would need many steps on both sides of it to place it).

The fit is least squares over the timed steps, each weighted by how recent it is (an
exponential decay: a half-life in steps), so it follows the decode batch as it grows and
shrinks. Its slope is shrunk toward a prior's, `fixed / prior_fixed_tokens`, as much as the
prior's evidence weighs against the steps' (`_solve`): while the steps' token counts hardly
spread (every step at one count says nothing of the slope) the prior supplies the slope, and
before any step the model is the prior's shape alone, in units of its fixed part (a budget
only compares the model's times). A step counts as at most twice the time predicted for it (a
pause of the host, a garbage collection or a first-time cost must not drive the budget to its
floor); slower runs of steps still move the fit, by that much per step. (The first step has no
prediction to be held to: a slow one fades with its weight, over a few half-lives.)

Pure host arithmetic over a handful of floats per step: no device value is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

KNEE_TOKENS = 256          # where a bf16 forward's GEMMs turn compute-bound on an H100-class GPU
# The prior: tokens above the knee that cost as much as the fixed part (an 8B bf16 forward's
# ~25 us a token on an H100 against a ~12 ms chain step). On the costly side on purpose: a
# prior that prices tokens too high shrinks the budget until the steps show otherwise (the
# larger chunks that follow spread the token counts, which corrects it), while one that
# priced them too low could hold while every step carries the same share of prompt.
PRIOR_FIXED_TOKENS = 512
HALF_LIFE_STEPS = 32       # a step's weight halves after this many later steps
PRIOR_WEIGHT = 2.0         # the prior's evidence on the slope: this many steps ...
PRIOR_SPREAD_TOKENS = 256  # ... whose token counts spread by this many
OUTLIER_FACTOR = 2.0       # a step counts as at most this many times its predicted time


class StepCostSample(NamedTuple):
    """One timed step (the scheduler's StepStat seconds): its forward's tokens (the decode rows'
    and the prompt chunks') and its wall time."""

    tokens: int
    seconds: float


@dataclass(frozen=True)
class StepCost:
    """A fitted step-cost model (the module's docstring): seconds(n) = fixed + per_token *
    max(0, n - knee)."""

    fixed: float
    per_token: float
    knee: int

    def seconds(self, tokens: int) -> float:
        return self.fixed + self.per_token * max(0, tokens - self.knee)

    def extra_tokens_within(self, tokens: int, ratio: float) -> float:
        """The most tokens a forward of `tokens` may add while its predicted time stays within
        `ratio` (>= 1) times its own (math.inf where tokens look free)."""
        if self.per_token <= 0.0:
            return math.inf
        most = self.knee + (ratio * self.seconds(tokens) - self.fixed) / self.per_token
        return max(most - tokens, 0.0)


class StepCostFit:
    """The exponentially weighted least-squares fit of a StepCost (the module's docstring)."""

    def __init__(self, knee: int = KNEE_TOKENS, prior_fixed_tokens: float = PRIOR_FIXED_TOKENS,
                 half_life_steps: float = HALF_LIFE_STEPS, prior_weight: float = PRIOR_WEIGHT,
                 prior_spread: float = PRIOR_SPREAD_TOKENS):
        if knee < 0 or min(prior_fixed_tokens, half_life_steps, prior_weight, prior_spread) <= 0:
            raise ValueError(f"step cost fit: knee >= 0 and positive prior and half-life; got knee={knee!r}, "
                             f"prior_fixed_tokens={prior_fixed_tokens!r}, half_life_steps={half_life_steps!r}, "
                             f"prior_weight={prior_weight!r}, prior_spread={prior_spread!r}")
        self.knee = knee
        self.prior_fixed_tokens = float(prior_fixed_tokens)
        self.prior_weight = float(prior_weight)
        self.prior_spread = float(prior_spread)
        self.decay = 0.5 ** (1.0 / half_life_steps)
        # Decayed sums over the steps of w, w x, w x^2, w t, w x t (x: tokens above the knee).
        self._w = self._wx = self._wxx = self._wt = self._wxt = 0.0
        self.model = StepCost(1.0, 1.0 / self.prior_fixed_tokens, knee)  # the prior's shape
        self.num_samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One timed step; refits the model."""
        if self.num_samples:
            seconds = min(seconds, OUTLIER_FACTOR * self.model.seconds(tokens))
        x = float(max(0, tokens - self.knee))
        d = self.decay
        self._w = d * self._w + 1.0
        self._wx = d * self._wx + x
        self._wxx = d * self._wxx + x * x
        self._wt = d * self._wt + seconds
        self._wxt = d * self._wxt + x * seconds
        self.num_samples += 1
        self.model = self._solve()

    def _solve(self) -> StepCost:
        """The weighted least-squares line, its slope shrunk toward the prior's: the data's
        evidence on the slope (their token counts' weighted spread, sum w (x - mean x)^2)
        against the prior's (`prior_weight` steps spread by `prior_spread` tokens), the prior
        slope being the fixed part over `prior_fixed_tokens`. Without spread (every step at
        one token count) that is the prior's shape through the steps' mean time."""
        mean_x, mean_t = self._wx / self._w, self._wt / self._w
        spread = max(self._wxx - self._wx * mean_x, 0.0)
        covariance = self._wxt - self._wx * mean_t
        prior = self.prior_weight * self.prior_spread ** 2
        # slope = (covariance + prior * fixed / c) / (spread + prior), fixed = mean_t - slope * mean_x
        c = self.prior_fixed_tokens
        per_token = (covariance + prior * mean_t / c) / (spread + prior * (1.0 + mean_x / c))
        if per_token <= 0.0:  # noise can tilt the line down: tokens look free (the cap holds)
            return StepCost(mean_t, 0.0, self.knee)
        # A line through negative time at no tokens starts at 0.
        return StepCost(max(mean_t - per_token * mean_x, 0.0), per_token, self.knee)
