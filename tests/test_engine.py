"""Batching, KV-cache rollback, sampling and request validation on tiny random models."""

import pytest
import torch
from helpers import PROMPT_IDS as PROMPTS

from specdecode import LLM, SamplingParams
from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner
from specdecode.errors import ConfigError, InvalidRequestError
from specdecode.models.loader import load_model
from specdecode.sampling import RowMasks, SamplingBatch, argmax, argmax_host, process_logits, sample, sample_host
from specdecode.tokenizer import OutputText



def test_batch_equals_each_prompt_alone(native_model):
    llm = LLM(native_model, dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, together):
        alone = llm.generate({"prompt_token_ids": prompt}, params)[0]
        assert out.token_ids == alone.token_ids
        assert out.prompt_token_ids == prompt


def test_more_requests_than_slots_wait_and_finish(native_model):
    llm = LLM(native_model, dtype="float32", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params)
    assert [len(o.token_ids) for o in outs] == [8] * 8
    assert outs[0].token_ids == outs[4].token_ids


def test_generate_detokenises_each_request_once_and_step_every_step(native_model, monkeypatch):
    """generate() builds a request's output (its text) once, when it finishes, not at every step;
    step() still returns every advanced request's output (streaming), each step decoding only the
    new token and a few before it (OutputText), not the whole text (O(length) a step)."""
    llm = LLM(native_model, dtype="float32", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    texts, decoded = [], []
    text_of, decode = OutputText.of, llm.tokenizer.decode
    monkeypatch.setattr(OutputText, "of", lambda self, tok, ids: texts.append(len(ids)) or text_of(self, tok, ids))
    monkeypatch.setattr(llm.tokenizer, "decode", lambda ids, *a, **k: decoded.append(len(ids)) or decode(ids, *a, **k))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
    assert texts == [12, 12] and all(o.finished and o.text == decode(o.token_ids) for o in outs)
    texts.clear()
    decoded.clear()
    llm.add_request({"prompt_token_ids": PROMPTS[0]}, params)
    steps = []
    while llm.has_unfinished():
        steps.append([(len(o.token_ids), o.finished, o.text == decode(o.token_ids)) for o in llm.step()])
    assert steps == [[(n, n == 12, True)] for n in range(1, 13)] and texts == list(range(1, 13))
    # the new token, the context, and the earlier bytes of a character still incomplete (up to 3)
    assert decoded and max(decoded) <= OutputText.CONTEXT + 4, str(decoded)
    assert SamplingBatch.build([params] * 2, [None, None], "cpu").temperature.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_steps_leave_no_reference_cycles(native_model, speculative):
    """A step's objects are freed when it ends, not at the garbage collector's next pass (the step's
    failure isolation kept each step's outputs in a cycle through a recursive closure)."""
    import gc

    llm = LLM(native_model, dtype="float32", max_num_seqs=4, speculative_config=speculative)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts, params)  # lazily built state first
    gc.collect()
    flags = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
    try:
        llm.generate(prompts, params)
        gc.collect()
        # The engine's own objects and functions (other threads of the test session may leave garbage of theirs)
        left = [type(o).__name__ for o in gc.garbage if str(getattr(o, "__module__", "")).startswith("specdecode")]
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
    assert left == []


