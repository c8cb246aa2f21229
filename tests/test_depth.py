"""Cost model, auto-k and D-Cut: pruning only shortens drafts, and stays lossless."""

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.sampling import SamplingBatch, process_logits
from specdecode.speculative.policy.cost_model import CostModel, LiveCost, load_or_profile, monotone
from specdecode.speculative.config import SpeculativeConfig
from specdecode.speculative.policy.controller import DepthController, DraftStopRule, StepPlan
from specdecode.speculative.policy.estimators import AcceptanceEstimator, DraftCost
from specdecode.speculative.policy.rules import auto_k, dcut_lengths, expected_committed
from specdecode.speculative.propose.proposer import Draft
from specdecode.speculative.verify.chain import verify

FREE_VERIFY = CostModel({1: {1: 0.01, 9: 0.01}, 64: {1: 0.01, 9: 0.01}}, 128)  # memory-bound: width is free
LINEAR = CostModel({1: {1: 0.01, 9: 0.09}, 64: {1: 0.64, 9: 5.76}}, 128)  # compute-bound: every token costs


def test_cost_model_interpolates_and_caches(native_model, tmp_path, monkeypatch):
    assert LINEAR.step_time(1, 5) == pytest.approx(0.05)
    assert LINEAR.step_time(64, 64 * 9) == pytest.approx(5.76)
    assert LINEAR.step_time(128, 128) == pytest.approx(1.28)  # beyond the profile: linear in batch
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    llm = LLM(native_model, dtype="float32", max_num_seqs=4)
    model = load_or_profile(llm.runner, llm.config.model, max_batch=4, max_width=3)
    assert set(model.table) == {1, 2, 4} and all(t > 0 for row in model.table.values() for t in row.values())
    again = load_or_profile(llm.runner, llm.config.model, max_batch=4, max_width=3)
    assert again.table == model.table  # read from the cache, not re-measured
    assert list(tmp_path.glob("cost/*.json"))


def test_auto_k_follows_cost_and_acceptance():
    def rates(alpha):
        return AcceptanceEstimator(8, prior=alpha)

    assert auto_k(FREE_VERIFY, 1, 8, rates(0.8), draft_step_time=0.0005) == 8
    assert auto_k(LINEAR, 64, 8, rates(0.3), draft_step_time=0.001) == 0  # plain decoding wins
    assert auto_k(LINEAR, 1, 8, rates(0.9), draft_step_time=0.0) == 0  # every token costs a step: never worth it
    affine = CostModel({1: {1: 0.012, 9: 0.028}}, 128)  # a fixed cost plus a little per token
    assert auto_k(affine, 1, 8, rates(0.6), draft_step_time=0.0) == 2
    assert expected_committed(0.5, 3) == pytest.approx(1.875) == rates(0.5).expected_committed(3)


def test_drafting_cost_scales_with_batch_and_is_learned():
    cost = CostModel({1: {1: 0.010, 5: 0.0105}, 64: {1: 0.064, 5: 0.200}}, 128)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, draft_length_schedule="auto")
    depth = DepthController(config, lambda: cost, draft_cost_prior=0.5)
    assert depth.draft_step_time(1) == pytest.approx(0.005) and depth.draft_step_time(64) == pytest.approx(0.032)
    # Unmeasured, drafting at batch 64 is assumed to cost half a target step per token: plain decoding wins.
    assert auto_k(cost, 64, 4, depth.estimator, depth.draft_step_time(64)) == 0
    for _ in range(100):  # measured at batch 1: 0.1 ms per drafting step (1% of a target step), all accepted
        depth.update(StepPlan([4]), [None], [4], [4], draft_seconds=4 * 0.0001, num_draft_steps=4)
    assert depth.draft_cost.per_step == pytest.approx(0.01, rel=0.05)
    assert depth.draft_step_time(64) == pytest.approx(0.01 * 0.064, rel=0.05)  # the ratio carries to batch 64
    assert auto_k(cost, 64, 4, depth.estimator, depth.draft_step_time(64)) == 4


def test_draft_cost_separates_a_fixed_part_from_the_per_position_part():
    cost = DraftCost(prior_per_step=0.5)
    for i in range(200):  # proposals 1-4 deep costing 0.15 + 0.3 per position (in target steps)
        steps = 1 + i % 4
        cost.observe(steps, 0.15 + 0.3 * steps)
    assert cost.per_step == pytest.approx(0.3, rel=0.02) and cost.fixed == pytest.approx(0.15, rel=0.05)
    same = DraftCost(prior_per_step=0.5)
    for _ in range(50):  # always 4 deep: the parts cannot be told apart, the average stands
        same.observe(4, 1.2)
    assert same.per_step == pytest.approx(0.3) and same.fixed == 0.0
    for _ in range(200):  # then always 4 deep (D-Cut planning k most steps): the learned split stands
        cost.observe(4, 0.15 + 0.3 * 4)
    assert cost.per_step == pytest.approx(0.3, rel=0.02) and cost.fixed == pytest.approx(0.15, rel=0.05)


def test_profile_noise_is_removed_by_monotonicity():
    # Batch 1 measured during a hiccup (slower than batch 2), and a width-3 outlier at batch 4.
    noisy = {1: {1: 0.012, 3: 0.0125}, 2: {1: 0.007, 3: 0.008}, 4: {1: 0.008, 3: 0.030, 5: 0.010}}
    clean = monotone(noisy)
    assert clean[1] == {1: 0.007, 3: 0.008} and clean[4] == {1: 0.008, 3: 0.010, 5: 0.010}
    assert clean[2] == noisy[2]  # consistent points are kept


def test_live_cost_follows_measured_steps():
    """A profile taken while the machine was busy is rescaled by what steps really take."""
    profile = CostModel({1: {1: 0.016, 5: 0.017}, 16: {1: 0.020, 5: 0.033}}, 128)
    live = LiveCost(profile)
    assert live.step_time(16, 16) == pytest.approx(0.020)  # unmeasured: the profile as is
    for _ in range(60):
        live.observe(16, 16, 0.012)  # batch-16 steps take 12 ms, not 20
    assert live.step_time(16, 16) == pytest.approx(0.012, rel=0.01)
    assert live.step_time(16, 80) == pytest.approx(0.033 * 0.6, rel=0.01)  # the profile's shape, the measured level
    assert live.step_time(1, 1) == pytest.approx(0.016 * 0.6, rel=0.01)  # unmeasured bucket: the nearest one's scale
    live.observe(1, 1, 0.011)
    assert live.step_time(1, 1) == pytest.approx(0.011)  # its own measurement first


def test_live_cost_learns_each_widths_measured_shape():
    """An engine step costs a near-constant amount beyond its forward and profile points are
    noisy, so one level per bucket keeps a wrong shape: a width measured often enough is priced
    by its own measurements, an unmeasured one by the nearest measured width's correction."""
    profile = CostModel({1: {1: 0.010, 3: 0.014, 5: 0.014}}, 128)  # widths 3 and 5 priced 1.4x width 1
    live = LiveCost(profile, min_samples=4)
    for _ in range(3):
        live.observe(1, 1, 0.010)
        live.observe(1, 2, 0.0105)
    assert live.step_time(1, 2) / live.step_time(1, 1) == pytest.approx(1.2)  # 3 steps: the profile's shape
    for _ in range(40):
        live.observe(1, 1, 0.010)
        live.observe(1, 2, 0.0105)  # the profile says 12 ms
    assert live.step_time(1, 1) == pytest.approx(0.010, rel=0.02)
    assert live.step_time(1, 2) == pytest.approx(0.0105, rel=0.02)
    assert live.step_time(1, 5) == pytest.approx(0.014 * 0.0105 / 0.012, rel=0.03)  # width 2's correction


