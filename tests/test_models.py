"""Parity with transformers: same checkpoint, same logits, same greedy output."""

import json

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.ragged import ForwardEntry, LengthGrouping
from specdecode.engine.runner import Runner
from specdecode.errors import ModelLoadError, TokenizerMismatchError, UnsupportedModelError
from specdecode.models.loader import load_model
from helpers import hf_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "llama-tied", "llama3-rope"]


def _hf(path):
    return hf_model(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_prefill_and_decode(hf_models, family):
    path = hf_models[family]
    hf = _hf(path)
    ours = load_model(path, torch.float32)
    runner = Runner(ours, num_slots=2, max_len=128, dtype=torch.float32, device=torch.device("cpu"))
    ids = torch.randint(3, 320, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [24, V]
    # Prefill the first 16 tokens, then decode the rest one at a time through the cache.
    out = runner.forward([ForwardEntry(1, ids[0, :16].tolist(), start=0, num_logits=16)])
    torch.testing.assert_close(out.logits[0], ref[:16], atol=1e-4, rtol=1e-4)
    for t in range(16, 24):
        out = runner.forward([ForwardEntry(1, [int(ids[0, t])], start=t)])
        torch.testing.assert_close(out.logits[0, 0], ref[t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama-tied"])
def test_greedy_generation_matches_transformers(hf_models, family):
    path = hf_models[family]
    hf = _hf(path)
    llm = LLM(path, dtype="float32")
    prompt = [5, 17, 99, 42, 7]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=1)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_hidden_taps_equal_transformers_hidden_states(hf_models):
    path = hf_models["llama"]
    hf = _hf(path)
    ours = load_model(path, torch.float32)
    ids = torch.randint(3, 320, (1, 10))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
        out = ours(ids, torch.arange(10)[None], hidden_taps=(0, 1, 2))
    for layer in (0, 1):
        torch.testing.assert_close(out.taps[layer], ref[layer], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.model.norm(out.taps[2]), ref[2], atol=1e-5, rtol=1e-5)


def test_sharded_checkpoint_loads(hf_models, tmp_path):
    hf = _hf(hf_models["llama"])
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_models["llama"] / name).read_bytes())
    a = load_model(tmp_path, torch.float32)
    b = load_model(hf_models["llama"], torch.float32)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_missing_and_corrupt_checkpoints(native_model, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(tmp_path / "nope")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((native_model / name).read_bytes())
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(broken)
    (broken / "model.safetensors").write_bytes((native_model / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(broken)


def test_unsupported_architecture_and_tokenizer_mismatch(native_model, tmp_path):
    cfg = json.loads((native_model / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (odd / name).write_bytes((native_model / name).read_bytes())
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'.*accepted"):
        LLM(odd)
    (odd / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        LLM(odd)
    # A model whose vocabulary is smaller than its tokenizer's.
    from helpers import make_native_model

    small = make_native_model(tmp_path / "small", vocab=300)
    from helpers import make_tokenizer

    make_tokenizer(small, 320)
    with pytest.raises(TokenizerMismatchError, match="vocab_size is 300"):
        LLM(small)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, q/k norms
def test_fused_projections_change_nothing_but_the_call_count(hf_models, family, tmp_path):
    """load_model fuses q/k/v and gate/up into one matmul each: same logits as the separate
    layers, same state_dict names and shapes, and the weights still save as separate tensors."""
    from specdecode.models.llama import fuse_projections
    from specdecode.models.checkpoint import read_checkpoint, save_checkpoint

    fused = load_model(hf_models[family], torch.float32)
    assert all(layer.self_attn.qkv is not None and layer.mlp.gate_up is not None for layer in fused.model.layers)
    separate = load_model(hf_models[family], torch.float32)
    for layer in separate.model.layers:
        layer.self_attn.qkv = layer.mlp.gate_up = None
    ids = torch.randint(3, 320, (2, 12), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids, positions).hidden, separate(ids, positions).hidden, atol=1e-5, rtol=1e-5)
    state = fused.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in separate.state_dict().items()}
    assert fuse_projections(fused) is fused  # idempotent
    save_checkpoint(state, {}, tmp_path / "ck", hf_models[family])  # views of one tensor must still save
    _, saved = read_checkpoint(tmp_path / "ck", "test")
    q = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(saved[q].float(), state[q].to(torch.bfloat16).float())


def test_length_groups_split_only_where_padding_costs_more_than_a_forward():
    from specdecode.engine.ragged import length_groups
    assert length_groups([5, 5, 5, 5], 128) == [[0, 1, 2, 3]]  # verify steps: one forward
    assert length_groups([1, 150, 1, 1], 128) == [[0, 2, 3], [1]]  # a catch-up next to decode steps
    assert length_groups([1, 150, 1, 1], overhead=1000) == [[0, 1, 2, 3]]  # forwards dearer than padding
    lengths = [300, 20, 120, 25, 310, 110]
    groups = length_groups(lengths, overhead=64)
    assert sorted(i for g in groups for i in g) == list(range(6))
    cost = sum(64 + len(g) * max(lengths[i] for i in g) for g in groups)
    assert cost == 64 * 3 + 2 * 25 + 2 * 120 + 2 * 310  # the optimum: short, middle, long


def test_prompts_prefilled_together_equal_each_prompt_alone(lean_model):
    """On a CPU, a prompt too wide for the cached attention kernel (group x T query rows past its reach)
    runs as a forward of its own: PyTorch's flash kernel, which serves it, rounds a row by the padded
    key count beside it, so prompts prefilled together used to decode otherwise than alone. Each
    prompt's logits, hidden states and cache are bit for bit its own forward's; the control, one
    padded forward (the grouping without the rule), differs."""
    from specdecode.kernels import attention_cpu
    if attention_cpu.max_rows() is None:
        pytest.skip("the cached attention kernel is not built here")
    model = load_model(lean_model, torch.bfloat16)
    prompts = [list(range(3, 3 + n)) for n in (40, 27, 2)]
    equal = {}
    for grouping in ("split", "padded"):
        together = Runner(model, 3, 64, torch.bfloat16, torch.device("cpu"))
        if grouping == "padded":
            together.grouping = LengthGrouping(together.grouping.overhead_tokens)
        assert (together.grouping.alone_from is not None) == (grouping == "split")
        result = together.forward([ForwardEntry(b, p, 0) for b, p in enumerate(prompts)])
        alone = Runner(model, 3, 64, torch.bfloat16, torch.device("cpu"))
        same = []
        for b, p in enumerate(prompts):
            own = alone.forward([ForwardEntry(b, p, 0)])
            same.append(torch.equal(result.logits[b, :1], own.logits[0]) and
                        torch.equal(result.hidden[b, :len(p)], own.hidden[0]))
        caches = [*zip(together.kv_cache.k, alone.kv_cache.k), *zip(together.kv_cache.v, alone.kv_cache.v)]
        equal[grouping] = same + [all(torch.equal(x, y) for x, y in caches)]
    assert all(equal["split"])
    assert not all(equal["padded"])


def test_ragged_forward_in_groups_equals_one_padded_forward(native_model):
    """A catch-up next to one-token steps runs as separate forwards: same logits, hidden states
    and cache contents as the single padded forward."""
    model = load_model(native_model, torch.float32)
    prompts = [list(range(3, 3 + n)) for n in (40, 12, 9)]
    outs = []
    for overhead in (8, 10 ** 6):  # split, then one padded forward
        runner = Runner(model, 4, 128, torch.float32, torch.device("cpu"))
        runner.forward_overhead_tokens = overhead
        runner.forward([ForwardEntry(1, prompts[1], 0), ForwardEntry(2, prompts[2], 0)])
        entries = [ForwardEntry(0, prompts[0], 0), ForwardEntry(1, [7], 12), ForwardEntry(2, [8, 9], 9, num_logits=2)]
        result = runner.forward(entries, hidden_taps=(0,))
        outs.append((result, runner.kv_cache.k[0][:3, :41].clone()))
    (split, k_split), (padded, k_padded) = outs
    assert split.num_new == padded.num_new == [40, 1, 2]
    torch.testing.assert_close(split.logits[0, :1], padded.logits[0, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.logits[1, :1], padded.logits[1, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.logits[2], padded.logits[2], atol=1e-5, rtol=1e-5)
    for b, n in enumerate(split.num_new):
        torch.testing.assert_close(split.hidden[b, :n], padded.hidden[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(split.taps[0][b, :n], padded.taps[0][b, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_split, k_padded, atol=1e-5, rtol=1e-5)