def test_rollback_is_setting_a_length(native_model):
    model = load_model(native_model, torch.float32)
    runner = Runner(model, num_slots=1, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    prefix = [5, 17, 99, 42]
    runner.forward([ForwardEntry(0, prefix, start=0)])
    # Decode 3 tokens that will be "rejected"...
    runner.forward([ForwardEntry(0, [7, 8, 9], start=4, num_logits=3)])
    # ... roll back to length 4 by writing from column 4 again: same logits as never decoding them.
    rolled = runner.forward([ForwardEntry(0, [11, 12], start=4, num_logits=2)]).logits
    fresh = Runner(model, num_slots=1, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    fresh.forward([ForwardEntry(0, prefix, start=0)])
    clean = fresh.forward([ForwardEntry(0, [11, 12], start=4, num_logits=2)]).logits
    torch.testing.assert_close(rolled, clean, rtol=0, atol=0)


def test_seeded_sampling_is_independent_of_batch(native_model):
    llm = LLM(native_model, dtype="float32", max_num_seqs=4)
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, seeded)[0].token_ids
    others = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True)
    mixed = llm.generate([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]},
                          {"prompt_token_ids": PROMPTS[2]}], [others, seeded, others])
    assert mixed[1].token_ids == alone
    other_seed = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_a_step_independent_sampling_batch_is_reused_while_the_batch_is_the_same(native_model):
    """The same sequences in the same order reuse the last step's SamplingBatch; another batch, and any
    batch whose rows adjust logits, follow a grammar or draw keyed noise, is built for its step."""
    llm = LLM(native_model, dtype="float32", max_num_seqs=4)
    plain = SamplingParams(temperature=0.7, top_k=5, max_tokens=16, ignore_eos=True)
    for p in PROMPTS[:2]:
        llm.add_request({"prompt_token_ids": p}, plain)
    llm.step()  # prefill
    seqs = list(llm.scheduler.running)
    first = llm._sampling_batch(seqs)
    assert llm._sampling_batch(list(seqs)) is first  # a new list of the same sequences
    assert llm._sampling_batch(seqs[::-1]) is not first and llm._sampling_batch(seqs[:1]) is not first
    penalised = SamplingParams(temperature=0.7, repetition_penalty=1.3, max_tokens=16, ignore_eos=True)
    llm.add_request({"prompt_token_ids": PROMPTS[2]}, penalised)
    llm.step()
    seqs = list(llm.scheduler.running)
    assert any(s.params is penalised for s in seqs)
    assert llm._sampling_batch(seqs) is not llm._sampling_batch(seqs)  # its history changes every step
    exact = LLM(native_model, dtype="float32", max_num_seqs=2, exact=True)
    exact.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=1.0, seed=7, max_tokens=8))
    exact.step()
    keyed = list(exact.scheduler.running)
    assert exact._sampling_batch(keyed) is not exact._sampling_batch(keyed)  # positions move every step


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    batch = SamplingBatch.build([SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(top_p=0.3)],
                                [None] * 3, "cpu")
    probs = process_logits(logits, batch)
    torch.testing.assert_close(probs[0], torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so 0.15 is needed too; the rest is cut.
    torch.testing.assert_close(probs[1], torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    torch.testing.assert_close(probs[2], torch.tensor([1.0, 0, 0, 0, 0]))


def test_the_fast_argmax_picks_what_torch_picks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, 300, generator=g)
    x[0, 0, 7] = x[0, 0, 250] = 50.0  # equal maxima: the first
    x[1, 2, 30] = x[1, 2, 40] = float("nan")  # NaN counts as the largest: the first
    x[2, 3] = float("-inf")  # every entry -inf
    x[3, 1, 299] = float("inf")
    for t in (x, x[:, :3], x[:, ::2], x.transpose(0, 1), x[:0], x.bfloat16(), x.double()):
        out = argmax(t)
        assert out.dtype == torch.int64 and torch.equal(out, t.argmax(dim=-1)), t.shape
        assert argmax_host(t) == t.argmax(dim=-1).tolist(), t.shape  # the host read: the same indices, as ints
    with torch.inference_mode():
        assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert not torch.equal(argmax(x), argmax(-x))  # can fail


def test_sample_host_reads_what_sample_draws():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=g)
    logits[0, 5] = logits[0, 9] = 30.0  # a tie: the first
    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 3, [None] * 3, "cpu")
    assert sample_host(logits, greedy) == sample(logits, greedy).tolist() == logits.argmax(dim=-1).tolist()
    # A greedy row under a grammar mask takes the argmax of the adjusted logits, not the raw ones.
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 7) | (1 << 9)  # tokens 7 and 9 allowed on row 1
    masked = SamplingBatch.build([SamplingParams(temperature=0)] * 3, [None] * 3, "cpu", grammar=RowMasks([1], bitmask))
    choice = 7 if logits[1, 7] >= logits[1, 9] else 9
    assert sample_host(logits, masked) == sample(logits, masked).tolist() == [5, choice, int(logits[2].argmax())]
    seeded = [SamplingParams(temperature=0.8, seed=4), SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5)]

    def batch() -> SamplingBatch:  # the same seeds each time
        return SamplingBatch.build(seeded, [torch.Generator().manual_seed(p.seed or 0) for p in seeded], "cpu")

    drawn = sample_host(logits, batch())
    assert drawn == sample(logits, batch()).tolist() and drawn[1] == int(logits[1].argmax())
    # A forward's logits [N, T, V] are sampled at position 0, and sliced only where read: a greedy batch
    # with the forward's argmaxes reads none (the slice was ~6 us a decode step after a W4A8 forward).
    forward_logits = torch.stack([logits, -logits], dim=1)  # [3, 2, 40]
    assert sample_host(forward_logits, batch()) == drawn
    assert sample_host(forward_logits, masked) == [5, choice, int(logits[2].argmax())]

    class Unread(torch.Tensor):
        def __getitem__(self, index):
            raise AssertionError("sliced")

    assert sample_host(forward_logits.as_subclass(Unread), greedy, [1, 2, 3]) == [1, 2, 3]


def test_temperature_zero_is_exact_argmax(native_model):
    llm = LLM(native_model, dtype="float32")
    a = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    b = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, seed=3))
    assert a[0].token_ids == b[0].token_ids


