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
`speculative/propose/chain.py`).

The controller's decisions for one step travel in a `StepPlan` (made by `plan`, read by the
proposer's stop rule, `verify_lengths` and `update`), so no call depends on another having
left a flag behind.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import torch

from specdecode.engine.sequence import Sequence
from specdecode.speculative.config import SpeculativeConfig
from specdecode.speculative.policy.cost_model import LiveCost
from specdecode.speculative.policy.estimators import AcceptanceEstimator, CatchUpCost, DraftCost
from specdecode.speculative.policy.guard import MeasuredGuard
from specdecode.speculative.policy.rules import auto_k, dcut_lengths


@dataclasses.dataclass(slots=True)
class StepPlan:
    """One step's depth decisions, made before drafting and passed along."""

    max_tokens: list[int]  # per sequence: the most draft tokens it may use (0 = decode normally)
    # The drafter consumes a catch-up (committed tokens beyond a step's worth) before drafting:
    # this step's drafting time is a one-time cost, not what a drafting step costs.
    catching_up: bool = False
    catch_up_tokens: int = 0  # when catching up: the committed tokens beyond a step's worth it consumes
    prune_while_drafting: bool = False  # D-Cut stops unpromising rows while drafting (not on a guard probe)
    stop_rule: "DraftStopRule | None" = None  # the rule this step's proposal was given (`draft_stop`)
    verify_whole: bool = False  # a full-depth probe: D-Cut verifies the whole draft (`verify_lengths`)

    @property
    def drafts(self) -> bool:
        return max(self.max_tokens, default=0) > 0




class OneRowStop(NamedTuple):
    """D-Cut's stop rule for one sequence, as the C++ drafting chain (`DraftStep.chain`) evaluates it
    after drafting position s from its confidence x: j = the confidence bin, prior = (pooled[j, 0] +
    bin_prior min(1, x scale[s])) / (pooled[j, 1] + bin_prior), c = (binned[s, j, 0] + bin_prior
    prior) / (binned[s, j, 1] + bin_prior) (`AcceptanceEstimator.calibrated`), a *= c, tau += a;
    it drafts on iff a / tau > theta[s] (`DepthController.one_row_thresholds`)."""

    binned: torch.Tensor  # [k, bins, 2] float64
    pooled: torch.Tensor  # [bins, 2] float64
    scale: torch.Tensor  # [k] float64
    theta: torch.Tensor  # [k - 1] float64
    bin_prior: float


class DraftStopRule:
    """D-Cut's drafting half for one step's proposal (`DepthController.keep_drafting`), called by
    chain drafters after each drafter step. For one sequence it is a threshold per position, priced
    when the live cost reprices (`DepthController._priced`), which the C++ drafting chain can
    evaluate itself (`one_row`): the chain then drafts in one call, not one call a step with this
    rule asked between them (traced with EAGLE-3 at batch 1: 0.70 ms drafting 3.25 positions a step
    against 0.72 ms for 3.93 in one call, plus 0.04 ms in the rule)."""

    def __init__(self, depth: "DepthController"):
        self.depth = depth
        self.asked = False  # whether the proposal consulted it (then which positions were drafted depends on it)

    def __call__(self, step: int, tops: list[list[float]], drafting: list[int]) -> list[int]:
        self.asked = True
        if len(tops) != 1:
            return self.depth.keep_drafting(step, tops, drafting)
        if not drafting:
            return []
        scale, theta = self._prices()
        a, tau = self.depth.one_row_survival(tops[0], scale=scale)
        return drafting if a / tau > theta[step] else []

    def one_row(self) -> OneRowStop:
        self.asked = True
        est = self.depth.estimator

        def tables() -> OneRowStop:  # the bins are the estimator's own arrays (they learn in place)
            scale, theta = self._prices()
            return OneRowStop(est.binned_tensor, est.pooled_tensor, torch.tensor(scale, dtype=torch.float64),
                              torch.tensor(theta, dtype=torch.float64), float(est.bin_prior))

        return self.depth._priced("one_row", tables)

    def _prices(self) -> tuple[list[float], list[float]]:
        """(the confidence scale per position, the thresholds), as the controller last priced them."""
        depth = self.depth
        return depth._priced("one_row_prices", lambda: (depth.estimator.scale(), depth.one_row_thresholds()))


