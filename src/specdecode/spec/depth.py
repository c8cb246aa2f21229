"""Draft-depth and verify-depth policies.

Before drafting (`draft_length_schedule`):
- constant: k every step;
- heuristic: Hugging Face's `num_assistant_tokens_schedule="heuristic"`: +2 after a step
  whose drafts were all accepted, else -1, never below 1 (and never above k here);
- auto: the k (0..k) that maximises expected committed tokens per second for the current
  batch size, from the profiled cost model and the online acceptance rate, checked against
  measurement (`MeasuredGuard`: where steps that drafted have delivered fewer tokens per
  second than steps that did not, at this batch size, drafting stops).
After drafting:
- draft_n_min (llama.cpp): a draft shorter than n_min is dropped and the step decodes normally;
- verify_pruning "dcut": D-Cut's batch-global cut of low-survival positions (`dcut_lengths`).
draft_p_min acts inside the drafting loop of the proposers that have probabilities (see
drafters/draft_model.py).
"""

from __future__ import annotations

from specdecode.config import SpeculativeConfig
from specdecode.engine.sequence import Sequence
from specdecode.spec.cost_model import LiveCost
from specdecode.spec.metrics import SpecStats


class DepthController:
    """Decides each step how far every sequence drafts (before proposing) and how much of
    each draft is verified (after proposing), and learns from verification results."""

    def __init__(self, config: SpeculativeConfig, cost_model_loader=None, draft_cost_prior: float = 0.5,
                 pending_tokens=lambda seq: 0):
        self.k = config.num_speculative_tokens
        self.schedule = config.draft_length_schedule
        self.n_min = config.draft_n_min
        self.pruning = config.verify_pruning
        self.confidence_threshold = config.confidence_threshold
        # Optimistic until measured: with a pessimistic prior, auto-k at batch 1 would never draft,
        # so it would never observe the acceptance that makes drafting pay (measured: 0 drafts).
        self.estimator = AcceptanceEstimator(self.k, prior=0.8)
        # Drafting seconds, modelled in units of the target's one-token step at the same batch
        # size: drafting, like the target, costs more per step as the batch grows, and a ratio
        # learned at one batch size carries to another. Before any measurement the proposer's
        # prior holds: assuming drafting is free would make the first step at a large batch
        # draft (and catch the drafter up) for nothing.
        self.draft_cost = DraftCost(draft_cost_prior)
        # Only D-Cut recalibrates drafter confidences against acceptance; otherwise the speculator
        # skips copying them to the host every step.
        self.tracks_confidence = self.pruning == "dcut"
        self._cost_model_loader = cost_model_loader
        self._cost = None
        self.pending_tokens = pending_tokens  # seq -> tokens the drafter must catch up on first
        self.guard = MeasuredGuard(self.k)
        self._catching_up = False  # this step's draft time includes a catch-up: not a draft step's cost
        self._prune_while_drafting = False  # this step, D-Cut stops unpromising rows while drafting

    @property
    def cost(self) -> LiveCost:
        if self._cost is None:
            self._cost = LiveCost(self._cost_model_loader())
        return self._cost

    @property
    def needs_cost_model(self) -> bool:
        return self.schedule == "auto" or self.pruning == "dcut"

    def limits(self, seqs: list[Sequence]) -> list[int]:
        """Per sequence: the most draft tokens it may use (also bounded by its remaining room:
        a step commits accepted + 1 tokens, so at most room - 1 drafts are useful)."""
        if self.schedule == "auto" or self.pruning == "dcut":  # D-Cut sizes the draft first, then prunes it
            remaining = sum(seq.room for seq in seqs) / len(seqs)
            catch_up = self.catch_up_time(seqs)
            k = auto_k(self.cost, len(seqs), self.k, self.estimator, self.draft_step_time(len(seqs)), catch_up,
                       remaining, draft_fixed=self.draft_seconds(len(seqs), 0))
            chosen = self.guard.choose(len(seqs), k)
            self._catching_up = chosen > 0 and catch_up > 0
            # A guard probe (deeper than chosen) measures acceptance: drafting must not stop it early.
            self._prune_while_drafting = self.pruning == "dcut" and chosen <= k
            k = chosen
            per_seq = [k] * len(seqs)
        elif self.schedule == "heuristic":
            per_seq = [seq.drafter_state.get("schedule_k", self.k) for seq in seqs]
        else:
            per_seq = [self.k] * len(seqs)
        return [max(0, min(k, seq.room - 1)) for k, seq in zip(per_seq, seqs)]

    def verify_lengths(self, seqs: list[Sequence], num_tokens: list[int], confidence: list[list[float]] | None) -> list[int]:
        """How many of each sequence's drafts go to verification (n_min, then D-Cut). Drafters
        without confidences (n-gram) are scored by each request's measured acceptance."""
        lengths = [0 if n < self.n_min else n for n in num_tokens]
        if self.confidence_threshold > 0 and max(lengths, default=0) > 0:
            # The confident prefix: cumulative confidence (prefix-only, so lossless) above the threshold.
            conf = confidence if confidence is not None else self.estimator.confidence([s.stats for s in seqs])
            for q, n in enumerate(lengths):
                survival, keep = 1.0, 0
                for i in range(n):
                    survival *= conf[q][i]
                    if survival < self.confidence_threshold:
                        break
                    keep += 1
                lengths[q] = keep
        if self.pruning == "dcut" and max(lengths, default=0) > 0:
            conf = (self.estimator.calibrate(confidence) if confidence is not None
                    else self.estimator.confidence([s.stats for s in seqs]))
            lengths = dcut_lengths(conf, lengths, self.cost, self.draft_seconds(len(lengths), max(num_tokens)))
        return lengths

    def keep_drafting(self, step: int, tops: list[list[float]], drafting: list[int]) -> list[int]:
        """D-Cut's drafting half: after position `step` was drafted, which rows of `drafting`
        draft further. D-Cut prunes what verification would waste; drafting positions it would
        prune wastes drafter steps (measured at batch 4 with the draft model: a fifth of the
        drafted tokens, while drafting was half of the step time). So each row's survival so
        far (its calibrated confidences' product, as D-Cut scores it) prices its next positions
        at the measured acceptance rates, and the m most confident rows draft j more steps where
        that raises the step's expected committed tokens per second over stopping now
        (looking j steps ahead: one step alone undervalues depth). `tops[b]`: the drafter's
        confidences of row b's kept drafts so far, all depending on tokens before `step` only."""
        if not self._prune_while_drafting:
            return drafting
        B = len(tops)
        scale = self.estimator.scale()
        tau, width, survival = float(B), B, {}
        for b, row in enumerate(tops):
            a = 1.0
            for i, top in enumerate(row):
                a *= min(1.0, top * scale[i])
                tau += a
            width += len(row)
            survival[b] = a
        fixed = self.draft_seconds(B, step + 1)  # drafting so far
        best_rate, best_m = tau / (fixed + self.cost.step_time(B, width)), 0
        gains, survive, total = [], 1.0, 0.0  # expected accepted tokens per unit survival after j more positions
        for rate in self.estimator.rate[step + 1:]:
            survive *= rate
            total += survive
            gains.append(total)
        order = sorted(drafting, key=lambda b: -survival[b])
        sizes = sorted({min(2 ** e, len(order)) for e in range(len(order).bit_length() + 1)})  # m: 1, 2, 4, ..., all
        for m in sizes:
            head = sum(survival[b] for b in order[:m])
            draft_step = self.draft_step_time(m)
            for j, gain in enumerate(gains, 1):
                rate = (tau + head * gain) / (fixed + j * draft_step + self.cost.step_time(B, width + j * m))
                if rate > best_rate:
                    best_rate, best_m = rate, m
        return sorted(order[:best_m])

    def catch_up_time(self, seqs: list[Sequence]) -> float:
        """Expected seconds the drafter spends, before its first draft, on committed tokens it
        has not seen beyond a step's worth (the prompt the first time, or every token decoded
        while drafting was off). A step's worth (<= k + 1 per sequence) is part of the measured
        draft step already."""
        extra = sum(max(0, self.pending_tokens(seq) - (self.k + 1)) for seq in seqs)
        if extra == 0:
            return 0.0
        B = len(seqs)
        return self.draft_cost.per_step * max(0.0, self.cost.step_time(B, B + extra) - self.cost.step_time(B, B))

    def draft_step_time(self, batch_size: int) -> float:
        """Expected seconds of one more drafting step for `batch_size` sequences."""
        return self.draft_cost.per_step * self.cost.step_time(batch_size, batch_size)

    def draft_seconds(self, batch_size: int, steps: int) -> float:
        """Expected seconds of a proposal `steps` deep (steps=0: its fixed part alone)."""
        return (self.draft_cost.fixed + self.draft_cost.per_step * steps) * self.cost.step_time(batch_size, batch_size)

    def update(self, seqs: list[Sequence], num_draft: list[int], num_accepted: list[int], draft_seconds: float,
               num_draft_steps: int, confidence: list[list[float]] | None = None, step_seconds: float | None = None) -> None:
        self.estimator.update(num_draft, num_accepted, confidence)
        if step_seconds and not self._catching_up:  # a catch-up is a one-time cost, priced by auto_k
            self.guard.observe(len(seqs), sum(num_draft) > 0, len(seqs) + sum(num_accepted), step_seconds)
        if num_draft_steps and self._cost is not None and not self._catching_up:
            self.draft_cost.observe(num_draft_steps, draft_seconds / self._cost.step_time(len(seqs), len(seqs)))
        if step_seconds is not None and self._cost is not None:
            self._cost.observe(len(seqs), len(seqs) + sum(num_draft), step_seconds - draft_seconds)
        if self.schedule != "heuristic":
            return
        for seq, n, a in zip(seqs, num_draft, num_accepted):
            if n == 0:
                continue
            k = seq.drafter_state.get("schedule_k", self.k)
            seq.drafter_state["schedule_k"] = min(self.k, k + 2) if a == n else max(1, k - 1)