def test_stop_strings_stop_ids_and_max_tokens(native_model):
    llm = LLM(native_model, dtype="float32")
    base = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 30
    stop_text = base.text[10:13]
    assert stop_text
    stopped = llm.generate({"prompt_token_ids": PROMPTS[1]},
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == base.text[: base.text.find(stop_text)]
    stop_id = base.token_ids[5]
    by_id = llm.generate({"prompt_token_ids": PROMPTS[1]},
                         SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]


def test_eos_stops_unless_ignored(native_model):
    llm = LLM(native_model, dtype="float32")
    base = llm.generate({"prompt_token_ids": PROMPTS[3]}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    # Make EOS the 4th generated token by declaring it EOS for this engine.
    llm.eos_token_ids = (base.token_ids[3],)
    out = llm.generate({"prompt_token_ids": PROMPTS[3]}, SamplingParams(temperature=0, max_tokens=40))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[3]) + 1]


def test_context_limit_and_bad_requests(native_model):
    llm = LLM(native_model, dtype="float32", max_model_len=32)
    with pytest.raises(InvalidRequestError, match="context is 32"):
        llm.generate({"prompt_token_ids": list(range(3, 35))}, SamplingParams(max_tokens=4))
    out = llm.generate({"prompt_token_ids": list(range(3, 28))}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(InvalidRequestError, match=r"\[0, 320\)"):
        llm.generate({"prompt_token_ids": [5, 999]})
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-3), dict(max_tokens=0)):
        with pytest.raises(InvalidRequestError, match=list(bad)[0]):
            SamplingParams(**bad)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(native_model, dtype="int3")
    # A bad prompt in a batch is rejected before any prompt runs.
    with pytest.raises(InvalidRequestError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}])
    assert not llm.has_unfinished()


def test_text_prompts_and_chat_template(native_model):
    llm = LLM(native_model, dtype="float32")
    out = llm.generate("def fib", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("def fib") and len(out.token_ids) == 5
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi\nthere"}])
    assert chat == "# user: hi\n# there\n"


def test_bfloat16_weights_give_the_float32_model_within_rounding(native_model):
    """bfloat16 serving holds bf16 weights and computes what float32 computes up to bf16
    rounding: logits agree closely and the argmax is the same wherever float32's top-2 margin
    exceeds that rounding."""
    prompt = {"prompt_token_ids": PROMPTS[1]}
    bf16, fp32 = LLM(native_model, dtype="bfloat16"), LLM(native_model, dtype="float32")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    ids = torch.tensor([PROMPTS[1]])
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        low = bf16.model.compute_logits(bf16.model(ids, positions).hidden)[0]  # [T, V] float32 from bf16 weights
        high = fp32.model.compute_logits(fp32.model(ids, positions).hidden)[0]
    assert torch.nn.functional.cosine_similarity(low, high, dim=-1).min() > 0.999
    top2 = high.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 0.1 * high.abs().max()
    assert decisive.any() and torch.equal(low.argmax(-1)[decisive], high.argmax(-1)[decisive])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(bf16.generate(prompt, params)[0].token_ids) == 8


# ---- bounded, validated parameters ------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    dict(max_tokens=True), dict(top_k=True), dict(temperature=True), dict(top_p=True), dict(seed=False),
    dict(stop_token_ids=[True]), dict(ignore_eos="yes"),
    dict(temperature=float("inf")), dict(temperature=float("nan")), dict(temperature=10 ** 400),
    dict(top_p=float("nan")), dict(top_p=float("inf")),
    dict(top_k=2 ** 31), dict(top_k=2 ** 63), dict(top_k=-2), dict(top_k=1.5),
    dict(seed=-1), dict(seed=2 ** 64), dict(seed=1.0),
    dict(stop=["x"] * 65), dict(stop=["x" * 1025]), dict(stop=[""]), dict(stop=[3]), dict(stop=7),
    dict(stop_token_ids=[-1]), dict(stop_token_ids=5),
], ids=repr)
def test_sampling_params_refuse_what_they_cannot_serve(bad):
    key = next(iter(bad))
    with pytest.raises(InvalidRequestError, match=rf"^invalid {key}=.*: expected "):
        SamplingParams(**bad)