def test_prices_and_the_decisions_priced_from_them_are_kept_until_the_live_cost_reprices():
    """Pricing anew after every step was a large part of what D-Cut's policy cost a step; an EMA moving
    10% a step changes a price little in a few steps. So prices last `reprice_every` observations, and
    the controller's decisions priced from them (auto-k's depth) last as long."""
    live = LiveCost(CostModel({1: {1: 0.010, 5: 0.012}}, 128), reprice_every=3)
    assert live.step_time(1, 1) == pytest.approx(0.010)
    for _ in range(2):
        live.observe(1, 1, 0.020)
    assert live.step_time(1, 1) == pytest.approx(0.010) and live.epoch == 0  # kept
    live.observe(1, 1, 0.020)
    assert live.step_time(1, 1) > 0.011 and live.epoch == 1  # repriced

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, draft_length_schedule="auto")
    depth = DepthController(config, lambda: FREE_VERIFY)
    depth.guard = type(depth.guard)(4, probe_every=1000)  # no probes deeper than auto-k's depth

    class Seq:
        room = 100

    first = depth.plan([Seq()], [1]).max_tokens
    assert first[0] > 0
    depth.estimator.rate = [0.0] * 4  # nothing is accepted any more
    assert depth.plan([Seq()], [1]).max_tokens == first  # the decision stands until the repricing
    for _ in range(depth.reprice_every):
        depth.cost.observe(1, 1, 0.01)
    assert depth.plan([Seq()], [1]).max_tokens == [0]


def test_drafter_catch_up_is_priced_and_amortised():
    """A large batch whose drafter has not seen the prompts must not draft a step or two just to
    pay a drafter prefill over every prompt; with many tokens left, the same catch-up pays off."""
    cost = CostModel({64: {1: 0.010, 5: 0.020, 32: 0.120}}, 128)  # drafting pays a little at 64 once caught up
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, draft_length_schedule="auto")

    class Seq:
        def __init__(self, room):
            self.room = room

    depth = DepthController(config, lambda: cost, draft_cost_prior=0.3)
    caught_up, behind = [2] * 64, [200] * 64  # tokens the drafter must consume first (200: every prompt)
    assert depth.catch_up_time(caught_up) == 0.0  # a step's worth is part of a draft step
    assert min(depth.plan([Seq(room=64)] * 64, caught_up).max_tokens) > 0
    assert depth.catch_up_time(behind) > 0
    assert depth.plan([Seq(room=64)] * 64, behind).max_tokens == [0] * 64
    long_run = [Seq(room=100_000)] * 64  # the same catch-up, spread over many steps
    plan = depth.plan(long_run, behind)
    assert min(plan.max_tokens) > 0 and plan.catching_up
    # That step's draft time includes the catch-up: it must not be learned as a draft step's cost.
    ratio = depth.draft_cost.per_step
    depth.update(plan, long_run, [2] * 64, [2] * 64, draft_seconds=5.0, num_draft_steps=2)
    assert depth.draft_cost.per_step == ratio


def test_a_policy_that_declines_without_a_catch_up_declines_with_one_without_pricing_it(monkeypatch):
    """A catch-up only adds to every drafting depth's cost: where auto-k drafts nothing without one, it
    drafts nothing with one, so a plan that declines does not price the catch-up again every step
    (it grows every step nothing is drafted); where drafting pays, the catch-up is still priced."""
    from specdecode.speculative.policy import controller

    estimator = AcceptanceEstimator(4, prior=0.7)
    for catch_up in (0.0, 0.001, 0.05, 1.0):
        assert auto_k(LINEAR, 1, 4, estimator, 0.001, catch_up, remaining_tokens=10) == 0
    affine = CostModel({1: {1: 0.012, 9: 0.028}}, 128)
    assert [auto_k(affine, 1, 4, estimator, 0.0, c, remaining_tokens=10) for c in (0.0, 0.2)] == [3, 0]

    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return auto_k(*args, **kwargs)

    monkeypatch.setattr(controller, "auto_k", counted)

    class Seq:
        room = 100

    for cost, drafts in ((LINEAR, False), (affine, True)):
        config = SpeculativeConfig(method="mtp", num_speculative_tokens=4, draft_length_schedule="auto")
        depth = DepthController(config, lambda: cost, draft_cost_prior=0.1)
        calls.clear()
        for pending in (10, 11, 12):  # behind by more every step
            depth.plan([Seq()], [pending])
        # Declining: only the depth without a catch-up, priced once until the live cost reprices.
        assert len(calls) == (1 + 3 if drafts else 1)


def test_a_depth_of_zero_with_a_catch_up_is_kept_only_where_pricing_it_again_gives_zero():
    """The plan's depth with a catch-up is priced once per reprice where it is 0 (a declining engine's
    catch-up grows every step and its room shrinks; pricing it every step was most of the policy's host
    work with 4 in flight): in every state a run reaches (catch-ups growing and reset, requests joining
    with more room, acceptance and drafting cost swinging, reprices), the kept depth equals auto_k's."""
    import random

    rng = random.Random(1)
    affine = CostModel({1: {1: 0.012, 9: 0.028}, 4: {1: 0.02, 9: 0.06}}, 128)
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: affine, draft_cost_prior=0.05)

    class Seq:
        def __init__(self, room):
            self.room = room

    kept = 0
    seqs, catch_up = [Seq(100)], 0.0
    for step in range(4000):
        if rng.random() < 0.03:  # a new batch: fresh rooms, any size, the drafter caught up or not
            seqs, catch_up = [Seq(rng.randint(2, 400)) for _ in range(rng.choice([1, 4]))], rng.choice([0.0, 0.01])
        if rng.random() < 0.03:  # a request joins in place of one: more room, a longer catch-up (its prompt)
            seqs[rng.randrange(len(seqs))] = Seq(rng.randint(200, 4000))
            catch_up += 0.01
        if rng.random() < 0.01:  # the drafter caught up (a drafting step)
            catch_up = rng.uniform(0.0, 0.01)
        if rng.random() < 0.05:  # drafting measured (the kept prices, like every one, hold until a reprice)
            depth.estimator.update([4], [rng.randint(0, 4)], None)
            depth.draft_cost.observe(4, rng.choice([0.05, 0.5]))
            for _ in range(depth.reprice_every):
                depth.cost.observe(len(seqs), len(seqs), 0.02)
        if rng.random() < 0.2:
            depth.cost.observe(len(seqs), len(seqs), rng.uniform(0.01, 0.03))  # reprices every 8 observations
        for seq in seqs:
            seq.room = max(1, seq.room - 1)
        catch_up += rng.uniform(0.0, 0.1)
        B = len(seqs)
        priced = auto_k(depth.cost, B, 4, depth.estimator, depth.draft_step_time(B), catch_up,
                        sum(seq.room for seq in seqs) / B, draft_fixed=depth.draft_seconds(B, 0))
        zero = depth._priced(("zero_with_catch_up", B), list)
        kept += bool(zero) and catch_up >= zero[0]
        assert depth._depth_with_catch_up(seqs, catch_up) == priced, step
    assert kept > 200


def test_a_catch_up_is_priced_by_what_catch_ups_measured():
    """The drafter's decode-step share of the target's forward priced a prompt's catch-up 4-6x
    too dear (traced: EAGLE-3 at batch 1); a proposal that caught up teaches the cost per token."""
    cost = CostModel({1: {1: 0.010, 5: 0.011, 32: 0.040}, 4: {1: 0.020, 5: 0.024, 32: 0.100}}, 128)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_pruning="dcut")

    class Seq:
        room = 10_000

    depth = DepthController(config, lambda: cost, draft_cost_prior=0.3)
    prior = depth.catch_up_time([205])  # 200 tokens beyond a step's worth
    assert depth.catch_up_tokens([205, 3]) == 200 and prior > 0
    plan = depth.plan([Seq()], [205])
    assert plan.catching_up and plan.catch_up_tokens == 200
    # Drafting 4 deep is priced 0.3 x 4 = 1.2 steps of 10 ms; the proposal took that and 0.2 ms per token caught up.
    depth.update(plan, [Seq()], [4], [2], draft_seconds=0.012 + 200 * 0.0002, num_draft_steps=4)
    assert depth.catch_up_cost.per_token == pytest.approx(0.02, rel=0.05)  # 0.2 ms a token, in 10 ms steps
    assert depth.catch_up_time([205]) == pytest.approx(200 * 0.0002, rel=0.05)
    assert depth.catch_up_time([205]) < prior
    # At batch 4 in that run's units (a batch-4 step is 20 ms): the same seconds per token.
    plan4 = depth.plan([Seq()] * 4, [55] * 4)
    depth.update(plan4, [Seq()] * 4, [4] * 4, [2] * 4, draft_seconds=4 * 0.3 * 0.020 + 200 * 0.0002, num_draft_steps=4)
    assert depth.catch_up_time([55] * 4) == pytest.approx(200 * 0.0002, rel=0.05)


