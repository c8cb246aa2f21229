"""MeasuredGuard: the cost model's draft-or-not choice checked against measured step rates."""

from __future__ import annotations

from specdecode.speculative.policy.estimators import clipped


class MeasuredGuard:
    """The cost model's choice checked against what steps actually delivered, plus the
    exploration that keeps the policy's inputs measured.

    The cost model is a start-up snapshot on a machine whose speed drifts (measured here:
    +-25% over tens of seconds), and a marginal call between drafting and plain decoding
    flips on errors that small. So, per batch-size bucket (powers of two), it keeps the
    measured committed tokens per second of steps that drafted and of steps that did not
    (EMA), and lets the policy draft only where drafting has not measured slower. Every
    `explore_every`-th decision in a bucket (the `first_explore`-th while an arm is still
    unmeasured) takes the other arm for `burst` steps, so both figures stay current
    (the cost of being wrong is bounded by that fraction of steps). The interval doubles up
    to `max_interval` while explorations confirm the verdict, and at every exploration where
    drafting loses, because each such probe pays the drafter's catch-up over everything
    decoded since the last one; where drafting falls behind between explorations, it restarts
    at `explore_every` (`observe`). Only steady steps count (the controller passes a step only
    when the one before it took the same arm): the first step after a switch pays for it
    (traced, draft model at batch 1: a plain step right after a drafting step 1.59 ms, after a
    plain step 1.39 ms; counting both, plain decoding measured slower than drafting that lost
    7% to a plain engine).

    Seconds arrive in units of the machine's speed at the time (DepthController divides by the
    live cost model's level), so a slow phase of the machine lands on neither arm.

    Acceptance is only measured where drafts are verified: a policy that stops drafting
    position i (or drafting at all) after a few rejections would never see it recover. So,
    once both arms are measured, an exploration where the policy declined drafts a burst at the
    full depth k_max (backing off where drafting loses: it re-measures acceptance at every
    position, the drafting cost and this arm's rate), and every `probe_every`-th drafting step
    drafts one position deeper than chosen.
    Timing and counts are of past steps only: lossless like every other depth decision.
    """

    def __init__(self, k_max: int, explore_every: int = 32, probe_every: int = 4, weight: float = 0.05,
                 margin: float = 0.97, max_interval: int = 1024, burst: int = 4, first_explore: int = 4,
                 min_samples: int = 4, switch_budget: float = 0.03, max_wait: int = 2048, settle_samples: int = 16):
        self.k_max = k_max
        # Steps per re-measurement of the other arm: its first pays the switch (a drafter catch-up,
        # caches cold for the other model) and is not measured (DepthController.update).
        self.burst = burst
        self.switch_budget = switch_budget
        # The most decisions an exploration waits for its catch-up to fit the budget: a catch-up priced
        # above the budget per token (it grows with the steps it waits) would otherwise wait forever.
        self.max_wait = max_wait
        # An exploration waits for the catch-up only once drafting's rate rests on this many steps. A verdict
        # from its first few is one request's start: traced (EAGLE-3 D-Cut, bf16, batch 1, a fresh engine),
        # 4 drafting steps accepting 1 draft token of ~16 measured drafting at 580-610 tok/s against 865 plain,
        # and as every exploration of drafting then waited for a catch-up over all the tokens decoded since
        # (priced above the budget per token), the rest of the request and the next one decoded plainly:
        # 190 steps, where drafting later measured 1,330-1,560 tok/s.
        self.settle_samples = settle_samples
        self.burst_left: dict[int, int] = {}
        self.burst_drafts: dict[int, bool] = {}  # bucket -> whether the burst in progress drafts
        self.verdict: dict[int, bool | None] = {}  # bucket -> `loses` at the last exploration
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
        self.drafted: set[int] = set()  # buckets where a decision has drafted

    def rate(self, bucket: int, drafted: bool) -> float | None:
        """Measured committed tokens per second (a ratio of EMA sums: a step's weight is its length);
        None until `min_samples` steps were measured."""
        sums = self.sums.get((bucket, drafted))
        return None if sums is None or sums[2] < self.min_samples else sums[0] / sums[1]

    def verdict_now(self, bucket: int) -> tuple[bool, bool]:
        """(both arms measured in this bucket, drafting's rate below `margin` x plain decoding's)."""
        spec, plain = self.rate(bucket, True), self.rate(bucket, False)
        measured = spec is not None and plain is not None
        return measured, measured and spec < self.margin * plain

    def loses(self, bucket: int) -> bool:
        return self.verdict_now(bucket)[1]

    def declines(self, batch_size: int) -> bool:
        """Whether the next `choose` in this bucket returns 0 whatever k is: drafting measured
        slower and neither a burst nor an exploration is due (the policy need not price a draft)."""
        bucket = batch_size.bit_length()
        return self.loses(bucket) and self.burst_left.get(bucket, 0) == 0 and not self.exploration_due(batch_size)

    def exploration_due(self, batch_size: int) -> bool:
        """Whether the next `choose` in this bucket may take the other arm: a drafting burst goes on or
        an exploration is due. When not, `choose(batch_size, 0)` returns 0 whatever `switch_steps` is."""
        bucket = batch_size.bit_length()
        if self.burst_left.get(bucket, 0) > 0 and self.burst_drafts[bucket]:
            return True
        interval = self.interval.get(bucket, self.explore_every)
        if not self.verdict_now(bucket)[0]:
            interval = min(interval, self.first_explore)
        return self.since.get(bucket, 0) + 1 >= interval

    def waits(self, batch_size: int, switch_steps: float) -> bool:
        """Whether an exploration due at the next decision, outside a burst, keeps `choose(batch_size, 0)` at
        0 (where drafting loses or the model's k is 0, `choose` then returns 0 and changes what it would with
        any k): a bucket that has neither drafted nor measured both arms keeps the model's 0 (there is no
        drafting rate to re-measure), elsewhere the exploration waits for this switch cost (more than
        `switch_budget` of the decisions since the last one, at most `max_wait` of them, once drafting's rate
        rests on `settle_samples` steps)."""
        bucket = batch_size.bit_length()
        if self.burst_left.get(bucket, 0) > 0:
            return False
        if not (self.verdict_now(bucket)[0] or bucket in self.drafted):
            return True
        return self._waits(bucket, self.since.get(bucket, 0) + 1, switch_steps)

    def _waits(self, bucket: int, since: int, switch_steps: float) -> bool:
        """Whether an exploration due after `since` decisions waits for a switch of this cost."""
        drafting = self.sums.get((bucket, True))
        settled = drafting is not None and drafting[2] >= self.settle_samples
        return settled and switch_steps > self.switch_budget * since and since < self.max_wait

    def choose(self, batch_size: int, k: int, switch_steps: float = 0.0) -> int:
        """The draft length to use when the policy chose k. `switch_steps`: what drafting now
        would cost first (the drafter's catch-up), in plain steps of this batch."""
        bucket = batch_size.bit_length()
        n = self.decisions[bucket] = self.decisions.get(bucket, 0) + 1
        if self.burst_left.get(bucket, 0) > 0 and (k > 0 or self.burst_drafts[bucket]):  # the rest of a burst
            self.burst_left[bucket] -= 1
            return self._deeper(k or self.k_max, n, bucket) if self.burst_drafts[bucket] else 0
        measured, loses = self.verdict_now(bucket)
        since = self.since[bucket] = self.since.get(bucket, 0) + 1
        interval = self.interval.get(bucket, self.explore_every)
        if not measured:
            interval = min(interval, self.first_explore)
        explore = since >= interval
        if explore and (loses or k == 0) and self._waits(bucket, since, switch_steps):
            # A re-measurement of drafting that loses, or an acceptance probe, pays the drafter's
            # catch-up over everything decoded since drafting stopped (traced: EAGLE-3 at batch 4,
            # 30 ms a probe, 11 plain steps, 2.3% of the engine's time in one pass): it waits until
            # that is at most `switch_budget` of the steps since the last one.
            explore = False
        if explore:
            self.since[bucket] = 0
            # Re-measuring drafting where it loses costs a drafter catch-up over every token decoded
            # since: back off (32, 64, ... decisions) while it keeps losing. Where it wins, plain
            # decoding's re-measurement costs its margin: back off while the verdict holds.
            holds = measured and self.verdict.get(bucket) == loses
            self.verdict[bucket] = loses if measured else None
            self.interval[bucket] = min(2 * interval, self.max_interval) if loses or holds else self.explore_every
        if k == 0:  # the model declined: re-measure drafting now and then, a burst at full depth
            # Also where drafting measured slower: the model's "no" comes from its estimates (acceptance
            # per position, drafting and catch-up cost), which nothing else refreshes while nothing is
            # drafted (traced at batch 1: D-Cut with EAGLE-3 drafted 53 tokens in a whole run; with
            # one-token probes, which measure position 0 alone and no drafting cost, auto-k with
            # EAGLE-3 drafted 2 tokens in a run where fixed k=4 measured 1.26x). The interval backs
            # off like the re-measurements of drafting. Also where drafting was tried but is not measured
            # yet: the "no" then rests on those few drafts (traced, MTP k=3 D-Cut at W4A8, batch 1: two
            # drafting steps that accepted nothing at a run's start, acceptance priced at 0.71-0.78 a
            # position where fixed k measured 0.83-0.90, and no token drafted for the rest of the run,
            # 0.92x plain, while fixed k ran at 1.03-1.05x). Only a bucket that never drafted keeps it.
            if not (explore and (measured or bucket in self.drafted)):
                return 0
            self.burst_left[bucket], self.burst_drafts[bucket] = self.burst - 1, True
            return self._deeper(self.k_max, n, bucket)
        drafting = loses == explore
        if explore:  # the other arm, for `burst` steps (the interval counts from the burst's end)
            self.burst_left[bucket], self.burst_drafts[bucket] = self.burst - 1, drafting
        return self._deeper(k, n, bucket) if drafting else 0

    def _deeper(self, k: int, n: int, bucket: int) -> int:
        """A drafting decision's depth: every `probe_every`-th drafts one position deeper than chosen."""
        self.drafted.add(bucket)
        return k + 1 if k < self.k_max and n % self.probe_every == self.probe_every // 2 else k

    def observe(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        bucket = batch_size.bit_length()
        lost = self.loses(bucket)
        sums = self.sums.setdefault((bucket, drafted), [0.0, 0.0, 0])
        seconds = clipped(seconds, sums[1] if sums[2] >= self.min_samples else None)  # a stall is not the arm's
        sums[2] += 1
        w = max(self.weight, 1 / sums[2])  # the plain mean of the first steps, then an EMA
        sums[0] = (1 - w) * sums[0] + w * tokens
        sums[1] = (1 - w) * sums[1] + w * seconds
        if self.loses(bucket) and not lost:
            # Drafting has just fallen behind (a request it drafts badly for, a slower spell): the next
            # re-measurement comes `explore_every` decisions from now, backing off from there while it
            # keeps losing. The interval reached while explorations confirmed that drafting wins says
            # how rarely plain decoding needs re-measuring, not how soon drafting does: kept, it
            # locked drafting off for the rest of a run (traced at batch 1: MTP D-Cut measured 1,639
            # tok/s drafting against 818 plain, fell behind on one request at an interval of 1,024,
            # and drafted again ~1,000 decisions later, to lose its burst and wait 1,024 more).
            self.interval[bucket], self.since[bucket] = self.explore_every, 0