def test_sampling_params_at_their_bounds_are_served(native_model):
    llm = LLM(native_model, dtype="float32")
    prompt = {"prompt_token_ids": PROMPTS[1]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    # A top_k above the vocabulary keeps every token: the same draws as no top_k at all.
    widest = SamplingParams(temperature=1.0, top_k=2 ** 31 - 1, max_tokens=6, seed=2 ** 64 - 1, ignore_eos=True)
    unfiltered = SamplingParams(temperature=1.0, max_tokens=6, seed=2 ** 64 - 1, ignore_eos=True)
    assert llm.generate(prompt, widest)[0].token_ids == llm.generate(prompt, unfiltered)[0].token_ids
    logits = torch.randn(2, 50)
    batch = SamplingBatch.build([widest, unfiltered], [None, None], "cpu")
    torch.testing.assert_close(process_logits(logits, batch), logits.softmax(-1))
    # A temperature too small to divide by in float32 is an exact argmax, as 0 is.
    for tiny in (1e-6, 1e-40, 5e-324):
        params = SamplingParams(temperature=tiny, max_tokens=6, ignore_eos=True)
        assert params.greedy and llm.generate(prompt, params)[0].token_ids == greedy
    many = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[chr(0x4E00 + i) * 1024 for i in range(64)])
    assert llm.generate(prompt, many)[0].token_ids == greedy
    assert SamplingParams(stop=None, stop_token_ids=None, top_k=-1).stop == [] and SamplingParams(top_k=-1).top_k == 0


def test_bad_requests_are_invalid_request_errors(native_model):
    llm = LLM(native_model, dtype="float32")
    cases = [
        (lambda: llm.generate(123), "prompts must be a prompt .* or a list of prompts; got int"),
        (lambda: llm.generate(None), "got NoneType"),
        (lambda: llm.generate([123]), "a prompt is a string or a dict.*got int"),
        (lambda: llm.generate([b"bytes"]), "got bytes"),
        (lambda: llm.generate({"text": "no ids"}), "got dict"),
        (lambda: llm.generate("\ud800 lone"), r"not valid Unicode text: it holds a lone surrogate \('\\ud800'\) at "
                                              "character 0"),
        (lambda: llm.generate({"prompt_token_ids": [5], "prompt": "x\udfff"}), "lone surrogate"),
        (lambda: llm.generate({"prompt_token_ids": [5], "prompt": 5}), "must be a string"),
        (lambda: llm.generate({"prompt_token_ids": [True, 5]}), "list of integers"),
        (lambda: llm.generate({"prompt_token_ids": (5, 6)}), "list of integers"),
        (lambda: llm.generate("hi", {"max_tokens": 3}), "sampling_params must be a SamplingParams"),
        (lambda: llm.generate("hi", [{"max_tokens": 3}]), "sampling_params must be a SamplingParams, got dict"),
        (lambda: llm.generate("hi", SamplingParams(stop_token_ids=[320])), r"stop_token_ids.*\[0, 320\); got 320"),
        (lambda: llm.add_request("hi", request_id=7), "request_id must be a string"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            call()
    llm.add_request("hi", request_id="same")
    with pytest.raises(InvalidRequestError, match="'same' is already waiting or running"):
        llm.add_request("hi", request_id="same")
    llm.abort("same")
    assert not llm.has_unfinished()
    assert llm.generate("hi", SamplingParams(max_tokens=2, stop_token_ids=[319]))[0].finished


def test_engine_settings_are_config_errors(native_model, monkeypatch):
    with pytest.raises(ConfigError, match=r"max_model_len=300 exceeds this model's context \(max_position_embeddings=256\)"):
        LLM(native_model, dtype="float32", max_model_len=300)
    assert LLM(native_model, dtype="float32", max_model_len=256).max_model_len == 256
    for bad in (dict(max_num_seqs=True), dict(max_model_len=True), dict(seed=True), dict(seed=-1), dict(dtype=["float32"]),
                dict(device="tpu"), dict(device=None)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            LLM(native_model, **{"dtype": "float32", **bad})
    for none in ("none", "None", " NONE "):
        assert LLM(native_model, dtype="float32", speculative_config=none).speculator is None
    with pytest.raises(ConfigError, match="speculative_config must be a JSON object"):
        LLM(native_model, dtype="float32", speculative_config=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device 'cuda': this machine has no CUDA device"):
        LLM(native_model, device="cuda")
    with pytest.raises(ConfigError, match="no CUDA device"):
        LLM(native_model, device="cuda:0")


def test_a_single_chain_batch_is_built_as_the_ragged_path_builds_it():
    # build_attention's batch-1 shortcut (decode, chain verify, prefill) against the general path.
    import dataclasses

    from specdecode.engine.ragged import _one_chain, _ragged

    for tokens, start in (([5], 0), ([5], 37), ([5, 6, 7, 8], 12), (list(range(3, 40)), 0)):
        entry = ForwardEntry(slot=2, token_ids=tokens, start=start, num_logits=len(tokens))
        fast, general = _one_chain(entry, "cpu"), _ragged([entry], 99, None, "cpu")
        for a, b in zip(fast[:2], general[:2]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for field in dataclasses.fields(fast[2]):
            a, b = getattr(fast[2], field.name), getattr(general[2], field.name)
            assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b, field.name