def test_a_probe_waits_for_its_catch_up_at_most_max_wait_decisions():
    """A catch-up priced above the budget per token grows as fast as the wait for it: without a
    bound a guard whose drafting once measured slower never measured it again."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=16, min_samples=1, max_wait=200,
                          settle_samples=1)
    guard.observe(1, drafted=True, tokens=2, seconds=0.010)
    guard.observe(1, drafted=False, tokens=1, seconds=0.004)  # drafting loses
    drafted = [i for i in range(1, 301) if guard.choose(1, 4, switch_steps=0.05 * (i + 100)) > 0]
    assert drafted[:4] == [200, 201, 202, 203]


def test_auto_k_explores_at_batch_1_before_any_measurement():
    """A fresh controller must draft at batch 1 (where drafting usually pays) to learn acceptance at all."""
    cost = CostModel({1: {1: 0.010, 5: 0.012}, 64: {1: 0.064, 5: 0.250}}, 128)  # batch 1 memory-bound, 64 compute-bound
    depth = DepthController(SpeculativeConfig(method="draft_model", num_speculative_tokens=4, draft_length_schedule="auto"),
                            lambda: cost, draft_cost_prior=0.5)
    assert auto_k(cost, 1, 4, depth.estimator, depth.draft_step_time(1)) > 0
    assert auto_k(cost, 64, 4, depth.estimator, depth.draft_step_time(64)) == 0


def test_estimator_learns_positions_and_calibrates_confidences():
    est = AcceptanceEstimator(4)
    for _ in range(200):  # only 2-token drafts so far: position 1 accepted 80%, position 2 40%
        est.update([2] * 10, [2] * 4 + [1] * 4 + [0] * 2, [[0.5, 0.5]] * 10)
    assert est.rate[0] == pytest.approx(0.8, abs=0.02) and est.rate[1] == pytest.approx(0.5, abs=0.02)
    assert est.rate[3] == est.rate[1]  # never drafted: inherits the deepest observed rate
    assert est.calibrate([[0.5, 0.5, 0.5, 0.5]])[0][:2] == pytest.approx([0.8, 0.5], abs=0.02)


def test_confidences_are_calibrated_per_bin_not_scaled():
    """Drafts the drafter is unsure of are still often accepted: scaling confidences to the mean
    priced them far too low (and cut them). Each confidence bin learns its own acceptance; bins a
    position has not measured take every position's, and unmeasured bins the scaled confidence."""
    est = AcceptanceEstimator(2)
    for _ in range(300):  # position 0 only: 0.05-confident drafts accepted half the time, 0.95 ones always
        est.update([1] * 4, [0, 1, 1, 1], [[0.05], [0.05], [0.95], [0.95]])
    scale = est.scale()[0]
    assert min(1.0, 0.05 * scale) < 0.2  # what scaling alone made of them
    low, high = est.calibrate([[0.05, 0.05], [0.95, 0.95]])
    assert low[0] == pytest.approx(0.5, abs=0.05) and high[0] == pytest.approx(1.0, abs=0.02)
    assert low[1] == pytest.approx(0.5, abs=0.05)  # position 1 never verified: the pooled bin
    assert est.calibrate([[0.45]])[0][0] == pytest.approx(min(1.0, 0.45 * scale), abs=1e-6)  # no bin data yet
    for _ in range(300):  # position 1's own record replaces the pooled one
        est.update([2] * 2, [2, 2], [[0.95, 0.05], [0.95, 0.05]])
    assert est.calibrate([[0.95, 0.05]])[0][1] == pytest.approx(1.0, abs=0.05)


def test_requests_without_drafter_confidence_are_scored_by_their_own_record():
    """n-gram drafts carry no confidence: each request's measured acceptance stands in, blended
    with the batch-wide rate, so the request whose drafts keep failing is cut first."""
    from specdecode.speculative.stats import SpecStats

    est = AcceptanceEstimator(3, prior=0.5)
    repeats, never, fresh = SpecStats(), SpecStats(), SpecStats()
    for _ in range(10):
        repeats.observe(3, 3)  # every draft accepted
        never.observe(3, 0)  # position 0 always rejected
    conf = est.confidence([repeats, never, fresh])
    assert conf[0] == pytest.approx([12 / 14] * 3)
    assert conf[1][0] == pytest.approx(2 / 14) and conf[1][1:] == [0.5, 0.5]  # positions 1, 2 never reached
    assert conf[2] == [0.5, 0.5, 0.5]  # no record yet: the batch-wide rate
    each_token_costs_a_little = CostModel({3: {1: 0.030, 4: 0.036}}, 128)
    assert dcut_lengths(conf, [3, 3, 3], each_token_costs_a_little, 0.0) == [3, 1, 3]


def test_dcut_keeps_prefixes_and_first_positions():
    conf = [[0.9, 0.9, 0.9, 0.9], [0.2, 0.2, 0.2, 0.2], [0.6, 0.5, 0.4, 0.3]]
    assert dcut_lengths(conf, [4, 4, 4], FREE_VERIFY, 0.0) == [4, 4, 4]  # free verification: keep everything
    cut = dcut_lengths(conf, [4, 4, 4], LINEAR, 0.0)
    assert cut[0] >= cut[2] >= cut[1] == 1  # every request keeps its first position
    assert dcut_lengths(conf, [4, 0, 2], LINEAR, 0.0)[1] == 0


def test_a_catch_up_is_priced_as_a_fixed_part_plus_a_part_per_token():
    """A catch-up runs as a forward of its own: short ones cost mostly that (traced, MTP W4A8 batch 1:
    1-20 tokens at 0.1-0.97 steps a token, prompts of 89-129 at 0.03-0.05). Fitted as fixed + per
    token, a prompt's catch-up is priced at what it costs, where one average per token priced it
    4-6x dearer and auto-k stopped drafting for the rest of the run."""
    from specdecode.speculative.policy.estimators import CatchUpCost

    catch_up = CatchUpCost()
    assert catch_up.price(10) is None
    for n in (115, 1, 9, 20, 14, 125, 1, 89, 2, 115, 3, 125, 89, 121, 4, 129):  # the traced lengths
        catch_up.observe(n, 0.5 + 0.04 * n)
    assert catch_up.fixed == pytest.approx(0.5, abs=0.01) and catch_up.per_token == pytest.approx(0.04, abs=1e-3)
    assert catch_up.price(129) == pytest.approx(0.5 + 0.04 * 129, rel=0.01)
    same_length = CatchUpCost()  # lengths too alike to separate the parts: the average per token
    for _ in range(3):
        same_length.observe(100, 4.0)
    assert same_length.fixed == 0.0 and same_length.price(50) == pytest.approx(2.0)


def test_dcut_prices_a_forward_at_most_any_wider_ones():
    """A live cost can measure a width above the next one (traced at W4A8, batch 1: width 3 ran
    mostly after shallow plans and switches from plain decoding). D-Cut prices each forward at most
    a wider one's, so that bump does not stop it short of a deeper draft that pays."""
    bumped = CostModel({1: {1: 0.30, 2: 0.35, 3: 0.60, 4: 0.46}}, 128)  # width 3 above width 4
    conf = [[0.9, 0.9, 0.9]]
    assert dcut_lengths(conf, [3], bumped, 0.2) == [3]
    rising = CostModel({1: {1: 0.30, 2: 0.35, 3: 0.60, 4: 0.90}}, 128)  # where wider really costs more: cut
    assert dcut_lengths(conf, [3], rising, 0.2) == [1]
    # Batches: a forward of N tokens is priced at most the whole batch at ceil(N / B) tokens each.
    batch = CostModel({2: {1: 0.30, 2: 0.35, 3: 0.60, 4: 0.46}}, 128)
    assert dcut_lengths([[0.9, 0.9, 0.9]] * 2, [3, 3], batch, 0.2) == [3, 3]