class MeasuredGuard:
    """The cost model's choice checked against what steps actually delivered, plus the
    exploration that keeps the policy's inputs measured.

    The cost model is a start-up snapshot on a machine whose speed drifts (measured here:
    +-25% over tens of seconds), and a marginal call between drafting and plain decoding
    flips on errors that small. So, per batch-size bucket (powers of two), it keeps the
    measured committed tokens per second of steps that drafted and of steps that did not
    (EMA), and lets the policy draft only where drafting has not measured slower. Every
    `explore_every`-th decision in a bucket (the `first_explore`-th while an arm is still
    unmeasured) takes the other arm, so both figures stay current
    (the cost of being wrong is bounded by that fraction of steps); where drafting keeps
    losing, the interval doubles up to `max_interval`, because each such probe pays the
    drafter's catch-up over everything decoded since the last one.

    Acceptance is only measured where drafts are verified: a policy that stops drafting
    position i (or drafting at all) after a few rejections would never see it recover. So,
    where drafting has measured faster, a declined step drafts one token now and then, and
    every `probe_every`-th drafting step drafts one position deeper than chosen.
    Timing and counts are of past steps only: lossless like every other depth decision.
    """

    def __init__(self, k_max: int, explore_every: int = 32, probe_every: int = 4, weight: float = 0.05,
                 margin: float = 0.97, max_interval: int = 1024, burst: int = 4, first_explore: int = 4,
                 min_samples: int = 4):
        self.k_max = k_max
        self.burst = burst  # drafting steps per re-measurement: its first pays the catch-up and is not measured
        self.burst_left: dict[int, int] = {}
        self.explore_every = explore_every
        # Until both arms are measured in a bucket, the other arm is tried after this many decisions:
        # a batch of 16 fresh requests drafting on an optimistic prior ran a whole round at 0.7x.
        self.first_explore = first_explore
        # An arm's rate counts once it has this many steps, averaged equally until the EMA takes
        # over: a verdict from one drafting step with no draft accepted (traced: EAGLE-3 at batch 1,
        # 2 drafting steps vs 1 plain step) stopped drafting where it pays 1.3x, and the EMA took
        # hundreds of decisions to forget it.
        self.min_samples = min_samples
        self.max_interval = max_interval
        self.interval: dict[int, int] = {}  # bucket -> decisions between explorations (backs off while drafting loses)
        self.since: dict[int, int] = {}  # bucket -> decisions since the last exploration
        self.probe_every = probe_every
        self.weight = weight
        self.margin = margin  # drafting must measure below margin x plain to be stopped (per-step rates are noisy)
        self.sums: dict[tuple[int, bool], list[float]] = {}  # (bucket, drafted) -> EMA [tokens, seconds], steps
        self.decisions: dict[int, int] = {}  # bucket -> decisions seen

    def rate(self, bucket: int, drafted: bool) -> float | None:
        """Measured committed tokens per second (a ratio of EMA sums: a step's weight is its length);
        None until `min_samples` steps were measured."""
        sums = self.sums.get((bucket, drafted))
        return None if sums is None or sums[2] < self.min_samples else sums[0] / sums[1]

    def choose(self, batch_size: int, k: int) -> int:
        """The draft length to use when the policy chose k."""
        bucket = batch_size.bit_length()
        n = self.decisions[bucket] = self.decisions.get(bucket, 0) + 1
        spec, plain = self.rate(bucket, True), self.rate(bucket, False)
        measured = spec is not None and plain is not None
        loses = measured and spec < self.margin * plain
        since = self.since[bucket] = self.since.get(bucket, 0) + 1
        interval = self.interval.get(bucket, self.explore_every)
        if not measured:
            interval = min(interval, self.first_explore)
        explore = since >= interval
        if explore:
            self.since[bucket] = 0
            # Re-measuring drafting where it loses costs a drafter catch-up over every token decoded
            # since: back off (32, 64, ... decisions) while it keeps losing.
            self.interval[bucket] = min(2 * interval, self.max_interval) if loses else self.explore_every
        if k == 0:  # the model declined: re-measure acceptance now and then where drafting has paid
            return 1 if explore and measured and spec > plain else 0
        if loses and self.burst_left.get(bucket, 0) > 0:  # the rest of a re-measurement burst
            self.burst_left[bucket] -= 1
            return k
        if loses and explore:
            self.burst_left[bucket] = self.burst - 1
        if loses != explore:
            return 0
        if k < self.k_max and n % self.probe_every == self.probe_every // 2:
            return k + 1
        return k

    def observe(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        sums = self.sums.setdefault((batch_size.bit_length(), drafted), [0.0, 0.0, 0])
        sums[2] += 1
        w = max(self.weight, 1 / sums[2])  # the plain mean of the first steps, then an EMA
        sums[0] = (1 - w) * sums[0] + w * tokens
        sums[1] = (1 - w) * sums[1] + w * seconds


class DraftCost:
    """Drafting cost in units of the target's one-token step T(B, B): a fixed part per proposal
    (setting up the draft; the first drafter forward also feeds what was committed since the
    last proposal) plus a part per drafted position, fitted online by EMA least squares over
    (steps, cost) of past proposals. The draft model at batch 1 averaged
    3.6 ms per position in 4-deep proposals and 4.2 ms in 1.7-deep ones (about 1.7 ms fixed +
    3.2 ms per position): one average per step, what this replaces, made long drafts look dear.
    Proposals that all had the same depth cannot separate the parts: the average stands."""

    def __init__(self, prior_per_step: float, weight: float = 0.1):
        self.per_step, self.fixed = prior_per_step, 0.0
        self.weight = weight
        self.moments: list[float] | None = None  # EMA of [n, y, n*n, n*y]

    def observe(self, steps: int, cost: float) -> None:
        sample = [steps, cost, steps * steps, steps * cost]
        m = self.moments = sample if self.moments is None else [
            (1 - self.weight) * a + self.weight * b for a, b in zip(self.moments, sample)]
        mean_n, mean_y = m[0], m[1]
        average = mean_y / mean_n  # per step, everything included
        variance = m[2] - mean_n * mean_n
        if variance < 0.1:
            self.per_step, self.fixed = average, 0.0
            return
        slope = (m[3] - mean_n * mean_y) / variance
        # Noise must not make deeper drafts look free: a position costs at least a third of the average.
        self.per_step = min(average, max(slope, average / 3))
        self.fixed = mean_y - self.per_step * mean_n


class AcceptanceEstimator:
    """Online per-position acceptance: EMA of P(position i accepted | earlier accepted), and
    of the drafter's mean confidence there (for recalibrating confidences).

    Feeds auto-k and serves as the confidence of drafters that have none (n-gram). It depends
    only on past verification results, never on the current draft, so using it to size or
    prune a draft keeps verification lossless. A position never drafted yet inherits the rate
    of the deepest observed one (a prior of its own would trap auto-k at short drafts).
    """

    def __init__(self, k: int, prior: float = 0.5, decay: float = 0.95):
        self.rate = [prior] * k  # [k]
        self.observed = [False] * k
        self.mean_confidence = [None] * k  # [k] EMA of the drafter's confidence at position i
        self.decay = decay

    def update(self, num_draft: list[int], num_accepted: list[int], confidence: list[list[float]] | None = None) -> None:
        if max(num_draft, default=0) == 0:
            return  # a plain step says nothing about acceptance
        for i in range(len(self.rate)):
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

    def calibrate(self, confidence: list[list[float]]) -> list[list[float]]:
        """Rescale a drafter's confidences so their mean per position matches the measured
        acceptance there (top probabilities are typically underconfident for greedy)."""
        scale = self.scale()
        return [[min(1.0, x * scale[i]) for i, x in enumerate(row)] for row in confidence]


def expected_committed(alpha: float, k: int) -> float:
    """Tokens committed per step with i.i.d. acceptance alpha and k drafts: (1 - a^(k+1)) / (1 - a)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def auto_k(cost, batch_size: int, k_max: int, estimator: "AcceptanceEstimator", draft_step_time: float,
           catch_up_seconds: float = 0.0, remaining_tokens: float = float("inf"), draft_fixed: float = 0.0) -> int:
    """The draft length that maximises expected committed tokens per second for this batch
    (0 = plain decoding is faster). Baseline policy: one k for the whole batch.
    `catch_up_seconds`: a one-time drafter cost paid before drafting can start, amortised
    over the steps left to the batch (`remaining_tokens` per sequence / tokens per step): a
    large batch must not pay a drafter prefill over every prompt to draft a step or two.
    `draft_fixed`: seconds every proposal costs whatever its depth."""
    best_k, best_rate = 0, batch_size / cost.step_time(batch_size, batch_size)
    for k in range(1, k_max + 1):
        tau = estimator.expected_committed(k)
        amortised = catch_up_seconds / max(1.0, remaining_tokens / tau)
        seconds = draft_fixed + k * draft_step_time + cost.step_time(batch_size, batch_size * (k + 1)) + amortised
        rate = batch_size * tau / seconds
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def dcut_lengths(confidence: list[list[float]], num_tokens: list[int], cost, draft_seconds: float) -> list[int]:
    """D-Cut verification depth per request (AngelSlim D-Cut, DSpark's scheduler rule).

    Survival a[q][i] = prod_{j<=i} confidence[q][j] estimates P(draft i of request q is
    accepted). Every request with a draft keeps its first position; the other (q, i) pairs
    are admitted in descending a (ties: earlier position first) while the expected committed
    tokens per second, tau / (draft_seconds + T(B, N)), keeps improving, stopping at the
    first pair that does not improve it.

    Why this is lossless: a draft token must be verified against the distribution it was
    sampled from, so whether position i is kept may depend on the prefix x_<i but not on
    x_i itself. The confidences given here depend only on x_<i (the drafter's top
    probability at i, or past acceptance statistics); in descending order, (q, i) is
    decided before any pair whose score involves x_i (a[q][i+1] <= a[q][i]), and the
    early stop means no later pair can change that decision. A global argmax over K would
    look at later pairs and is not exact under sampling (DSpark shows a shifted
    distribution); under greedy decoding any pruning is exact.
    """
    B = len(num_tokens)
    kept = [min(1, n) for n in num_tokens]
    survival: list[tuple[float, int, int]] = []
    tau = float(B)
    for q, n in enumerate(num_tokens):
        a = 1.0
        for i in range(n):
            a *= confidence[q][i]
            if i == 0:
                tau += a
            else:
                survival.append((a, q, i))
    N = B + sum(kept)
    rate = tau / (draft_seconds + cost.step_time(B, N))
    survival.sort(key=lambda t: (-t[0], t[2]))
    for a, q, i in survival:
        new_rate = (tau + a) / (draft_seconds + cost.step_time(B, N + 1))
        if new_rate <= rate:
            break
        tau, N, rate = tau + a, N + 1, new_rate
        kept[q] = i + 1
    return kept