class DepthController:
    """Decides each step how far every sequence drafts (before proposing) and how much of
    each draft is verified (after proposing), and learns from verification results."""

    def __init__(self, config: SpeculativeConfig, cost_model_loader=None, draft_cost_prior: float = 0.5):
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
        self.catch_up_cost = CatchUpCost()
        # Only D-Cut recalibrates drafter confidences against acceptance; otherwise the speculator
        # skips copying them to the host every step.
        self.tracks_confidence = self.pruning == "dcut"
        self._cost_model_loader = cost_model_loader
        self._cost = None
        # The live cost reprices every `reprice_every` steps, and the decisions priced from it (auto-k's depth
        # without a catch-up, the stop rule's thresholds) are kept as long (`_priced`): pricing them every step
        # was ~30 us of a ~0.75 ms D-Cut step at batch 1 (MTP k=3, W4A8). They depend on past steps only.
        self.reprice_every = 8
        self._priced_cache: dict = {}
        self._priced_epoch = -1
        self.guard = MeasuredGuard(self.k)
        # Every `unstopped_every`-th step D-Cut would stop rows while drafting drafts them to the planned
        # depth instead: only such steps measure acceptance per position (`update`).
        self.unstopped_every = 4
        # A width D-Cut would cut is verified whole when the live cost has not measured it in this many
        # steps of the batch-size bucket (or fewer than its min_samples times): see `verify_lengths`.
        self.width_horizon = 256
        # Every `full_depth_every`-th drafting plan of auto-k / D-Cut drafts to k and is verified whole (`plan`).
        self.full_depth_every = 32
        self._drafting_plans = 0
        self._stoppable_plans = 0
        self._last_arm: tuple[int, bool] | None = None  # the last step's (batch-size bucket, drafted)
        self._declined_switch = 0.0  # the switch cost `declines` priced, for `observe_declined`'s decision
        self.schedule_k: dict[str, int] = {}  # heuristic schedule: request id -> its current k

    @property
    def cost(self) -> LiveCost:
        if self._cost is None:
            self._cost = LiveCost(self._cost_model_loader(), reprice_every=self.reprice_every)
        return self._cost

    def _priced(self, key, compute):
        """`compute()`, kept under `key` until the live cost reprices."""
        if self._priced_epoch != self.cost.epoch:
            self._priced_cache.clear()
            self._priced_epoch = self.cost.epoch
        value = self._priced_cache.get(key)
        if value is None:
            value = self._priced_cache[key] = compute()
        return value

    @property
    def needs_cost_model(self) -> bool:
        return self.schedule == "auto" or self.pruning == "dcut"

    def declines(self, seqs: list[Sequence], pending_tokens: Callable[[Sequence], int]) -> bool:
        """Whether this step decodes without drafting, known before planning it: the guard has measured
        drafting slower at this batch size, or the plan's depth is 0 (the cost model's depth without a
        catch-up, or with the drafter's catch-up over `pending_tokens(seq)`), and the guard will not explore:
        none is due, or the one due keeps 0 (`MeasuredGuard.waits`). Such a step takes the speculator's lean
        path (`observe_declined`, not `plan` / `update`: the policy's bookkeeping of a planned step nobody
        drafted in was ~30 us of a ~0.7 ms MTP D-Cut step at W4A8, batch 1, on the ~95% of steps where the
        model declined; with waits planned, 44% of a declining engine's steps still planned, and its policy
        host work was 42 us a step, 22 with them lean; traced with 4 in flight, EAGLE-3 D-Cut at W4A8: the
        depth without a catch-up was 1, the prompts' catch-up made it 0, and every step planned, ~84 us of
        policy host work a ~1.5 ms step)."""
        self._declined_switch = 0.0
        if not (self.schedule == "auto" or self.pruning == "dcut"):
            return False
        B = len(seqs)
        if self.guard.declines(B):
            return True
        k = self._depth_without_catch_up(seqs)  # the plan's k, as `plan` prices it
        catch_up = None
        if k:
            catch_up = self.catch_up_time([pending_tokens(seq) for seq in seqs])
            if catch_up and not self._depth_with_catch_up(seqs, catch_up):
                k = 0
        if not self.guard.exploration_due(B):
            return k == 0  # where it is 0, `choose` returns 0 whatever the switch costs
        if not (k == 0 or self.guard.loses(B)):
            return False
        # The plan would price this catch-up and pass it to `choose`, which keeps 0 where the exploration waits.
        if catch_up is None:
            catch_up = self.catch_up_time([pending_tokens(seq) for seq in seqs])
        switch = catch_up / self.cost.step_time(B, B)
        if not self.guard.waits(B, switch):
            return False
        self._declined_switch = switch
        return True

    def _depth_without_catch_up(self, seqs: list[Sequence]) -> int:
        """auto_k's depth for this batch without a catch-up (kept until the live cost reprices: it depends
        on past steps and the batch size alone; without a catch-up `remaining` is moot)."""
        B = len(seqs)
        return self._priced(("auto_k", B), lambda: self._auto_k(B, sum(seq.room for seq in seqs) / B, 0.0))

    def _depth_with_catch_up(self, seqs: list[Sequence], catch_up_seconds: float) -> int:
        """auto_k's depth for this batch when drafting first pays a catch-up of `catch_up_seconds`. A depth of
        0 holds, until the live cost reprices, for every batch of this size with as long a catch-up and as few
        tokens left per sequence (auto_k is monotone in both; while nothing drafts, the catch-up grows every
        step and the room shrinks), so it is priced once per reprice, not every step."""
        B = len(seqs)
        remaining = sum(seq.room for seq in seqs) / B
        zero = self._priced(("zero_with_catch_up", B), list)  # [] or [catch-up seconds, remaining] priced at 0
        if zero and catch_up_seconds >= zero[0] and remaining <= zero[1]:
            return 0
        k = self._auto_k(B, remaining, catch_up_seconds)
        if k == 0:
            zero[:] = [catch_up_seconds, remaining]
        return k

    def _auto_k(self, B: int, remaining: float, catch_up_seconds: float) -> int:
        step = self.cost.step_time(B, B)
        return auto_k(self.cost, B, self.k, self.estimator, self.draft_cost.per_step * step, catch_up_seconds,
                      remaining, draft_fixed=self.draft_cost.fixed * step)

    def plan(self, seqs: list[Sequence], pending: list[int]) -> StepPlan:
        """This step's draft limits per sequence (also bounded by its remaining room: a step
        commits accepted + 1 tokens, so at most room - 1 drafts are useful). `pending[b]`: the
        committed tokens the drafter must consume before drafting for sequence b."""
        catching_up = prune = whole = False
        extra = 0
        if self.guard.declines(len(seqs)):  # tree proposers plan such steps too (the speculator's lean path is chains')
            per_seq = [self.guard.choose(len(seqs), 0)] * len(seqs)  # 0: nothing to price
        elif self.schedule == "auto" or self.pruning == "dcut":  # D-Cut sizes the draft first, then prunes it
            B = len(seqs)
            extra = self.catch_up_tokens(pending)
            catch_up = self._catch_up_seconds(extra, B)
            # A catch-up only adds to every drafting depth's cost, so where the depth without one is 0 (plain
            # decoding wins) so is this one: a policy that declines skips pricing it (while nothing is drafted,
            # the catch-up grows every step).
            k = self._depth_without_catch_up(seqs)
            if catch_up and k:
                k = self._depth_with_catch_up(seqs, catch_up)
            chosen = self.guard.choose(B, k, switch_steps=catch_up / self.cost.step_time(B, B))
            if chosen > 0:
                # Acceptance at a position is measured only where it is verified, and a width's cost only where
                # it is run: a policy that drafts shallow on its estimates never corrects them (traced at W4A8,
                # n-gram D-Cut, batch 1: runs that never verified more than 3 drafts kept positions 4-8 at
                # position 3's rate, 0.76-0.77, where runs that went deeper measured 0.85-0.99 there; the guard's
                # probes go one position deeper, and the cut may remove it). So now and then a drafting step
                # drafts to k and is verified whole.
                self._drafting_plans += 1
                if self._drafting_plans % self.full_depth_every == 0 and chosen < self.k:
                    chosen, whole = self.k, True
            catching_up = chosen > 0 and catch_up > 0
            # A guard probe (deeper than chosen) measures acceptance: drafting must not stop it early.
            prune = self.pruning == "dcut" and 0 < chosen <= k
            if prune:
                self._stoppable_plans += 1
                prune = self._stoppable_plans % self.unstopped_every != 0
            per_seq = [chosen] * B
        elif self.schedule == "heuristic":
            per_seq = [self.schedule_k.get(seq.request_id, self.k) for seq in seqs]
        else:
            per_seq = [self.k] * len(seqs)
        return StepPlan([max(0, min(k, seq.room - 1)) for k, seq in zip(per_seq, seqs)], catching_up,
                        extra if catching_up else 0, prune, verify_whole=whole)

    def draft_stop(self, plan: StepPlan) -> DraftStopRule | None:
        """The stop rule chain drafters apply after each drafter step this step (None: draft to the limit)."""
        if plan.prune_while_drafting and plan.stop_rule is None:
            plan.stop_rule = DraftStopRule(self)
        return plan.stop_rule

    def release(self, seq: Sequence) -> None:
        self.schedule_k.pop(seq.request_id, None)

    def verify_lengths(self, seqs: list[Sequence], num_tokens: list[int], confidence: list[list[float]] | None,
                       plan: StepPlan | None = None) -> list[int]:
        """How many of each sequence's drafts go to verification (n_min, then D-Cut, except on the
        plan's full-depth probes). Drafters without confidences (n-gram) are scored by each
        request's measured acceptance."""
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
        if self.pruning == "dcut" and max(lengths, default=0) > 0 and not (plan is not None and plan.verify_whole):
            conf = (self.estimator.calibrate(confidence) if confidence is not None
                    else self.estimator.confidence([s.stats for s in seqs]))
            cut = dcut_lengths(conf, lengths, self.cost, self.draft_seconds(len(lengths), max(num_tokens)))
            # A width the cut keeps removing is priced from the profile's shape and the nearest measured
            # width's correction, and nothing re-measures it while the cut removes it (traced at W4A8, n-gram
            # k=8, batch 1: runs that had verified at most 3 drafts priced width 5 at 2.3-2.9x a one-token
            # step, runs that had measured it at 1.7-2.4x). So a draft whose uncut width is stale
            # (`LiveCost.stale`) is verified whole.
            if cut != lengths and not self.cost.stale(len(lengths), len(lengths) + sum(lengths), self.width_horizon):
                lengths = cut
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
        B = len(tops)
        scale = self.estimator.scale()
        tau, width, survival = float(B), B, {}
        for b, row in enumerate(tops):
            survival[b], tau = self.one_row_survival(row, tau, scale)
            width += len(row)
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

    def one_row_thresholds(self) -> list[float]:
        """`keep_drafting` for one sequence as a threshold per position: after drafting position s,
        with survival a (its calibrated confidences' product) and tau = 1 + the survivals' sum, it
        drafts on iff a / tau > theta[s]. Drafting j more positions raises the expected rate,
        (tau + a G_j) / (F + j d + T(w + j)) > tau / (F + T(w)), iff a G_j (F + T(w)) > tau (j d +
        T(w + j) - T(w)); G_j: the expected accepted tokens per unit survival after j more, F: the
        drafting so far, d: one more drafter step, w = s + 2: the tokens verified now."""
        d = self.draft_step_time(1)
        out = []
        for s in range(self.k - 1):
            w = s + 2
            now = self.cost.step_time(1, w)
            base = self.draft_seconds(1, s + 1) + now
            theta, gain, survive = math.inf, 0.0, 1.0
            for j, rate in enumerate(self.estimator.rate[s + 1:], 1):
                survive *= rate
                gain += survive
                extra = j * d + self.cost.step_time(1, w + j) - now
                if gain > 0:
                    theta = min(theta, extra / (gain * base))
                elif extra < 0:  # cheaper and no worse: always worth it
                    theta = -math.inf
            out.append(theta)
        return out

    def one_row_survival(self, row: list[float], tau: float = 1.0,
                         scale: list[float] | None = None) -> tuple[float, float]:
        """(survival of the last position, tau + the survivals' sum) of one sequence's drafter
        confidences so far, calibrated (the C++ chain computes the same doubles in the same order)."""
        scale = self.estimator.scale() if scale is None else scale
        a = 1.0
        for i, top in enumerate(row):
            a *= self.estimator.calibrated(i, top, scale[i])
            tau += a
        return a, tau

    def catch_up_tokens(self, pending: list[int]) -> int:
        """Committed tokens the drafter must consume beyond a step's worth (<= k + 1 per sequence,
        part of a measured draft step already) before its first draft."""
        return sum(max(0, n - (self.k + 1)) for n in pending)

    def catch_up_time(self, pending: list[int]) -> float:
        """Expected seconds the drafter spends, before its first draft, on committed tokens it
        has not seen beyond a step's worth (the prompt the first time, or every token decoded
        while drafting was off): as catch-ups measured (`CatchUpCost`), else the drafter's share of
        the target's forward over them."""
        return self._catch_up_seconds(self.catch_up_tokens(pending), len(pending))

    def _catch_up_seconds(self, extra: int, B: int) -> float:
        """`catch_up_time` of `extra` tokens beyond a step's worth over B sequences."""
        if extra == 0:
            return 0.0
        measured = self.catch_up_cost.price(extra)
        if measured is not None:
            return measured * self.cost.step_time(1, 1)
        return self.draft_cost.per_step * max(0.0, self.cost.step_time(B, B + extra) - self.cost.step_time(B, B))

    def draft_step_time(self, batch_size: int) -> float:
        """Expected seconds of one more drafting step for `batch_size` sequences."""
        return self.draft_cost.per_step * self.cost.step_time(batch_size, batch_size)

    def draft_seconds(self, batch_size: int, steps: int) -> float:
        """Expected seconds of a proposal `steps` deep (steps=0: its fixed part alone)."""
        return (self.draft_cost.fixed + self.draft_cost.per_step * steps) * self.cost.step_time(batch_size, batch_size)

    def observe_declined(self, batch_size: int, step_seconds: float) -> None:
        """`plan` and `update` of a step `declines` let decode without drafting, in one call: the guard
        counts the decision and times the plain arm, the live cost times the forward. (A declined W4A8 step
        at batch 1 spent ~35 us more host work than a plain engine's step of ~0.45 ms; this path ~26.)"""
        self.guard.choose(batch_size, 0, switch_steps=self._declined_switch)
        self._observe_step(batch_size, False, batch_size, step_seconds, counts=True)
        if self._cost is not None:
            self._cost.observe(batch_size, batch_size, step_seconds)

    def _observe_step(self, batch_size: int, drafted: bool, tokens: int, seconds: float, counts: bool) -> None:
        """The guard's rate of this step's arm, when the step before it took the same arm (the first step
        after a switch pays for it) and `counts` (a catch-up is a one-time cost, priced by auto_k)."""
        arm = (batch_size.bit_length(), drafted)
        steady, self._last_arm = arm == self._last_arm, arm
        if counts and steady:
            # In units of the machine's speed when the step ran (the live cost's level, from every step's
            # target time): the guard compares rates measured minutes apart, and a slow spell while
            # drafting was measured froze drafting off for thousands of steps of a faster machine.
            speed = self._cost.factor(batch_size) if self._cost is not None else 1.0
            self.guard.observe(batch_size, drafted, tokens, seconds / speed)

    def update(self, plan: StepPlan, seqs: list[Sequence], num_draft: list[int], num_accepted: list[int],
               draft_seconds: float, num_draft_steps: int, confidence: list[list[float]] | None = None,
               step_seconds: float | None = None) -> None:
        # Where the stop rule shaped the drafts, which rows reached position i depended on their earlier
        # confidences: their acceptance there is a selected sample, and the rule's own lookahead priced with
        # it fed back on itself (traced, EAGLE-3 D-Cut at batch 1: rows went on past position 0 only when
        # the drafter was sure of it, and among those position 1 was accepted 19% of the time, 0.64 without
        # the rule; priced at that, the rule stopped 199 of 749 drafts after one token that was then accepted
        # 87% of the time, 0.83x fixed k's speed). Each draft's own confidence still calibrates (per bin).
        selected = plan.stop_rule is not None and plan.stop_rule.asked
        if self.needs_cost_model or self.confidence_threshold > 0:  # else nothing reads the estimator or the guard
            self.estimator.update(num_draft, num_accepted, confidence, per_position=not selected)
            self._observe_step(len(seqs), sum(num_draft) > 0, len(seqs) + sum(num_accepted), step_seconds or 0.0,
                               counts=bool(step_seconds) and not plan.catching_up)
        if num_draft_steps and self._cost is not None:
            units = draft_seconds / self._cost.step_time(len(seqs), len(seqs))
            if not plan.catching_up:
                self.draft_cost.observe(num_draft_steps, units)
            else:  # what the proposal took beyond its drafting, per token caught up on, in batch-1 steps
                own = self.draft_cost.fixed + self.draft_cost.per_step * num_draft_steps
                scale = self._cost.step_time(len(seqs), len(seqs)) / self._cost.step_time(1, 1)
                self.catch_up_cost.observe(plan.catch_up_tokens, (units - own) * scale)
        if step_seconds is not None and self._cost is not None:
            self._cost.observe(len(seqs), len(seqs) + sum(num_draft), step_seconds - draft_seconds)
        if self.schedule != "heuristic":
            return
        for seq, n, a in zip(seqs, num_draft, num_accepted):
            if n == 0:
                continue
            k = self.schedule_k.get(seq.request_id, self.k)
            self.schedule_k[seq.request_id] = min(self.k, k + 2) if a == n else max(1, k - 1)
