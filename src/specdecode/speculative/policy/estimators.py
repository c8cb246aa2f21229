"""Online estimators the depth policies price with: drafting cost and per-position acceptance.

Both learn from past steps only (timings, verification results), never from the current
draft, so decisions made with them keep verification lossless."""

from __future__ import annotations

from typing import TYPE_CHECKING

from array import array

import torch

if TYPE_CHECKING:
    from specdecode.speculative.stats import SpecStats


# A step can stall for reasons that are not its own (a garbage collection, the OS running something
# else): traced at batch 1, one 99 ms step among 2-3 ms ones moved the guard's EMA of drafting's rate
# from 1,452 to 524 tok/s and the live cost's level 4x, and drafting stayed off for ~1,500 steps.
# So a sample above this multiple of what the estimate already expects counts as that multiple.
OUTLIER_FACTOR = 3.0


def clipped(sample: float, expected: float | None) -> float:
    """`sample`, at most OUTLIER_FACTOR x `expected` (unchanged while nothing is expected yet)."""
    return sample if expected is None or expected <= 0 else min(sample, OUTLIER_FACTOR * expected)


class EmaLine:
    """EMA moments [n, y, n*n, n*y] of (n, y) samples, for a least-squares line y = fixed + slope n
    (`DraftCost`, `CatchUpCost`)."""

    def __init__(self, weight: float):
        self.weight = weight
        self.moments: list[float] | None = None

    def observe(self, n: float, y: float) -> list[float]:
        """Add a sample; the moments [mean n, mean y, mean n*n, mean n*y] after it."""
        sample = [n, y, n * n, n * y]
        self.moments = sample if self.moments is None else [
            (1 - self.weight) * a + self.weight * b for a, b in zip(self.moments, sample)]
        return self.moments

    def slope(self, min_variance: float) -> float | None:
        """The fitted slope, None while n's variance is below `min_variance` (too alike to separate)."""
        m = self.moments
        variance = m[2] - m[0] * m[0]
        return None if variance < min_variance else (m[3] - m[0] * m[1]) / variance


class DraftCost:
    """Drafting cost in units of the target's one-token step T(B, B): a fixed part per proposal
    (setting up the draft; the first drafter forward also feeds what was committed since the
    last proposal) plus a part per drafted position, fitted online by EMA least squares over
    (steps, cost) of past proposals. The draft model at batch 1 averaged
    3.6 ms per position in 4-deep proposals and 4.2 ms in 1.7-deep ones (about 1.7 ms fixed +
    3.2 ms per position): one average per step, what this replaces, made long drafts look dear.
    Proposals that all had the same depth cannot separate the parts: the last split made by
    proposals of different depths stands, scaled to their mean cost (before any, the average)."""

    def __init__(self, prior_per_step: float, weight: float = 0.1):
        self.per_step, self.fixed = prior_per_step, 0.0
        self.split = False  # whether proposals of different depths have separated the parts yet
        self.line = EmaLine(weight)

    def observe(self, steps: int, cost: float) -> None:
        if self.line.moments is not None:
            cost = clipped(cost, self.fixed + self.per_step * steps)
        mean_n, mean_y = self.line.observe(steps, cost)[:2]
        average = mean_y / mean_n  # per step, everything included
        slope = self.line.slope(min_variance=0.1)
        if slope is None:
            # Depths too alike to separate the parts: the last split, scaled to the mean cost. The average
            # alone charged a proposal's fixed part to every position (traced, EAGLE-3 D-Cut at batch 1,
            # nearly all proposals 4 deep: 0.41 steps a position against 0.07-0.13 once separated), so D-Cut
            # stopped drafts and auto-k shortened them where the next position paid.
            priced = self.fixed + self.per_step * mean_n
            if self.split and priced > 0:
                self.per_step, self.fixed = self.per_step * mean_y / priced, self.fixed * mean_y / priced
            else:
                self.per_step, self.fixed = average, 0.0
            return
        self.split = True
        # Noise must not make deeper drafts look free: a position costs at least a third of the average.
        self.per_step = min(average, max(slope, average / 3))
        self.fixed = mean_y - self.per_step * mean_n


