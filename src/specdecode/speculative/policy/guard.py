"""MeasuredGuard: the cost model's draft-or-not choice checked against measured step rates."""

from __future__ import annotations


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

    Seconds arrive in units of the machine's speed at the time (DepthController divides by the
    live cost model's level), so a slow phase of the machine lands on neither arm.

    Acceptance is only measured where drafts are verified: a policy that stops drafting
    position i (or drafting at all) after a few rejections would never see it recover. So,
    once both arms are measured, a declined step drafts one token at each exploration (backing
    off where drafting loses), and every `probe_every`-th drafting step drafts one position
    deeper than chosen.
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
        if k == 0:  # the model declined: re-measure acceptance with one token now and then
            # Also where drafting measured slower: the model's "no" comes from the acceptance
            # estimate, which nothing else refreshes while nothing is drafted (traced: D-Cut with
            # EAGLE-3 at batch 1 drafted 53 tokens in a whole run and stayed off). There the
            # interval backs off like the re-measurements of drafting, and a probe is one token.
            return 1 if explore and measured else 0
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