def test_acceptance_per_position_is_learned_only_from_drafts_the_stop_rule_did_not_shape():
    """Where D-Cut's stop rule decided how deep each row drafted, a row reached position i because
    its earlier confidences were high: its acceptance there is a selected sample, and the rule's
    lookahead, priced with it, fed back on itself (traced at batch 1: position 1 at 19%, so drafts
    stopped after one token that was then accepted 87% of the time). Those steps calibrate the
    confidence bins only; every 4th drafting step the rule would shape drafts to the planned depth instead
    (the guard's plain steps in between draft nothing and are not counted)."""
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: FREE_VERIFY, draft_cost_prior=0.01)

    class Seq:
        room = 100

    plans = [depth.plan([Seq()], [1]) for _ in range(24)]
    drafting = [p for p in plans if p.drafts][:8]
    assert len(drafting) == 8 and not any(p.prune_while_drafting for p in plans if not p.drafts)
    assert [p.prune_while_drafting for p in drafting] == [True, True, True, False] * 2
    plans = drafting
    stopped, unstopped = plans[0], plans[3]
    rule = depth.draft_stop(stopped)
    assert depth.draft_stop(stopped) is rule and depth.draft_stop(unstopped) is None
    rule(0, [[0.9]], [0])  # the proposal asked the rule
    before, bins = list(depth.estimator.rate), sum(depth.estimator.pooled)
    depth.update(stopped, [Seq()], [2], [0], draft_seconds=0.0, num_draft_steps=2, confidence=[[0.9, 0.9]])
    assert depth.estimator.rate == before  # a selected sample: not learned per position
    assert sum(depth.estimator.pooled) > bins  # the draft's own confidence still calibrates
    depth.update(unstopped, [Seq()], [2], [0], draft_seconds=0.0, num_draft_steps=2, confidence=[[0.9, 0.9]])
    assert depth.estimator.rate[0] < before[0]
    never_asked = depth.plan([Seq()], [1])  # a stoppable step whose proposal never consulted its rule
    depth.draft_stop(never_asked)
    rate = depth.estimator.rate[0]
    depth.update(never_asked, [Seq()], [1], [0], draft_seconds=0.0, num_draft_steps=1, confidence=[[0.9]])
    assert depth.estimator.rate[0] < rate


@pytest.mark.parametrize("config", [
    {"method": "ngram", "prompt_lookup_min": 1, "verify_pruning": "dcut"},
    {"method": "ngram", "prompt_lookup_min": 1, "draft_length_schedule": "auto"},
    {"method": "draft_model", "verify_pruning": "dcut", "draft_length_schedule": "auto"},
])
def test_greedy_output_unchanged_with_auto_k_and_dcut(native_model, native_drafter, tmp_path, monkeypatch, config):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    if config["method"] == "draft_model":
        config = {**config, "model": str(native_model)}  # drafter == target: long drafts worth keeping
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 5, 17, 99, 5, 17], [8, 200, 31, 77], [42], [100, 101])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(prompts, params)
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config={**config, "num_speculative_tokens": 4})
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_dcut_stops_drafting_rows_it_would_prune():
    """D-Cut's drafting half: confident rows draft on, unsure ones stop; where verification is
    free everyone drafts on, and where every verified token costs a step nothing does."""
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, verify_pruning="dcut")

    def controller(table, draft_cost):
        return DepthController(config, lambda: CostModel({4: table}, 128), draft_cost_prior=draft_cost)

    tops = [[0.95], [0.9], [0.05], [0.1]]  # after position 0: two sure rows, two unsure ones
    depth = controller({1: 0.010, 2: 0.011, 5: 0.014}, 0.1)  # each verified column costs 10% of a step
    assert depth.keep_drafting(0, tops, [0, 1, 2, 3]) == [0, 1]
    assert depth.keep_drafting(0, tops, [2, 3]) == []  # the unsure rows alone are not worth a drafter step
    assert controller({1: 0.010, 5: 0.010}, 0.0001).keep_drafting(0, tops, [0, 1, 2, 3]) == [0, 1, 2, 3]
    assert controller({1: 0.010, 5: 0.050}, 0.1).keep_drafting(0, tops, [0, 1, 2, 3]) == []
    # A guard probe (or no D-Cut) plans no pruning: chain drafters get no stop rule and run to their limit.
    assert isinstance(depth.draft_stop(StepPlan([4] * 4, prune_while_drafting=True)), DraftStopRule)
    assert depth.draft_stop(StepPlan([4] * 4, prune_while_drafting=False)) is None


@pytest.mark.parametrize("table,draft_cost", [({1: 0.010, 3: 0.011, 6: 0.013, 9: 0.016}, 0.1),
                                              ({1: 0.010, 9: 0.010}, 0.02), ({1: 0.010, 9: 0.03}, 0.15)])
def test_the_one_sequence_stop_rule_decides_as_keep_drafting(table, draft_cost):
    """At batch 1 D-Cut's stop rule is a threshold per position on survival / tau, priced once per
    proposal (what the C++ chain evaluates): it must decide as the general rule does."""
    config = SpeculativeConfig(method="eagle3", num_speculative_tokens=5, verify_pruning="dcut")
    g = torch.Generator().manual_seed(0)
    decisions = []
    for trial in range(40):
        depth = DepthController(config, lambda: CostModel({1: table}, 128), draft_cost_prior=draft_cost)
        for _ in range(int(torch.randint(0, 60, (1,), generator=g))):  # a random history of verified drafts
            n = int(torch.randint(1, 6, (1,), generator=g))
            conf = torch.rand(n, generator=g).tolist()
            depth.estimator.update([n], [int(torch.randint(0, n + 1, (1,), generator=g))], [conf])
        rule = DraftStopRule(depth)
        row = []
        for step in range(4):
            row.append(float(torch.rand(1, generator=g)) ** 0.5)
            decision = rule(step, [row], [0])
            assert decision == depth.keep_drafting(step, [row], [0]), (trial, step)
            decisions.append(bool(decision))
        assert rule(0, [row[:1]], []) == []
    assert any(decisions) and not all(decisions)  # both outcomes were tested


def test_stopping_rows_while_drafting_keeps_greedy_output(native_model, native_drafter):
    """The drafting loop honours a stop rule (here: only the first still-drafting row goes on)."""
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99, 5, 17, 99, 5, 17], [8, 200, 31, 77], [42], [100, 101])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(prompts, params)
    spec = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config={
        "method": "draft_model", "model": str(native_model), "num_speculative_tokens": 4})
    calls = []
    spec.speculator.depth.draft_stop = lambda plan: lambda step, tops, rows: calls.append(len(rows)) or rows[:1]
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert max(calls) > 1  # rows really were stopped


# ---- D-Cut under sampling: the kept prefix may depend on x_<i, never on x_i ----------------

V, N, GROUP = 6, 120_000, 4


def _setup():
    g = torch.Generator().manual_seed(11)
    target_logits = torch.randn(3, V, generator=g) * 1.5
    draft_logits = torch.randn(2, V, generator=g) * 1.5
    one = SamplingBatch.build([SamplingParams(temperature=1.0)], [None], "cpu")
    p = process_logits(target_logits, one.repeat_rows([3]))
    q = process_logits(draft_logits, one.repeat_rows([2]))
    return target_logits, p, q