class CatchUpCost:
    """What the drafter's catch-up costs beyond a step's worth of committed tokens (a prompt the first
    time, every token decoded while drafting was off), in units of the target's one-token step at
    batch 1: a fixed part per catch-up plus a part per token, fitted by EMA least squares over
    proposals that caught up (their drafting time beyond what `DraftCost` prices a proposal of their
    depth). Until one is measured, `DepthController` prices a catch-up as the drafter's decode-step
    share of the target's forward over those tokens, which read 4-6x too dear (traced, EAGLE-3 at
    batch 1: 6.2 plain steps for a prompt's catch-up), and the guard, which waits until a drafting
    probe's catch-up is 3% of the steps since the last one, then waited as long as the request lasted.

    Why two parts: a catch-up runs as a forward of its own (`LengthGrouping`), ~0.5 steps whatever its
    length (traced, MTP k=3 W4A8 batch 1: 1-20 tokens cost 0.1-0.97 a token, 89-129-token prompts
    0.03-0.05). One average per token, dominated by the short ones, priced a prompt's catch-up at
    0.16-0.27 a token, 4-6x its cost: auto-k then declined to draft at a request's start, every
    step declined made the catch-up dearer, and drafting stayed off for the rest of the run (traced:
    300-950 of ~1,000 steps planned no draft; one bench run drafted 8 tokens in all)."""

    def __init__(self, weight: float = 0.2):
        self.fixed, self.per_token = 0.0, None
        self.line = EmaLine(weight)

    def price(self, tokens: int) -> float | None:
        """Units a catch-up over `tokens` costs (None: none measured yet)."""
        return None if self.per_token is None else self.fixed + self.per_token * tokens

    def observe(self, tokens: int, excess: float) -> None:
        """A catch-up over `tokens` took `excess` units beyond the proposal's own drafting."""
        if tokens <= 0:
            return
        mean_n, mean_y = self.line.observe(tokens, max(0.0, excess))[:2]
        slope = self.line.slope(min_variance=1.0)
        if slope is None or slope < 0 or slope * mean_n > mean_y:  # too alike in length to separate the parts
            self.per_token, self.fixed = mean_y / mean_n, 0.0
        else:
            self.per_token, self.fixed = slope, mean_y - slope * mean_n


