"""DeepSeek-family targets (MLA, MoE, DSA, IndexCache, built-in MTP): parity with transformers."""

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner
from specdecode.errors import UnsupportedModelError
from specdecode.models.config import ModelConfig, indexer_types_from
from specdecode.models.loader import load_model

from helpers import (CHI2_999_DF7, DEEPSEEK, chi_square, exact_second_token_probs, generate_ids, hf_model,
                     make_deepseek_model, verify_against_the_drafter)

VARIANTS = list(DEEPSEEK)


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: make_deepseek_model(root / v, v) for v in VARIANTS}


def _hf(path):
    return hf_model(path, eager=True)


def _ids(n: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 320, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_prefill_and_decode(deepseek_models, variant):
    """Prefill, then one token at a time through the latent (and indexer-key) cache."""
    path = deepseek_models[variant]
    hf = _hf(path)
    ours = load_model(path, torch.float32)
    runner = Runner(ours, num_slots=2, max_len=64, dtype=torch.float32, device=torch.device("cpu"))
    ids = _ids(20)
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [20, V]
    out = runner.forward([ForwardEntry(1, ids[0, :12].tolist(), start=0, num_logits=12)])
    torch.testing.assert_close(out.logits[0], ref[:12], atol=1e-4, rtol=1e-4)
    for t in range(12, 20):
        out = runner.forward([ForwardEntry(1, [int(ids[0, t])], start=t)])
        torch.testing.assert_close(out.logits[0, 0], ref[t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
def test_ragged_batch_and_verify_widths_match_transformers(deepseek_models, variant):
    """Two sequences of different lengths in one forward, then a 4-token verify-shaped step
    next to a 1-token step: every row equals transformers' logits for its own sequence."""
    path = deepseek_models[variant]
    hf = _hf(path)
    runner = Runner(load_model(path, torch.float32), num_slots=3, max_len=64, dtype=torch.float32,
                    device=torch.device("cpu"))
    a, b = _ids(17, seed=2)[0], _ids(11, seed=3)[0]
    with torch.no_grad():
        ref_a, ref_b = hf(a[None]).logits[0], hf(b[None]).logits[0]
    out = runner.forward([ForwardEntry(0, a[:13].tolist(), start=0, num_logits=13),
                          ForwardEntry(2, b[:10].tolist(), start=0, num_logits=10)])
    torch.testing.assert_close(out.logits[0, :13], ref_a[:13], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, :10], ref_b[:10], atol=1e-4, rtol=1e-4)
    out = runner.forward([ForwardEntry(0, a[13:17].tolist(), start=13, num_logits=4),
                          ForwardEntry(2, b[10:11].tolist(), start=10, num_logits=1)])
    torch.testing.assert_close(out.logits[0, :4], ref_a[13:17], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[1, 0], ref_b[10], atol=1e-4, rtol=1e-4)


def test_dsa_selection_matters_and_shared_layers_reuse_it(deepseek_models, tmp_path):
    """The parity above is not vacuous: with every key selected (dense) the logits move, and
    IndexCache's shared layer really reuses the full layer's top-k (its own indexer would differ)."""
    path = deepseek_models["deepseek_v32"]
    ids = _ids(24)
    pos = torch.arange(24)[None]
    sparse = load_model(path, torch.float32)
    with torch.no_grad():
        base = sparse.compute_logits(sparse(ids, pos).hidden)
        for layer in sparse.model.layers:
            layer.self_attn.indexer.topk = 10_000
        dense = sparse.compute_logits(sparse(ids, pos).hidden)
    assert (base - dense).abs().max() > 1e-2
    import json
    import shutil

    shared_dir = tmp_path / "shared"
    shutil.copytree(path, shared_dir)
    cfg = json.loads((shared_dir / "config.json").read_text())
    (shared_dir / "config.json").write_text(json.dumps({**cfg, "index_topk_pattern": "FSS"}))
    shared = load_model(shared_dir, torch.float32)
    assert shared.config.indexer_types == ("full", "shared", "shared")
    from specdecode.models.dsa import SparseContext

    record = SparseContext(record=[])
    with torch.no_grad():
        out = shared.compute_logits(shared(ids, pos, dsa_record=record).hidden)
    assert len(record.record) == 1  # only the full layer ran its indexer
    assert (out - base).abs().max() > 1e-3


def test_indexer_type_patterns():
    assert indexer_types_from(6, freq=2) == ("full", "full", "shared", "full", "shared", "full")
    assert indexer_types_from(4, "FSSF") == ("full", "shared", "shared", "full")
    assert indexer_types_from(3, ["full", "shared", "full"]) == ("full", "shared", "full")
    with pytest.raises(UnsupportedModelError, match="first DSA layer"):
        indexer_types_from(3, "SFF")
    with pytest.raises(UnsupportedModelError, match="one F or S per layer"):
        indexer_types_from(3, "FS")
    with pytest.raises(UnsupportedModelError, match=">= 1"):
        indexer_types_from(3, freq=0)


@pytest.mark.parametrize("variant", ["deepseek_v3", "glm_moe_dsa"])
def test_greedy_generation_matches_transformers(deepseek_models, variant):
    path = deepseek_models[variant]
    hf = _hf(path)
    prompt = [5, 17, 99, 42, 7, 11, 250, 3]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=1)
    out = LLM(path, dtype="float32").generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_config_round_trip_and_routing_stays_float32(deepseek_models):
    cfg = ModelConfig.from_dir(deepseek_models["glm_moe_dsa"])
    again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
    model = load_model(deepseek_models["deepseek_v3"], torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepseek-mtp")
    return {"deepseek_v3": make_deepseek_model(root / "v3", "deepseek_v3", mtp_layers=1),
            "deepseek_v32": make_deepseek_model(root / "v32", "deepseek_v32", mtp_layers=1),
            "glm_moe_dsa-2mtp": make_deepseek_model(root / "glm", "glm_moe_dsa", mtp_layers=2)}


def test_mtp_layer_is_computed_as_deepseek_v3_defines_it(mtp_models):
    """Built-in MTP against an independent reference: transformers' own decoder layer with the
    MTP layer's weights, fed eh_proj([enorm(embed(t+1)) ; hnorm(h_t)]), then shared_head."""
    import transformers
    from safetensors.torch import load_file

    path = mtp_models["deepseek_v3"]
    ours = load_model(path, torch.float32)
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    hf_cfg.num_hidden_layers = 4  # build layer 3 (an MoE layer) to hold the MTP block's weights
    hf_cfg._attn_implementation = "eager"
    block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(hf_cfg, 3).eval()
    state = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.3."
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)
               and not k[len(prefix):].startswith(("enorm", "hnorm", "eh_proj", "shared_head"))}
    experts = range(hf_cfg.n_routed_experts)  # transformers keeps the experts as stacked tensors
    weights["mlp.experts.gate_up_proj"] = torch.stack([torch.cat((weights.pop(f"mlp.experts.{e}.gate_proj.weight"),
                                                                   weights.pop(f"mlp.experts.{e}.up_proj.weight")))
                                                        for e in experts])
    weights["mlp.experts.down_proj"] = torch.stack([weights.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    block.load_state_dict(weights)
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(hf_cfg)

    def rms(x, w, eps=hf_cfg.rms_norm_eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    ids = _ids(10)
    T = ids.shape[1] - 1
    with torch.no_grad():
        hidden = ours(ids, torch.arange(10)[None]).hidden  # final-normed target states
        emb = state["model.embed_tokens.weight"][ids[:, 1:]]
        x = torch.cat((rms(emb, state[prefix + "enorm.weight"]), rms(hidden[:, :T], state[prefix + "hnorm.weight"])), -1)
        x = x @ state[prefix + "eh_proj.weight"].t()
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        out = block(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        want = rms(out, state[prefix + "shared_head.norm.weight"]) @ state[prefix + "shared_head.head.weight"].t()
        layer = ours.model.layers[3]
        cos, sin = ours.model.rotary_emb(pos, x.dtype)
        got = layer.logits(layer(layer.block_input(ours.model.embed_tokens(ids[:, 1:]), hidden[:, :T]), cos, sin))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


SPEC_METHODS = [
    {"method": "mtp", "num_speculative_tokens": 3},
    {"method": "mtp", "num_speculative_tokens": 2, "tree_topk": 2, "tree_num_nodes": 6},
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
]


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa-2mtp"])
@pytest.mark.parametrize("spec", SPEC_METHODS, ids=["mtp-chain", "mtp-tree", "ngram"])
def test_speculation_on_deepseek_targets_is_lossless(mtp_models, variant, spec):
    """Greedy outputs of built-in MTP (chain, EAGLE-2 tree; chaining / cycling the layers for
    k beyond their number) and n-gram equal plain decoding, ragged batches of 3 prompts."""
    path = mtp_models[variant]
    prompts = [{"prompt_token_ids": _ids(n, seed=n)[0].tolist()} for n in (9, 5, 14)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = [o.token_ids for o in LLM(path, dtype="float32").generate(prompts, params)]
    llm = LLM(path, dtype="float32", speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_builtin_mtp_sampling_keeps_the_target_distribution(mtp_models, monkeypatch):
    """T=1 through built-in MTP on a DSA target: the first token a speculative step commits
    follows the target's exact distribution (chi-square, 800 seeded requests), and the same
    test catches a verifier that checks against the drafter (negative control)."""
    path = mtp_models["deepseek_v32"]
    prompt = [5, 17, 99, 42]
    exact = exact_second_token_probs(path, prompt)
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True) for s in range(800)]
    config = {"method": "mtp", "num_speculative_tokens": 2}

    def second_tokens():
        return [ids[1] for ids in generate_ids(path, [{"prompt_token_ids": prompt}] * len(params), params, config,
                                               max_num_seqs=16)]

    assert chi_square(second_tokens(), exact) < CHI2_999_DF7
    from specdecode.speculative import speculator
    from specdecode.speculative.verify.chain import verify

    monkeypatch.setattr(speculator, "verify", verify_against_the_drafter(verify))
    assert chi_square(second_tokens(), exact) > CHI2_999_DF7


def test_mtp_without_mtp_layers_is_a_clear_error(deepseek_models):
    from specdecode.errors import ConfigError

    with pytest.raises(ConfigError, match="has none"):
        LLM(deepseek_models["deepseek_v3"], dtype="float32", speculative_config={"method": "mtp"})


def test_index_cache_search_and_serving_its_pattern(deepseek_models, tmp_path, capsys):
    """The greedy search walks from all-full to the requested number of full layers, each step
    the cheapest; its pattern then serves through hf_overrides, equal to plain (and speculative)
    decoding under the same pattern."""
    import json

    from specdecode.cli import main
    from specdecode.models.index_cache import calibration_loss, greedy_search, set_pattern

    path = deepseek_models["deepseek_v32"]
    model = load_model(path, torch.float32)
    windows = _ids(33, seed=4, batch=3)
    steps = greedy_search(model, windows, num_full=1)
    assert [s.pattern for s in steps][0] == "FFF" and steps[-1].pattern == "FSS" and len(steps) == 3
    # step 1 is the better of the two single-layer choices
    set_pattern(model, "FSF")
    a = calibration_loss(model, windows)
    set_pattern(model, "FFS")
    b = calibration_loss(model, windows)
    assert steps[1].loss == pytest.approx(min(a, b))
    text = tmp_path / "calib.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    assert main(["index-cache-search", "--model", str(path), "--num-full", "2", "--calibration-file", str(text),
                 "--windows", "2", "--context", "24"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pattern = result["hf_overrides"]["index_topk_pattern"]
    assert pattern.count("F") == 2 and pattern[0] == "F"

    prompts = [{"prompt_token_ids": _ids(10, seed=9)[0].tolist()}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    overrides = {"index_topk_pattern": "FSS"}
    plain = LLM(path, dtype="float32", hf_overrides=overrides)
    assert plain.model.config.indexer_types == ("full", "shared", "shared")
    want = plain.generate(prompts, params)[0].token_ids
    spec = LLM(path, dtype="float32", hf_overrides=overrides,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert spec.generate(prompts, params)[0].token_ids == want


def test_deepseek_refusals(deepseek_models):
    from specdecode.errors import ConfigError

    with pytest.raises(ConfigError, match="MLA"):
        LLM(deepseek_models["deepseek_v3"], dtype="float32", exact=True)
    with pytest.raises(ConfigError, match="hf_overrides"):
        LLM(deepseek_models["deepseek_v3"], dtype="float32", hf_overrides="FSS")
    with pytest.raises(UnsupportedModelError, match="first DSA layer"):
        LLM(deepseek_models["deepseek_v32"], dtype="float32", hf_overrides={"index_topk_pattern": "SFF"})


def test_unsupported_paths_say_so(deepseek_models, tmp_path):
    from specdecode.errors import ConfigError
    from specdecode.interop.gguf import export_gguf
    from specdecode.train.drafter import DrafterTrainConfig, train_drafter

    with pytest.raises(ConfigError, match="DeepSeek-family"):
        export_gguf(deepseek_models["deepseek_v3"], tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="own MTP layers"):
        train_drafter(DrafterTrainConfig(method="eagle3", target=deepseek_models["deepseek_v3"],
                                         out_dir=tmp_path / "o", work_dir=tmp_path / "w", device="cpu"))


def test_server_and_bench_run_a_deepseek_target_with_builtin_mtp(tmp_path):
    """Through the OpenAI API (official client) and the bench harness: built-in MTP on a DSA
    target, IndexCache pattern from --hf-overrides; outputs equal offline plain decoding."""
    import json

    from specdecode.bench.harness import BenchConfig, run_bench
    from specdecode.bench.methods import parse_methods
    from specdecode.server.serve import BackgroundServer

    path = make_deepseek_model(tmp_path / "m", "deepseek_v32", mtp_layers=1, max_position_embeddings=2048)
    overrides = {"index_topk_pattern": "FSF"}
    ref = LLM(path, dtype="float32", hf_overrides=overrides).generate(
        "def fib", SamplingParams(temperature=0, max_tokens=12))[0]
    srv = BackgroundServer(model=str(path), dtype="float32", served_model_name="ds", hf_overrides=overrides,
                           speculative_config=json.dumps({"method": "mtp", "num_speculative_tokens": 2}))
    try:
        import openai

        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model="ds", prompt="def fib", max_tokens=12, temperature=0)
        assert out.choices[0].text == ref.text
    finally:
        srv.stop()
    cfg = BenchConfig(methods=parse_methods("none,mtp:k=2"), model=str(path), num_prompts=2, max_tokens=8,
                      dtype="float32", hf_overrides=overrides, out_dir=tmp_path / "bench", repeats=1)
    runs = run_bench(cfg)["runs"]
    mtp = [r for r in runs if r["method"].startswith("mtp")]
    assert mtp and all(r["outputs_equal_to_plain"] == "2/2" for r in mtp)


@pytest.mark.parametrize("spec", [{"method": "draft_model", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "num_speculative_tokens": 3, "verify_pruning": "dcut"}],
                         ids=["draft_model", "draft_model-dcut"])
def test_draft_model_on_a_dsa_target_is_lossless(mtp_models, native_drafter, spec):
    """A separate draft model (same tokenizer) against an MLA + MoE + DSA target: greedy equal to plain."""
    path = mtp_models["deepseek_v32"]
    prompts = [{"prompt_token_ids": _ids(n, seed=n)[0].tolist()} for n in (9, 5, 14)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = [o.token_ids for o in LLM(path, dtype="float32").generate(prompts, params)]
    outs = LLM(path, dtype="float32", speculative_config={**spec, "model": str(native_drafter)}).generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    if "verify_pruning" not in spec:  # D-Cut's decision to draft at all depends on measured step times
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0