def _run(confidence_of):
    torch.manual_seed(3)
    target_logits, p, q = _setup()
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True) for i in range(2)], dim=1)  # [N, 2]
    conf = confidence_of(drafts, q)  # [N, 2]
    cost = CostModel({GROUP: {1: 1.0, 2: 1.1, 3: 1.2}}, 128)  # each extra position costs ~10% of a step
    lengths = []
    for start in range(0, N, GROUP):  # batches of 4 requests pruned together
        lengths += dcut_lengths(conf[start:start + GROUP].tolist(), [2] * GROUP, cost, 0.0)
    lengths = torch.tensor(lengths)
    drafts = torch.where(torch.arange(2)[None, :] < lengths[:, None], drafts, -1)
    batch = SamplingBatch.build([SamplingParams(temperature=1.0)] * N, [None] * N, "cpu")
    out = verify(Draft(drafts, lengths, q.expand(N, 2, V)), target_logits.expand(N, 3, V), batch)
    kept_second = (lengths == 2).float().mean().item()
    freq = torch.bincount(out.token_ids[:, 0], minlength=V).double() / N
    second = out.token_ids[out.num_accepted >= 1, 1]
    freq2 = torch.bincount(second, minlength=V).double() / len(second)
    return 0.5 * (freq - p[0]).abs().sum().item(), 0.5 * (freq2 - p[1]).abs().sum().item(), kept_second


def test_dcut_with_prefix_confidence_keeps_the_target_distribution():
    # Confidence at position i from the drafter's distribution there (prefix-only), plus noise
    # from the other requests of the batch: the cut varies, the distribution must not.
    def prefix_only(drafts, q):
        return torch.stack([q[0].max().expand(len(drafts)), q[1].max() * (0.5 + drafts[:, 0].float() / 10)], dim=1)

    tv1, tv2, kept = _run(prefix_only)
    assert 0.05 < kept < 0.95  # the cut really happens, for some rows only
    assert tv1 < 0.01 and tv2 < 0.015


def test_dcut_with_token_dependent_confidence_would_be_biased():
    # Negative control: confidence q(x_i) of the sampled token itself shifts the distribution.
    def chosen_token(drafts, q):
        return torch.stack([q[0][drafts[:, 0]], q[1][drafts[:, 1]]], dim=1)

    tv1, tv2, _ = _run(chosen_token)
    assert max(tv1, tv2) > 0.015  # the correct rule stays below 0.005 here


def test_measured_guard_stops_drafting_where_it_measures_slower():
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=100, min_samples=1)
    assert [guard.choose(16, 0) for _ in range(4)] == [0, 0, 0, 0]  # unmeasured: the model's "no" stands
    assert [guard.choose(16, 3) for _ in range(4)] == [3, 3, 3, 0]  # unmeasured: draft, sometimes measure plain
    guard.observe(16, drafted=True, tokens=40, seconds=0.040)  # 1000 tok/s drafting
    guard.observe(16, drafted=False, tokens=16, seconds=0.012)  # 1333 tok/s plain: drafting loses here
    # The rest of the plain burst that started at decision 4, then plain; drafting re-measured
    # for a burst of 4 once 4 decisions have passed since the last burst ended.
    assert [guard.choose(16, 3) for _ in range(8)] == [0, 0, 0, 0, 0, 0, 3, 3]
    # The drafting burst's last two steps (at full depth where the model now says 0), then no re-measurement
    # before the next exploration.
    assert [guard.choose(16, 0) for _ in range(4)] == [4, 4, 0, 0]
    assert guard.choose(1, 3) == 3  # another batch-size bucket has its own measurements
    for _ in range(50):
        guard.observe(16, drafted=True, tokens=60, seconds=0.040)  # drafting got better: 1500 tok/s
    assert [guard.choose(16, 3) for _ in range(3)] == [3, 3, 3]
    # Where drafting pays, a declined step drafts a burst at full depth now and then (acceptance is
    # only measured where drafts are verified), and drafting steps sometimes go one position deeper.
    assert [guard.choose(16, 0) for _ in range(5)] == [0, 0, 4, 4, 4]  # decisions 24..28 of this bucket
    probing = MeasuredGuard(k_max=4, explore_every=1000, probe_every=4, first_explore=1000)
    assert [probing.choose(1, 2) for _ in range(8)] == [2, 3, 2, 2, 2, 3, 2, 2]
    assert [probing.choose(1, 4) for _ in range(4)] == [4, 4, 4, 4]  # never beyond the configured k


def test_measured_guard_backs_off_while_drafting_keeps_losing():
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=16, min_samples=1)
    guard.observe(64, drafted=True, tokens=100, seconds=0.1)
    guard.observe(64, drafted=False, tokens=64, seconds=0.03)  # drafting loses at batch 64
    drafted_at = [i for i in range(1, 61) if guard.choose(64, 4) > 0]
    # Re-measured 4, 8, 16, 16 decisions after the last re-measurement ended, each time for a burst
    # of 4 drafting steps (the first of a burst pays the drafter's catch-up and is not measured).
    assert drafted_at == [4, 5, 6, 7, 15, 16, 17, 18, 34, 35, 36, 37, 53, 54, 55, 56]


def test_measured_guard_backs_off_re_measuring_plain_decoding_while_drafting_keeps_winning():
    """Each re-measurement of plain decoding where drafting wins costs drafting's margin on its
    steps: the interval doubles while the verdict holds (4, 4, 8, 16, 32, 32 here)."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=32, min_samples=1)
    guard.observe(1, drafted=True, tokens=3, seconds=0.02)  # 150 tok/s drafting
    guard.observe(1, drafted=False, tokens=1, seconds=0.01)  # 100 tok/s plain
    plain_at = [i for i in range(1, 121) if guard.choose(1, 4) == 0]
    assert plain_at == [4, 5, 6, 7, 11, 12, 13, 14, 22, 23, 24, 25, 41, 42, 43, 44, 76, 77, 78, 79, 111, 112, 113, 114]


def test_a_drafting_probe_waits_while_the_drafters_catch_up_is_dear():
    """Re-measuring drafting where it loses (or probing acceptance) first pays the drafter's
    catch-up over everything decoded since it stopped: it waits until that is at most 3% of the
    decisions since the last probe. Where nothing is due, the guard declines whatever k is."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    def losing_guard():
        guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=16, min_samples=1,
                              settle_samples=1)
        guard.observe(4, drafted=True, tokens=6, seconds=0.010)
        guard.observe(4, drafted=False, tokens=4, seconds=0.004)  # drafting loses at batch 4
        return guard

    cheap = losing_guard()
    assert [i for i in range(1, 61) if cheap.choose(4, 2, switch_steps=0.05) > 0] == [
        4, 5, 6, 7, 15, 16, 17, 18, 34, 35, 36, 37, 53, 54, 55, 56]
    dear = losing_guard()  # a catch-up worth 3 plain steps: the burst starts 100 decisions in
    assert [i for i in range(1, 121) if dear.choose(4, 2, switch_steps=3.0) > 0] == [100, 101, 102, 103]
    probe = losing_guard()  # the model declined: its re-measurement waits the same way
    assert [i for i in range(1, 201) if probe.choose(4, 0, switch_steps=3.0) > 0] == [100, 101, 102, 103]
    declining = losing_guard()
    assert [declining.declines(4) for _ in range(3)] == [True] * 3  # asking changes nothing
    assert [(declining.declines(4), declining.choose(4, 2)) for _ in range(4)] == [(True, 0)] * 3 + [(False, 2)]