class AcceptanceEstimator:
    """Online per-position acceptance: EMA of P(position i accepted | earlier accepted), and
    of the drafter's mean confidence there (for recalibrating confidences).

    Feeds auto-k and serves as the confidence of drafters that have none (n-gram). It depends
    only on past verification results, never on the current draft, so using it to size or
    prune a draft keeps verification lossless. A position never drafted yet inherits the rate
    of the deepest observed one (a prior of its own would trap auto-k at short drafts).
    """

    def __init__(self, k: int, prior: float = 0.5, decay: float = 0.95, bins: int = 10, bin_decay: float = 0.99,
                 bin_prior: float = 4.0):
        self.rate = [prior] * k  # [k]
        self.observed = [False] * k
        self.mean_confidence = [None] * k  # [k] EMA of the drafter's confidence at position i
        self.decay = decay
        # Per confidence bin (equal widths over [0, 1]) of each position, and of all positions pooled:
        # decayed sums [accepted, reached] (`calibrated`), in flat float64 arrays that Python reads and
        # writes an element at a time (a numpy element cost ~10x as much, ~7 us of each D-Cut step at
        # batch 1) and the C++ drafting chain reads through tensors sharing their memory (D-Cut's stop
        # rule at batch 1, `DraftStopRule`).
        self.bins, self.bin_decay, self.bin_prior = bins, bin_decay, bin_prior
        self.binned = array("d", bytes(8 * k * bins * 2))  # [k, bins, (accepted, reached)], flat
        self.pooled = array("d", bytes(8 * bins * 2))  # [bins, (accepted, reached)], flat
        self.binned_tensor = torch.frombuffer(self.binned, dtype=torch.float64).view(k, bins, 2)
        self.pooled_tensor = torch.frombuffer(self.pooled, dtype=torch.float64).view(bins, 2)

    def update(self, num_draft: list[int], num_accepted: list[int], confidence: list[list[float]] | None = None,
               per_position: bool = True) -> None:
        """per_position=False: only the confidence bins learn (which positions were drafted was selected
        by the drafts' confidences, so the rates per position would be biased)."""
        if max(num_draft, default=0) == 0:
            return  # a plain step says nothing about acceptance
        if confidence is not None:
            decay = self.bin_decay
            for b, (n, a) in enumerate(zip(num_draft, num_accepted)):
                for i in range(min(n, a + 1)):  # the positions verification reached
                    j = self._bin(confidence[b][i])
                    for sums, at in ((self.binned, 2 * (i * self.bins + j)), (self.pooled, 2 * j)):
                        sums[at] = decay * sums[at] + (i < a)
                        sums[at + 1] = decay * sums[at + 1] + 1.0
        if not per_position:
            return
        for i in range(min(len(self.rate), max(num_draft))):  # deeper positions had no draft
            rows = [b for b, (n, a) in enumerate(zip(num_draft, num_accepted)) if n > i and a >= i]
            if not rows:
                continue
            accepted = sum(1 for b in rows if num_accepted[b] > i)
            w = self.decay ** len(rows)  # more evidence this step, more weight
            self.rate[i] = w * self.rate[i] + (1 - w) * accepted / len(rows)
            self.observed[i] = True
            if confidence is not None:
                mean = sum(confidence[b][i] for b in rows) / len(rows)
                prev = self.mean_confidence[i]
                self.mean_confidence[i] = mean if prev is None else w * prev + (1 - w) * mean
        last = None
        for i in range(len(self.rate)):  # unobserved positions follow the deepest observed one
            if self.observed[i]:
                last = self.rate[i]
            elif last is not None:
                self.rate[i] = last

    def expected_committed(self, k: int) -> float:
        """1 + sum_{i<=k} prod_{j<=i} rate_j: expected tokens committed by a k-token draft."""
        total, survival = 1.0, 1.0
        for i in range(k):
            survival *= self.rate[i]
            total += survival
        return total

    def confidence(self, requests: "list[SpecStats]", prior_weight: float = 4.0) -> list[list[float]]:
        """Per request, P(position i accepted | earlier accepted): the request's own record at i
        blended with the batch-wide rate (worth `prior_weight` observations). Acceptance is a
        property of the request as much as of the drafter (an n-gram drafter accepts nearly
        everything on a request that repeats its prompt and nothing on the next), so one
        batch-wide figure cuts the wrong drafts. Past verification results only: lossless."""
        out = []
        for stats in requests:
            reached, accepted = stats.reached_per_position, stats.accepted_per_position
            out.append([(accepted[i] + prior_weight * r) / (reached[i] + prior_weight) if i < len(reached) else r
                        for i, r in enumerate(self.rate)])
        return out

    def scale(self) -> list[float]:
        """Per position: measured acceptance / the drafter's mean confidence there."""
        return [r / c if c else 1.0 for r, c in zip(self.rate, self.mean_confidence)]

    def _bin(self, x: float) -> int:
        return min(self.bins - 1, max(0, int(x * self.bins)))

    def calibrated(self, i: int, x: float, scale: float) -> float:
        """P(a draft at position i with confidence x is accepted | position i reached): the measured
        acceptance of position i's drafts in x's confidence bin, over a prior worth `bin_prior`
        drafts: the bin's acceptance over every position, itself over the confidence scaled to
        position i's mean (`scale`). Scaling alone was far off: EAGLE-3's top probabilities below 0.1
        were accepted 44-61% of the time where scaling priced them at 0.11, and a mean acceptance of
        0.70-0.81 per position came out as 0.51-0.63 after clipping at 1 (HumanEval, 3,596 drafts).
        The pooled bins matter because D-Cut verifies deep positions mostly where confidence is
        high; position 0, always verified, fills them for every confidence."""
        j = self._bin(x)
        pooled, binned, at = self.pooled, self.binned, 2 * (i * self.bins + j)
        prior = (pooled[2 * j] + self.bin_prior * min(1.0, x * scale)) / (pooled[2 * j + 1] + self.bin_prior)
        return (binned[at] + self.bin_prior * prior) / (binned[at + 1] + self.bin_prior)

    def calibrate(self, confidence: list[list[float]]) -> list[list[float]]:
        """A drafter's confidences as acceptance probabilities per position (`calibrated`)."""
        scale = self.scale()
        return [[self.calibrated(i, x, scale[i]) for i, x in enumerate(row)] for row in confidence]
