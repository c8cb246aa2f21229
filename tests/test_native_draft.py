"""A chain-drafting step of EAGLE / EAGLE-3 / MTP and draft models as one C++ call
(speculative/propose/native_step.py), greedy or sampled: the same drafts, the same drafter cache and
the same outputs as the Python step, and the Python step wherever the C++ one does not serve."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.kernels import decode_stack_cpu, gemm_a8_cpu, gemv_cpu, gemv_int8_cpu
from specdecode.models import kernel_probe
from specdecode.models.native_stack import NativeStack
from specdecode.speculative import speculator
from specdecode.speculative.policy.cost_model import CostModel

pytestmark = pytest.mark.skipif(decode_stack_cpu.extension() is None, reason="the C++ step needs a C++ compiler")

PROMPT = "def f(x):\n    return"


@pytest.fixture
def native_steps(monkeypatch) -> list[int]:
    """How many drafting steps ran in C++ (one a call, or a chain's in one call)."""
    calls: list[int] = []
    step, chain = NativeStack.draft_step, NativeStack.draft_chain

    def counted(self, *args, **kwargs):
        calls.append(1)
        return step(self, *args, **kwargs)

    def counted_chain(self, *args, **kwargs):
        drafted, tops = chain(self, *args, **kwargs)
        calls.extend([1] * len(drafted))
        return drafted, tops

    monkeypatch.setattr(NativeStack, "draft_step", counted)
    monkeypatch.setattr(NativeStack, "draft_chain", counted_chain)
    return calls


@pytest.fixture
def batch_steps(monkeypatch) -> list[int]:
    """The batch size of each drafting step of several sequences that ran as one C++ call."""
    sizes: list[int] = []
    batch = NativeStack.draft_batch

    def counted(self, step, cache_k, cache_v, ids, features, slots, *args):
        out = batch(self, step, cache_k, cache_v, ids, features, slots, *args)
        if out is not None:
            sizes.append(len(slots))
        return out

    monkeypatch.setattr(NativeStack, "draft_batch", counted)
    return sizes


def _drafting(llm: LLM, prompts: list[str], params: SamplingParams, probs: list | None = None
              ) -> tuple[list, list, torch.Tensor]:
    """(outputs, every proposal's (tokens, confidences), the drafter's K cache afterwards); each
    proposal's q (or None) appended to `probs` where given."""
    proposer = llm.speculator.proposer
    drafts = []
    propose = proposer.propose

    def recorded(*args, **kwargs):
        draft = propose(*args, **kwargs)
        drafts.append((draft.token_ids.clone(), draft.confidence.clone()))
        if probs is not None:
            probs.append(None if draft.probs is None else draft.probs.clone())
        return draft

    proposer.propose = recorded
    try:
        outputs = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        del proposer.propose
    cache = proposer.kv_cache if hasattr(proposer, "kv_cache") else proposer.runner.kv_cache
    # Its columns but the scratch column (where a padded batch's padding tokens write).
    return outputs, drafts, torch.stack([k[:, :cache.scratch_index].clone() for k in cache.k])


def _token_frequencies(model: Path, path: Path) -> list[int]:
    """Random token counts over the model's vocabulary, written to `path` (draft_vocab_frequencies)."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    counts = torch.randint(1, 1000, (vocab,), generator=torch.Generator().manual_seed(0)).tolist()
    path.write_text(json.dumps({"counts": counts}))
    return counts


def _force_lean_widths(monkeypatch) -> None:
    """bf16 layers with the few-row bf16 kernel forced up to 16 rows (no measurement, no cache)."""
    monkeypatch.setattr(kernel_probe, "faster_by_width",
                        lambda candidate, baseline, k, dtype, widths: [True] * len(widths))
    monkeypatch.setattr(kernel_probe, "load_choices", dict)
    monkeypatch.setattr(kernel_probe, "save_choices", lambda cached: None)


def _python_steps(llm: LLM) -> LLM:
    llm.speculator.proposer.native_drafting = False
    return llm


def _assert_same_drafting(ours, theirs) -> None:
    assert ours[0] == theirs[0]
    assert len(ours[1]) == len(theirs[1])
    for (tokens, confidence), (their_tokens, their_confidence) in zip(ours[1], theirs[1]):
        assert torch.equal(tokens, their_tokens)
        torch.testing.assert_close(confidence, their_confidence, rtol=1e-5, atol=1e-7)  # up to rounding
    assert torch.equal(ours[2], theirs[2])  # the drafter's outputs fed its cache: bit-identical


@pytest.mark.parametrize("method", ["eagle3", "mtp", "eagle", "draft_model"])
@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("float32", "int8"), ("bfloat16", None)])
def test_native_steps_draft_what_the_python_steps_draft(native_model, native_drafter, trained_drafters, native_steps,
                                                        method, dtype, quantization):
    if quantization == "int8" and not gemv_int8_cpu.fits(8, "cpu"):
        pytest.skip("the few-row int8 kernel needs AVX2 and FMA")
    drafter = native_drafter if method == "draft_model" else trained_drafters[method]
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(drafter)}
    llm = LLM(native_model, dtype=dtype, quantization=quantization, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = _drafting(llm, [PROMPT], params)
    assert native_steps  # eagle3's reduced draft vocabulary (d2t) included
    count = len(native_steps)
    llm_python = _python_steps(LLM(native_model, dtype=dtype, quantization=quantization, speculative_config=spec))
    _assert_same_drafting(ours, _drafting(llm_python, [PROMPT], params))
    assert len(native_steps) == count


@pytest.mark.parametrize("method", ["eagle3", "mtp", "draft_model"])
@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "w4a8"), ("float32", "w8a8"), ("bfloat16", None)])
def test_lean_steps_draft_what_the_python_steps_draft(lean_model, lean_drafters, native_steps, monkeypatch, method,
                                                      dtype, quantization):
    # The drafter's layers on the C++ stack's lean path (EAGLE-3: attention reading its own input); bf16
    # layers with the few-row bf16 kernel forced up to 16 rows.
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    if quantization is None and not gemv_cpu.fits(128, torch.bfloat16, "cpu"):
        pytest.skip("the few-row bf16 kernel needs AVX-512 BF16")
    _force_lean_widths(monkeypatch)
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(lean_drafters[method]),
            "draft_quantization": quantization or "none"}  # bf16: the drafter's layers too (not its w4a8 default)
    llm = LLM(lean_model, dtype=dtype, quantization=quantization, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = _drafting(llm, [PROMPT], params)
    layers = llm.speculator.proposer._native[True][1]._layers()  # the greedy proposals' step
    assert native_steps and layers.lean_forwards() >= len(native_steps) - 1  # the first feeds the whole prompt
    count = len(native_steps)
    llm_python = _python_steps(LLM(lean_model, dtype=dtype, quantization=quantization, speculative_config=spec))
    _assert_same_drafting(ours, _drafting(llm_python, [PROMPT], params))
    assert len(native_steps) == count


@pytest.mark.parametrize("method,extra", [("eagle3", {}), ("mtp", {"verify_pruning": "dcut"}), ("draft_model", {}),
                                          ("draft_model", {"draft_vocab_size": 100})])
@pytest.mark.parametrize("dtype,quantization", [("bfloat16", "w4a8"), ("float32", "w8a8"), ("bfloat16", None)])
def test_steps_of_several_sequences_draft_in_one_call_what_the_python_steps_draft(
        lean_model, lean_drafters, batch_steps, monkeypatch, tmp_path, method, extra, dtype, quantization):
    # Three greedy requests in flight: each drafting step of the batch is one lean forward of the
    # drafter (each sequence a segment) and one head call, the tokens picked in C++; with D-Cut's stop
    # rule asked between the steps; for a draft model with a reduced draft head too (FR-Spec: the
    # runner's batched forward does not serve one).
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the lean path needs AVX-512 VNNI")
    if quantization is None and not gemv_cpu.fits(128, torch.bfloat16, "cpu"):
        pytest.skip("the few-row bf16 kernel needs AVX-512 BF16")
    _force_lean_widths(monkeypatch)
    clock = {"ticks": iter(range(10**9))}  # D-Cut decides on step times: both runs read the same clock
    monkeypatch.setattr(speculator, "time", types.SimpleNamespace(perf_counter=lambda: next(clock["ticks"]) * 1e-3))
    if "draft_vocab_size" in extra:
        _token_frequencies(lean_model, tmp_path / "freq.json")
        extra = {**extra, "draft_vocab_frequencies": str(tmp_path / "freq.json")}
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(lean_drafters[method]),
            "draft_quantization": quantization or "none", **extra}
    prompts = [PROMPT, "class A:\n    def", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(lean_model, dtype=dtype, quantization=quantization, max_num_seqs=3, speculative_config=spec)
    ours = _drafting(llm, prompts, params)
    assert batch_steps and max(batch_steps) == 3
    count = len(batch_steps)
    clock["ticks"] = iter(range(10**9))
    llm_python = _python_steps(LLM(lean_model, dtype=dtype, quantization=quantization, max_num_seqs=3,
                                   speculative_config=spec))
    _assert_same_drafting(ours, _drafting(llm_python, prompts, params))
    assert len(batch_steps) == count  # the Python steps ran none


@pytest.mark.parametrize("extra", [{"draft_p_min": 0.035}, {"verify_pruning": "dcut"}])
def test_chains_stopped_by_p_min_or_dcut_draft_what_the_python_steps_draft(native_model, trained_drafters,
                                                                           native_steps, monkeypatch, extra):
    # p_min, or D-Cut's stop rule in its one-sequence form (controller.py OneRowStop): the whole chain
    # in one C++ call, stopping there, where the Python steps ask the rule after each step.
    calls = {"draft_chain": 0, "draft_step": 0}
    for name in calls:
        def counted(self, *args, _call=getattr(NativeStack, name), _name=name):
            calls[_name] += 1
            return _call(self, *args)
        monkeypatch.setattr(NativeStack, name, counted)
    # D-Cut decides on measured step times: both runs read the same clock, a millisecond a reading.
    ticks = iter(range(10**9))
    monkeypatch.setattr(speculator, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))
    spec = {"method": "mtp", "num_speculative_tokens": 4, "model": str(trained_drafters["mtp"]), **extra}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ours = _drafting(LLM(native_model, dtype="float32", speculative_config=spec), [PROMPT], params)
    assert native_steps and calls["draft_chain"] and not calls["draft_step"]
    assert any(0 < int((tokens >= 0).sum()) < 4 for tokens, _ in ours[1])  # some chains stopped early, in C++
    count = len(native_steps)
    llm_python = _python_steps(LLM(native_model, dtype="float32", speculative_config=spec))
    ticks = iter(range(10**9))
    _assert_same_drafting(ours, _drafting(llm_python, [PROMPT], params))
    assert len(native_steps) == count


@pytest.mark.parametrize("key", ["draft_vocab_size", "greedy_draft_vocab_size"])
@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_a_frequency_ranked_draft_vocabulary_is_served_too(native_model, native_drafter, trained_drafters, native_steps,
                                                           tmp_path, method, key):
    # FR-Spec: the head cut to its 100 most frequent tokens (a ReducedHead, ids ascending), for every
    # proposal or (greedy_draft_vocab_size) for greedy ones only: one LLM serves greedy, sampled and
    # greedy requests again, each proposal through the C++ step of its own head.
    counts = _token_frequencies(native_model, tmp_path / "freq.json")
    drafter = native_drafter if method == "draft_model" else trained_drafters[method]
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(drafter),
            key: 100, "draft_vocab_frequencies": str(tmp_path / "freq.json")}
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
    llm = LLM(native_model, dtype="float32", speculative_config=spec)
    ours = [_drafting(llm, [PROMPT], params) for params in (greedy, sampled, greedy)]
    assert native_steps
    keep = set(torch.sort(-torch.tensor(counts), stable=True).indices[:100].tolist())
    drafted = [{t for tokens, _ in drafting[1] for t in tokens.flatten().tolist() if t >= 0} for drafting in ours]
    assert drafted[0] <= keep and drafted[2] <= keep
    assert (drafted[1] <= keep) == (key == "draft_vocab_size")  # greedy_draft_vocab_size: a sampled draft scores all
    count = len(native_steps)
    llm_python = _python_steps(LLM(native_model, dtype="float32", speculative_config=spec))
    for drafting, params in zip(ours, (greedy, sampled, greedy)):
        _assert_same_drafting(drafting, _drafting(llm_python, [PROMPT], params))
    assert len(native_steps) == count


@pytest.mark.parametrize("method,extra", [("eagle3", {}), ("mtp", {"verify_pruning": "dcut"}), ("draft_model", {}),
                                          ("mtp", {"draft_vocab_size": 100})])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_chains_draw_what_the_python_steps_draw(native_model, native_drafter, trained_drafters, native_steps,
                                                        monkeypatch, tmp_path, method, extra, dtype):
    # T = 0.8, seeded: the C++ chain writes q and draws by inverse CDF with the proposal's uniforms, as
    # ChainDraft.add_step does (EAGLE-3's reduced vocabulary, D-Cut's stop rule and FR-Spec's head
    # included). Drafter outputs and cache bit-identical; q and confidences equal up to rounding,
    # and so the draws, the verifier's decisions and the outputs.
    if "draft_vocab_size" in extra:
        vocab = json.loads((native_model / "config.json").read_text())["vocab_size"]
        counts = torch.randint(1, 1000, (vocab,), generator=torch.Generator().manual_seed(0)).tolist()
        (tmp_path / "freq.json").write_text(json.dumps({"counts": counts}))
        extra = {**extra, "draft_vocab_frequencies": str(tmp_path / "freq.json")}
    ticks = iter(range(10**9))  # D-Cut decides on step times: both runs read the same clock
    monkeypatch.setattr(speculator, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))
    # ... and on the target's cost profile: a fixed one, so every run takes the same path. With the
    # profile measured at start each run took its own, and one in CI met a draw or stop that the two
    # paths' q, equal only up to rounding, decided differently.
    profile = CostModel({b: {n: 1e-3 * (1 + 0.1 * n) * b ** 0.5 for n in range(1, 18)} for b in (1, 2, 4, 8, 16)}, 128)
    monkeypatch.setattr(speculator, "load_or_profile", lambda *args, **kwargs: profile)
    drafter = native_drafter if method == "draft_model" else trained_drafters[method]
    spec = {"method": method, "num_speculative_tokens": 3, "model": str(drafter), **extra}
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    ours_q, theirs_q = [], []
    ours = _drafting(LLM(native_model, dtype=dtype, speculative_config=spec), [PROMPT], params, ours_q)
    assert native_steps
    count = len(native_steps)
    ticks = iter(range(10**9))
    llm_python = _python_steps(LLM(native_model, dtype=dtype, speculative_config=spec))
    _assert_same_drafting(ours, _drafting(llm_python, [PROMPT], params, theirs_q))
    assert len(native_steps) == count
    assert len(ours_q) == len(theirs_q) and all(q is not None for q in ours_q)
    for q, their_q in zip(ours_q, theirs_q):
        torch.testing.assert_close(q, their_q, rtol=1e-5, atol=1e-7)
    below_top = [bool(q[0, s, token] < q[0, s].max()) for q, (tokens, _) in zip(ours_q, ours[1])
                 for s, token in enumerate(tokens[0].tolist()) if token >= 0]
    assert "verify_pruning" in extra or any(below_top)  # sampled, not argmaxes (D-Cut drafts a few tokens)


def test_sampling_batches_and_hooks_keep_the_python_step(native_model, trained_drafters, native_steps):
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(trained_drafters["eagle3"])}
    llm = LLM(native_model, dtype="float32", max_num_seqs=2, speculative_config=spec)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([PROMPT, "class A:\n"], greedy)  # two sequences side by side, finishing together
    assert not native_steps
    for filtered in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(repetition_penalty=1.2)):
        llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, **filtered))
        assert not native_steps, filtered  # the C++ chain samples at a temperature alone
    exact = LLM(native_model, dtype="float32", exact=True, speculative_config=spec)
    exact.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True))
    assert not native_steps  # keyed rows race the target's noise
    llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True))
    assert native_steps
    native_steps.clear()
    seen = []
    drafter = llm.speculator.proposer.drafter
    handle = drafter.hidden_norm.register_forward_hook(lambda module, args, out: seen.append(out))
    llm.generate([PROMPT], greedy)
    assert seen and not native_steps  # a hooked module runs as a module
    handle.remove()
    llm.generate([PROMPT], greedy)
    assert native_steps