def test_an_exploration_waits_for_the_catch_up_only_once_drafting_rests_on_enough_steps():
    """A verdict against drafting from a request's first few drafting steps is re-measured when due,
    catch-up or not: waiting for the catch-up to fit the budget decoded the rest of that request and
    the next plainly (EAGLE-3 D-Cut, batch 1, a fresh engine). Once drafting's rate rests on
    `settle_samples` steps, explorations wait as before."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=8, probe_every=1000, max_interval=64, min_samples=4, settle_samples=16)
    for _ in range(4):  # a request's first drafting steps accepted little: drafting loses
        guard.observe(1, drafted=True, tokens=1, seconds=0.002)
        guard.observe(1, drafted=False, tokens=1, seconds=0.001)
    assert guard.loses(1)
    # A catch-up worth 3 plain steps does not hold back the bursts (every 8, then 16 decisions).
    assert [i for i in range(1, 41) if guard.choose(1, 4, switch_steps=3.0) > 0] == [8, 9, 10, 11, 27, 28, 29, 30]
    for _ in range(12):  # 16 drafting steps, still losing: settled
        guard.observe(1, drafted=True, tokens=1, seconds=0.002)
    assert guard.loses(1) and guard.waits(1, 3.0)
    # Now the next exploration waits until the catch-up is 3% of the decisions since the last (100).
    assert [i for i in range(1, 121) if guard.choose(1, 4, switch_steps=3.0) > 0][:4] == [90, 91, 92, 93]


def test_a_declined_step_re_measures_drafting_at_backing_off_intervals_where_drafting_lost():
    """auto-k / D-Cut decline from their estimates (acceptance per position, drafting cost); only
    drafting refreshes them, so a guard that never drafted where drafting had measured slower froze
    them (batch 1, EAGLE-3), and one-token probes refreshed position 0 alone: a burst at full depth."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=16, min_samples=1)
    assert [guard.choose(1, 0) for _ in range(8)] == [0] * 8  # unmeasured: the model's "no" stands
    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=16, min_samples=1)
    guard.observe(1, drafted=True, tokens=1, seconds=0.030)
    guard.observe(1, drafted=False, tokens=1, seconds=0.010)  # drafting lost at batch 1
    choices = [guard.choose(1, 0) for _ in range(60)]
    # Bursts of 4 once 4, 8, 16, 16 decisions have passed since the last one began (bursts do not count).
    assert [i + 1 for i, k in enumerate(choices) if k] == [4, 5, 6, 7, 15, 16, 17, 18, 34, 35, 36, 37, 53, 54, 55, 56]
    assert set(choices) == {0, 4}  # at the full depth


def test_a_declined_step_re_measures_drafting_that_was_tried_but_not_yet_measured():
    """A bucket that drafted a step or two (too few to measure the arm) and whose model then declines
    from the acceptance those drafts showed must still draft a burst now and then: else the model's
    "no" rests on them for good (traced, MTP D-Cut at batch 1: nothing drafted for whole runs)."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=32, probe_every=1000, first_explore=4, min_samples=4)
    assert [guard.choose(1, 3) for _ in range(2)] == [3, 3]  # drafted on the prior
    guard.observe(1, drafted=True, tokens=1, seconds=0.030)  # nothing accepted
    for _ in range(4):
        guard.observe(1, drafted=False, tokens=1, seconds=0.010)
    assert guard.rate(1, True) is None
    choices = [guard.choose(1, 0) for _ in range(8)]  # the model now says no
    assert choices == [0, 4, 4, 4, 4, 0, 0, 0]  # a burst at full depth from the 4th decision
    never = MeasuredGuard(k_max=4, explore_every=32, probe_every=1000, first_explore=4, min_samples=4)
    assert [never.choose(1, 0) for _ in range(8)] == [0] * 8  # a bucket that never drafted: the "no" stands


def test_measured_guard_needs_several_steps_per_arm():
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=32, probe_every=1000, first_explore=4, min_samples=4)
    guard.observe(1, drafted=True, tokens=1, seconds=0.030)  # two unlucky drafting steps: nothing accepted
    guard.observe(1, drafted=True, tokens=1, seconds=0.030)
    for _ in range(4):
        guard.observe(1, drafted=False, tokens=1, seconds=0.010)  # plain: 100 tok/s
    assert guard.rate(1, True) is None  # two steps are no verdict: drafting goes on
    assert [guard.choose(1, 3) for _ in range(3)] == [3, 3, 3]
    for _ in range(2):
        guard.observe(1, drafted=True, tokens=5, seconds=0.025)  # typical drafting steps: 200 tok/s
    assert guard.rate(1, True) == pytest.approx(12 / 0.110)  # the first steps averaged equally
    assert guard.rate(1, True) > guard.rate(1, False)


def test_measured_guard_measures_both_arms_early():
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=32, probe_every=1000, first_explore=4, min_samples=1)
    # A fresh bucket: drafting on the model's word, plain decoding measured from the 4th decision
    # (not the 32nd) for a burst of 4 steps, then again 4 decisions later until it has been measured.
    assert [guard.choose(16, 3) for _ in range(12)] == [3, 3, 3, 0, 0, 0, 0, 3, 3, 3, 0, 0]
    guard.observe(16, drafted=True, tokens=40, seconds=0.040)
    guard.observe(16, drafted=False, tokens=16, seconds=0.012)  # drafting loses: plain from now on
    assert [guard.choose(16, 3) for _ in range(8)] == [0] * 8


def test_the_guard_compares_steps_in_units_of_the_machines_speed_at_the_time():
    """Drafting measured during a slow spell of the machine, plain decoding after it: in wall
    seconds drafting looks slower and would stay off; in units of the machine's speed (the live
    cost model's level, which steps of measured widths move) it measures as what it is."""
    cost = CostModel({1: {1: 0.010, 5: 0.011}}, 128)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: cost)
    assert depth.cost.factor(1) == 1.0  # the live cost model exists once a step is planned
    for _ in range(4):  # full speed, both widths as the profile prices them
        depth.update(StepPlan([4]), [None], [4], [1], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.011)
        depth.update(StepPlan([0]), [None], [0], [0], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.010)
    for _ in range(30):  # a machine at half speed: drafting steps commit 2 tokens in 22 ms (91 tok/s)
        depth.update(StepPlan([4]), [None], [4], [1], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.022)
    assert depth.cost.factor(1) > 1.6
    for _ in range(30):  # full speed again: plain steps of 10 ms (100 tok/s)
        depth.update(StepPlan([0]), [None], [0], [0], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.010)
    # In wall seconds: 91 against 100 tok/s, drafting "loses"; in step units it wins clearly.
    assert depth.guard.rate(1, True) > 1.2 * depth.guard.rate(1, False)


def test_a_width_dearer_than_its_profile_moves_its_correction_not_the_machines_speed():
    """Traced, MTP k=3 D-Cut at W4A8: the width-4 verification cost ~2.8x a one-token forward where the
    profile priced 1.3x. A level that every step's raw ratio moved read 1.61 over drafting steps and 0.76
    over plain ones, and the guard, dividing by it, measured drafting at 0.91x plain decoding (raw: 0.56x),
    in another run at 1.59x. The level is the machine's speed: a width's first steps measure its own
    correction."""
    cost = CostModel({1: {1: 0.010, 5: 0.011}}, 128)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: cost)
    depth.cost  # the live cost model exists once a step is planned
    for _ in range(20):  # plain steps as profiled: 100 tok/s
        depth.update(StepPlan([0]), [None], [0], [0], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.010)
    for _ in range(40):  # drafting steps at twice the profile's price, 2 tokens each: 91 tok/s
        depth.update(StepPlan([4]), [None], [4], [1], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.022)
    assert depth.cost.factor(1) == pytest.approx(1.0)
    assert depth.cost.step_time(1, 5) == pytest.approx(0.022, rel=0.01)  # priced by its own measurement
    assert depth.cost.step_time(1, 1) == pytest.approx(0.010, rel=0.01)
    assert depth.guard.rate(1, True) == pytest.approx(2 / 0.022, rel=0.01)
    assert depth.guard.loses(1)
    for _ in range(30):  # the machine at half speed: the measured widths move the level, not their corrections
        depth.update(StepPlan([4]), [None], [4], [1], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.044)
    assert depth.cost.factor(1) > 1.6 and depth.cost.step_time(1, 1) > 0.016


def test_the_guard_counts_only_steps_after_a_step_of_the_same_arm():
    """The first step after a switch between drafting and plain decoding pays for the switch
    (caches cold for the other model, a drafter catch-up), so it measures neither arm."""
    cost = CostModel({1: {1: 0.010, 5: 0.011}}, 128)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: cost)
    depth.cost
    for _ in range(20):  # alternating: every step follows one of the other arm
        depth.update(StepPlan([0]), [None], [0], [0], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.015)
        depth.update(StepPlan([4]), [None], [4], [2], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.020)
    assert depth.guard.rate(1, True) is None and depth.guard.rate(1, False) is None
    for _ in range(5):
        depth.update(StepPlan([0]), [None], [0], [0], draft_seconds=0.0, num_draft_steps=0, step_seconds=0.010)
    assert depth.guard.sums[1, False][2] == 4  # the first plain step of the run followed a drafting step
    assert depth.guard.rate(1, False) is not None and depth.guard.rate(1, True) is None


