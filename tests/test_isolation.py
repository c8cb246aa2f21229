"""Failure isolation in `LLM.step`: a request whose step raises finishes with finish_reason
"error" and its message; every other request's tokens are a clean run's, token for token
(greedy and seeded sampling), no slot or drafter state is left behind, and the engine serves
the next requests as if nothing had happened.

Failures are injected for one sentinel request in a batch of 16, raising whenever the batch
holds it: `SamplingBatch.build` (in the prefill, or in a later decode step); the proposer
mid-proposal, after it consumed pending target features (`take_pending`) or, for drafters
without features, after the whole proposal; the drafter's commit, after verification drew
every seeded row's noise; and the stop-string check while the step is applied.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from helpers import PROMPT_IDS

from specdecode import LLM, SamplingParams
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.features import TargetFeatureBuffer

N = 16
POISONED = 5  # a seeded request
PROMPTS = [{"prompt_token_ids": PROMPT_IDS[i % 4] + [3 + i]} for i in range(N)]
CASES = [("ngram", "chain"), ("draft_model", "chain"), ("eagle3", "chain"), ("eagle3", "dynamic tree"),
         ("medusa", "static tree"), ("dflash", "chain")]
_clean: dict[str, list[list[int]]] = {}


class InjectedError(RuntimeError):
    pass


def sampling_params() -> list[SamplingParams]:
    """Greedy and seeded requests, alternating (each its own object: the sentinel is one of them)."""
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=100 + i, ignore_eos=True)
            for i in range(N)]


def build_llm(model, config) -> LLM:
    return LLM(model, dtype="float32", max_num_seqs=N, speculative_config=config)


def clean_run(model, config) -> list[list[int]]:
    key = repr(config)
    if key not in _clean:
        _clean[key] = [o.token_ids for o in build_llm(model, config).generate(PROMPTS, sampling_params())]
    return _clean[key]


def run(llm: LLM, params: list[SamplingParams], arm, after_steps: int) -> list:
    """Every prompt to completion through `step`; arm() is called after `after_steps` steps."""
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    done, steps = {}, 0
    if after_steps == 0:
        arm()
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
        steps += 1
        if steps == after_steps:
            arm()
    return [done[i] for i in ids]


def poison_sampling(monkeypatch, llm: LLM, poisoned: SamplingParams):
    build = SamplingBatch.build.__func__

    def failing_build(cls, params, generators, device, **keyed):
        if any(p is poisoned for p in params):
            raise InjectedError("sampling parameters refused")
        return build(cls, params, generators, device, **keyed)

    def arm():
        monkeypatch.setattr(SamplingBatch, "build", classmethod(failing_build))
        llm._reusable_sampling = None  # the next step builds its batch (a step-independent one is reused)

    return arm


def poison_proposer(monkeypatch, llm: LLM, poisoned: SamplingParams):
    """Raise mid-proposal when the batch holds the sentinel: right after its pending features
    were taken (feature drafters), else after the proposal ran (its state changes included)."""
    proposer = llm.speculator.proposer

    def arm():
        if isinstance(proposer, TargetFeatureBuffer):
            take = proposer.take_pending

            def failing_take(seq):
                taken = take(seq)
                if seq.params is poisoned:
                    raise InjectedError("drafter failed")
                return taken

            monkeypatch.setattr(proposer, "take_pending", failing_take)
        else:
            propose = proposer.propose

            def failing_propose(seqs, *args, **kwargs):
                draft = propose(seqs, *args, **kwargs)
                if any(s.params is poisoned for s in seqs):
                    raise InjectedError("drafter failed")
                return draft

            monkeypatch.setattr(proposer, "propose", failing_propose)

    return arm


def poison_commit(monkeypatch, llm: LLM, poisoned: SamplingParams):
    """The drafter's commit raising: every seeded row has drawn its verification noise by then."""
    proposer = llm.speculator.proposer
    on_commit = proposer.on_commit

    def failing_commit(seqs, *args):
        if any(s.params is poisoned for s in seqs):
            raise InjectedError("commit failed")
        return on_commit(seqs, *args)

    return lambda: monkeypatch.setattr(proposer, "on_commit", failing_commit)


def fails_alone(model, config, poison, after_steps: int, monkeypatch, caplog, params=None) -> list:
    """The 16 requests, with `poison(monkeypatch, llm, the sentinel's params)` armed after
    `after_steps` steps: the sentinel fails, nothing else changes (see the module docstring)."""
    clean = clean_run(model, config)
    llm = build_llm(model, config)
    params = params or sampling_params()
    outs = run(llm, params, poison(monkeypatch, llm, params[POISONED]), after_steps)
    for i, (out, expected) in enumerate(zip(outs, clean)):
        if i == POISONED:
            assert out.finished and out.finish_reason == "error"
            assert out.error.startswith("InjectedError: ")
        else:
            assert out.token_ids == expected, i
            assert out.error is None and out.finish_reason == "length"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # logged once, with its traceback
    assert sorted(llm.scheduler.free_slots) == list(range(N))
    assert not llm.scheduler.running and not llm.scheduler.waiting
    if llm.speculator is not None:
        assert llm.speculator.proposer.num_live_states() == 0
    monkeypatch.undo()
    again = llm.generate(PROMPTS, sampling_params())
    assert [o.token_ids for o in again] == clean
    return outs