def test_dcut_re_measures_drafting_where_it_declines_and_drafting_lost():
    """Where the policy declines, the guard's drafting bursts are the only refresh of the
    acceptance estimate; they draft the full depth and D-Cut does not stop them early."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: LINEAR)  # every verified token costs a whole step
    depth.guard = type(depth.guard)(4, explore_every=4, probe_every=1000, min_samples=1)
    depth.guard.observe(1, drafted=True, tokens=1, seconds=0.030)
    depth.guard.observe(1, drafted=False, tokens=1, seconds=0.010)  # drafting lost
    for _ in range(50):  # and acceptance measured poor: auto-k's model declines
        depth.estimator.update([4], [0], None)

    class Seq:
        room = 100

    plans = [depth.plan([Seq()], [1]) for _ in range(16)]
    assert [p.max_tokens[0] for p in plans] == [0, 0, 0] + [4] * 4 + [0] * 7 + [4] * 2  # after 4, then 8 decisions
    assert not any(p.prune_while_drafting for p in plans)
    assert depth.verify_lengths([Seq()], [1], [[0.01]]) == [1]


def test_drafting_that_falls_behind_is_re_measured_soon_whatever_interval_winning_reached():
    """While drafting wins, plain decoding is re-measured ever more rarely (the interval doubles);
    when drafting's own steps then fall behind (a request it drafts badly for), the next
    re-measurement of drafting comes `explore_every` decisions later, not after that interval
    (traced: MTP D-Cut, winning 2x at an interval of 1,024, fell behind on one request and stayed
    off for ~1,000 decisions)."""
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, explore_every=4, probe_every=1000, max_interval=64, min_samples=1, weight=0.5)
    guard.observe(1, drafted=True, tokens=3, seconds=0.02)  # 150 tok/s drafting
    guard.observe(1, drafted=False, tokens=1, seconds=0.01)  # 100 tok/s plain
    for _ in range(200):  # drafting wins: plain re-measured at 4, 4, 8, ..., 64 decisions
        guard.choose(1, 4)
    assert guard.interval[1] == 64
    for _ in range(6):  # drafting's steps fall behind: 50 tok/s
        guard.observe(1, drafted=True, tokens=1, seconds=0.02)
    assert guard.declines(1)
    drafted_at = [i for i in range(1, 41) if guard.choose(1, 4) > 0]
    assert drafted_at == [4, 5, 6, 7, 15, 16, 17, 18, 34, 35, 36, 37]  # then 4, 8, 16 ... again


def test_one_stalled_step_moves_neither_the_guards_rates_nor_the_live_level_much():
    """A stall that is not the step's own (traced: one 99 ms step among 2-3 ms ones) counts as at
    most 3x what was expected: it moved the guard's drafting rate from 1,452 to 524 tok/s and the
    live level 4x, and drafting stayed off for ~1,500 steps."""
    from specdecode.speculative.policy.estimators import DraftCost
    from specdecode.speculative.policy.guard import MeasuredGuard

    guard = MeasuredGuard(k_max=4, min_samples=4)
    for _ in range(40):
        guard.observe(1, drafted=True, tokens=3, seconds=0.0025)  # 1,200 tok/s drafting
        guard.observe(1, drafted=False, tokens=1, seconds=0.001)  # 1,000 tok/s plain
    guard.observe(1, drafted=True, tokens=3, seconds=0.099)
    assert not guard.loses(1) and guard.rate(1, True) > 1000
    for _ in range(40):  # a real change still shows within tens of steps
        guard.observe(1, drafted=True, tokens=3, seconds=0.0045)
    assert guard.loses(1)

    live = LiveCost(CostModel({1: {1: 0.001, 4: 0.0012}}, context=128))
    for _ in range(10):
        live.observe(1, 4, 0.0012)
    live.observe(1, 4, 0.099)
    assert live.factor(1) < 1.25  # the EMA's one step, at 3x: 1 + 0.1 * 2

    cost = DraftCost(0.3)
    for _ in range(10):
        cost.observe(4, 1.2)
    cost.observe(4, 40.0)
    assert cost.per_step < 0.3 * 1.25


def _plain_and_ngram_engine(native_model, max_tokens: int, policy: dict):
    """(greedy params, one prompt, plain decoding's tokens for it, an n-gram k=4 engine with `policy`), batch 1."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12]}]
    plain = LLM(native_model, dtype="float32", max_num_seqs=1).generate(prompts, params)[0].token_ids
    llm = LLM(native_model, dtype="float32", max_num_seqs=1, speculative_config={
        "method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 4, **policy})
    return params, prompts, plain, llm


def test_a_step_the_guard_declines_takes_the_lean_path_and_keeps_the_guard_and_live_cost_measured(native_model,
                                                                                                   monkeypatch):
    """Where drafting measured slower and nothing is due, a step skips `plan` and `update` (their host work
    was most of a declined step's cost over a plain engine's) and still counts the guard's decision, times
    the plain arm and the live cost, and commits what plain decoding commits."""
    params, prompts, plain, llm = _plain_and_ngram_engine(native_model, 24, {"verify_pruning": "dcut"})
    depth = llm.speculator.depth
    guard = depth.guard
    guard.sums[(1, True)] = [1.0, 1.0, 100]  # drafting measured at 1 token a second: it loses
    guard.sums[(1, False)] = [1.0, 1e-3, 100]
    guard.interval[1], guard.since[1] = 10_000, 0

    class Seq:
        room = 100

    assert depth.declines([Seq()], lambda seq: 1)
    calls = []
    for name in ("plan", "update"):
        monkeypatch.setattr(depth, name, lambda *a, name=name, **k: calls.append(name))
    llm.add_request(prompts[0], params)
    llm.step()  # the prefill
    level = depth.cost.factor(1)
    out = []
    while llm.has_unfinished():
        out = [o for o in llm.step()][0].token_ids
    assert out == plain and calls == []
    assert guard.decisions[1] == guard.since[1] == 23  # one decision a decoding step
    assert guard.sums[(1, False)][2] == 100 + 22  # the steady steps (the first one switched arms)
    assert depth.cost.factor(1) != level  # the live cost saw every step's forward


def test_a_step_the_model_declines_takes_the_lean_path_unless_the_guard_explores(native_model, monkeypatch):
    """Where the cost model's depth without a catch-up is 0 (it prices no drafting depth over plain
    decoding) and the guard has no exploration due, the step is known to draft nothing before it is
    planned: it skips `plan` and `update` like a step the guard declines (their bookkeeping was ~30 us
    of a ~0.7 ms MTP D-Cut step at W4A8 that drafted nothing), prices the depth once per reprice, and
    commits what plain decoding commits. A due exploration still plans (and drafts its burst)."""
    from specdecode.speculative.policy import controller

    params, prompts, plain, llm = _plain_and_ngram_engine(native_model, 40, {"draft_length_schedule": "auto"})
    depth = llm.speculator.depth
    depth.estimator.rate = [0.0] * 4  # nothing accepted: no depth beats plain decoding
    depth.estimator.observed = [True] * 4
    guard = depth.guard
    guard.sums[(1, True)] = [3.0, 1.0, 100]  # drafting measured faster: the guard does not decline
    guard.sums[(1, False)] = [1.0, 1.0, 100]
    guard.interval[1], guard.since[1] = 20, 0  # an exploration at the 20th decision (the next 32 after it)
    priced, planned = [], []
    monkeypatch.setattr(controller, "auto_k", lambda *a, **k: priced.append(a) or 0)
    plan = depth.plan
    monkeypatch.setattr(depth, "plan", lambda *a, **k: planned.append(guard.decisions.get(1, 0) + 1) or plan(*a, **k))
    out = [o for o in llm.generate(prompts, params)][0].token_ids
    assert out == plain
    assert planned == [20, 21, 22, 23]  # the exploration: a burst of `burst` drafting steps
    assert guard.decisions[1] == 39  # one decision a decoding step, planned or not
    assert len(priced) <= 39 // depth.reprice_every + 2  # the lean steps' depth, once per reprice


def test_a_guard_with_no_exploration_due_chooses_zero_for_a_declined_depth_whatever_the_switch_costs():
    """`exploration_due` is what lets a declined step skip planning: where it is False, `choose(B, 0)`
    returns 0 and leaves the guard as it would with any `switch_steps` (the catch-up the plan would
    have priced), in every state a run of decisions and measurements reaches."""
    import copy
    import random

    from specdecode.speculative.policy.guard import MeasuredGuard

    rng = random.Random(0)
    guard = MeasuredGuard(k_max=4, explore_every=4, max_interval=32, min_samples=2)
    checked = 0
    for _ in range(3000):
        B = rng.choice([1, 2, 3])
        if rng.random() < 0.5:
            guard.observe(B, drafted=rng.random() < 0.5, tokens=rng.randint(1, 5), seconds=rng.uniform(0.5, 1.5))
        if not guard.exploration_due(B):
            cheap, dear = copy.deepcopy(guard), copy.deepcopy(guard)
            assert cheap.choose(B, 0, switch_steps=0.0) == dear.choose(B, 0, switch_steps=1e9) == 0
            assert vars(cheap) == vars(dear)
            checked += 1
        guard.choose(B, rng.choice([0, 0, 2, 4]), switch_steps=rng.choice([0.0, 5.0]))
    assert checked > 500


def _state(value):
    """A policy object's state as plain values (tensors as lists, objects as their attributes), its price
    caches left out (the same prices, asked in another order)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_state(v) for v in value]
    if hasattr(value, "__dict__"):
        return {k: _state(v) for k, v in vars(value).items() if k not in ("_prices", "profile")}
    return value


def test_a_step_whose_exploration_waits_for_the_catch_up_takes_the_lean_path_and_leaves_the_policy_as_planning():
    """An exploration due where the policy declines waits while the drafter's catch-up (growing every step
    nothing is drafted) costs more than its switch budget: `choose` then returns 0 with any k, so such a
    step skips `plan` and `update` too (the steps of such waits were 44% of a declining MTP D-Cut
    engine's at W4A8). In every state a run of decisions and measurements reaches, the lean path leaves
    the guard, the live cost and the estimator as `plan` + `update` leave them."""
    import copy
    import random

    rng = random.Random(0)
    config = SpeculativeConfig(method="mtp", num_speculative_tokens=3, verify_pruning="dcut")
    depth = DepthController(config, lambda: CostModel({1: {1: 0.010, 4: 0.013, 32: 0.04}, 2: {1: 0.012, 4: 0.02,
                                                                                             32: 0.08}}, 128))
    depth.guard = type(depth.guard)(3, explore_every=8, max_interval=64, max_wait=96, min_samples=2, settle_samples=4)

    class Seq:
        room = 100

    for B in (1, 2):  # drafting measured slower, on fewer steps than settle it (explorations wait only then)
        for _ in range(2):
            depth.guard.observe(B, drafted=True, tokens=B, seconds=0.03)
            depth.guard.observe(B, drafted=False, tokens=B, seconds=0.01)
    pending = {}
    lean = waited = unmeasured = 0
    for _ in range(3000):
        seqs = [Seq() for _ in range(rng.choice([1, 1, 2, 4]))]  # 4: a bucket nothing measured
        for seq in seqs:
            pending[id(seq)] = rng.choice([1, 4, 30, 200, 2000])
        if rng.random() < 0.05:  # acceptance and drafting cost swing the model's depth
            depth.estimator.update([3], [rng.choice([0, 3])], None)
            depth.draft_cost.observe(3, rng.choice([0.3, 3.0]))
        seconds = rng.uniform(0.008, 0.012)
        due = depth.guard.exploration_due(len(seqs))
        planned = copy.deepcopy(depth)
        if depth.declines(seqs, lambda seq: pending[id(seq)]):
            depth.observe_declined(len(seqs), seconds)
            plan = planned.plan(seqs, [pending[id(seq)] for seq in seqs])
            assert not plan.drafts
            planned.update(plan, seqs, [0] * len(seqs), [0] * len(seqs), 0.0, 0, None, seconds)
            for name in ("guard", "estimator", "draft_cost", "catch_up_cost", "cost", "_last_arm"):
                assert _state(getattr(depth, name)) == _state(getattr(planned, name)), name
            lean += 1
            waited += due
            unmeasured += due and len(seqs) == 4 and 3 not in depth.guard.drafted
        else:
            plan = depth.plan(seqs, [pending[id(seq)] for seq in seqs])
            drafted = [min(n, 2) for n in plan.max_tokens]
            catch_up = 1e-3 * plan.catch_up_tokens if plan.catching_up else 0.0  # ~0.1 plain steps a token
            depth.update(plan, seqs, drafted, [rng.randint(0, n) for n in drafted], 0.001 * max(drafted) + catch_up,
                         max(drafted), None, seconds * (1 + max(drafted) * rng.uniform(0.4, 0.8)) + catch_up)
    assert waited > 50 and lean > waited and unmeasured > 0


def test_every_32nd_drafting_plan_drafts_to_k_and_d_cut_verifies_it_whole():
    """A policy that drafts shallow never measures acceptance deeper, nor the cost of wider verification,
    so every `full_depth_every`-th drafting plan drafts to k, is not stopped while drafting and is not
    cut (only n_min applies)."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=6, verify_pruning="dcut", draft_n_min=1)
    depth = DepthController(config, lambda: FREE_VERIFY)
    depth.guard = type(depth.guard)(6, probe_every=1000)
    for _ in range(4):  # drafting measured faster
        depth.guard.observe(1, drafted=True, tokens=2, seconds=0.01)
        depth.guard.observe(1, drafted=False, tokens=1, seconds=0.01)

    class Seq:
        room = 100

    for _ in range(50):
        depth.estimator.update([2], [1], None)  # position 1 accepted, position 2 never: auto-k drafts 1
    plans = [depth.plan([Seq()], [1]) for _ in range(80)]
    drafting = [p for p in plans if p.drafts]
    assert len(drafting) >= 64
    whole = [i for i, p in enumerate(drafting) if p.verify_whole]
    assert whole == [31, 63]
    probe = drafting[31]
    assert probe.max_tokens == [6] and not probe.prune_while_drafting
    assert all(p.max_tokens == [1] for i, p in enumerate(drafting) if i not in whole)
    depth._cost = LiveCost(LINEAR)  # every verified token costs a whole step: the cut keeps 1 of 6
    for _ in range(4):
        depth.cost.observe(1, 7, 0.07)  # width 7 measured
    confidence = [[0.9, 0.1, 0.1, 0.1, 0.1, 0.1]]
    assert depth.verify_lengths([Seq()], [6], confidence, probe) == [6]
    assert depth.verify_lengths([Seq()], [6], confidence, drafting[0]) == [1]
    assert depth.verify_lengths([Seq()], [0], confidence, probe) == [0]


def test_a_width_the_cut_would_remove_is_verified_whole_until_the_live_cost_has_measured_it():
    """The cut prices wider verification from the live cost, which measures only the widths that run: a
    width the cut keeps removing would stay priced by extrapolation. So while the uncut draft's width is
    stale (fewer than min_samples steps, or none among the bucket's last `width_horizon`), the draft is
    verified whole."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_pruning="dcut")
    depth = DepthController(config, lambda: LINEAR)
    depth.width_horizon = 10

    class Seq:
        room = 100

    live = depth.cost
    confidence = [[0.9, 0.1, 0.1, 0.1]]
    for _ in range(3):
        live.observe(1, 5, 0.05)
    assert live.stale(1, 5, 10) and depth.verify_lengths([Seq()], [4], confidence) == [4]
    live.observe(1, 5, 0.05)  # the 4th step at width 5: measured
    assert not live.stale(1, 5, 10) and depth.verify_lengths([Seq()], [4], confidence) == [1]
    for _ in range(10):
        live.observe(1, 2, 0.02)
    assert not live.stale(1, 5, 10)
    live.observe(1, 2, 0.02)  # 11 steps since width 5 last ran
    assert live.stale(1, 5, 10) and depth.verify_lengths([Seq()], [4], confidence) == [4]
    assert live.stale(1, 3, 10)  # never run