def cases(test):
    ids = [f"{m}-{s.replace(' ', '_')}" for m, s in CASES]
    return pytest.mark.parametrize("spec_config", CASES, ids=ids, indirect=True)(test)


@cases
def test_a_failing_proposal_fails_only_its_request(native_model, spec_config, monkeypatch, caplog):
    fails_alone(native_model, spec_config, poison_proposer, 3, monkeypatch, caplog)


@cases
def test_a_failing_decode_step_fails_only_its_request(native_model, spec_config, monkeypatch, caplog):
    fails_alone(native_model, spec_config, poison_sampling, 3, monkeypatch, caplog)


@cases
def test_a_failure_after_verification_fails_only_its_request(native_model, spec_config, monkeypatch, caplog):
    fails_alone(native_model, spec_config, poison_commit, 3, monkeypatch, caplog)


def fail_before_the_drafter_writes(monkeypatch, proposer, seqs) -> None:
    """The proposal fails after recording what it consumes, before any drafter forward."""
    if isinstance(proposer, TargetFeatureBuffer):
        take = proposer.take_pending

        def failing_take(seq):
            taken = take(seq)
            if seq is seqs[-1]:
                raise InjectedError("drafter failed")
            return taken

        monkeypatch.setattr(proposer, "take_pending", failing_take)
    else:  # the draft model: its first forward (the catch-up) fails
        def failing_forward(*args, **kwargs):
            raise InjectedError("drafter failed")

        monkeypatch.setattr(proposer.runner, "forward", failing_forward)


@pytest.mark.parametrize("spec_config", [("draft_model", "chain"), ("eagle3", "chain"), ("dflash", "chain")],
                         ids=["draft_model", "eagle3", "dflash"], indirect=True)
def test_a_failed_speculative_step_leaves_the_drafter_as_it_was(native_model, spec_config, monkeypatch):
    """What a failed proposal recorded is rolled back: a retry whose plan drafts nothing (an
    auto-k decision may differ on the retry) must not commit it."""
    def decode(fail: bool):
        llm = build_llm(native_model, spec_config)
        ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:4], sampling_params()[:4])]
        llm.step(), llm.step()  # the prefill, one speculative step
        speculator, seqs = llm.speculator, list(llm.scheduler.running)
        if fail:
            with monkeypatch.context() as m:
                fail_before_the_drafter_writes(m, speculator.proposer, seqs)
                with pytest.raises(InjectedError):
                    speculator.step(seqs, llm._sampling_batch(seqs))
        with monkeypatch.context() as m:  # a step that drafts nothing
            plan = speculator.depth.plan
            m.setattr(speculator.depth, "plan", lambda s, p: dataclasses.replace(plan(s, p), max_tokens=[0] * len(s)))
            llm.step()
        pending = [speculator.proposer.pending_tokens(s) for s in seqs]
        done = {}
        while llm.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in llm.step() if o.finished)
        return pending, [done[i] for i in ids]

    assert decode(fail=True) == decode(fail=False)


@pytest.mark.parametrize("spec_config", [("ngram", "chain"), ("eagle3", "chain")], ids=["ngram", "eagle3"],
                         indirect=True)
def test_a_failing_prefill_fails_only_its_request(native_model, spec_config, monkeypatch, caplog):
    outs = fails_alone(native_model, spec_config, poison_sampling, 0, monkeypatch, caplog)
    assert outs[POISONED].token_ids == []


@pytest.mark.parametrize("after_steps", [0, 3], ids=["prefill", "decode"])
def test_plain_decoding_isolates_a_failing_request(native_model, monkeypatch, caplog, after_steps):
    fails_alone(native_model, None, poison_sampling, after_steps, monkeypatch, caplog)


def test_a_transient_failure_costs_a_retry_not_a_request(native_model, monkeypatch, caplog):
    """A step that fails once (not because of any request) is retried on the halves of its batch."""
    clean = clean_run(native_model, None)
    llm = build_llm(native_model, None)
    forward, calls = llm.runner.forward, []

    def fails_once(entries, *args, **kwargs):
        calls.append(len(entries))
        if len(calls) == 3:
            raise InjectedError("transient")
        return forward(entries, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", fails_once)
    outs = llm.generate(PROMPTS, sampling_params())
    assert [o.token_ids for o in outs] == clean and all(o.error is None for o in outs)
    assert calls[2:5] == [N, N // 2, N // 2]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failing_update_fails_only_its_request(native_model, monkeypatch, caplog):
    """Applying a step (stop strings, here) is isolated per request too."""
    def poison_stop_check(monkeypatch, llm, poisoned):
        find = llm.scheduler._find_stop_string

        def failing_find(seq):
            if seq.params is poisoned and len(seq.output_token_ids) == 3:
                raise InjectedError("stop check failed")
            return find(seq)

        return lambda: monkeypatch.setattr(llm.scheduler, "_find_stop_string", failing_find)

    params = sampling_params()
    params[POISONED] = SamplingParams(temperature=1.0, max_tokens=12, seed=1, ignore_eos=True, stop=["never seen"])
    outs = fails_alone(native_model, None, poison_stop_check, 0, monkeypatch, caplog, params)
    assert len(outs[POISONED].token_ids) == 3
