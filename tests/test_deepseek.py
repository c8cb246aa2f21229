"""DeepSeek-family targets (MLA, MoE, DSA, IndexCache, built-in MTP): parity with transformers."""

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner
from specdecode.errors import UnsupportedModelError
from specdecode.models.config import ModelConfig, indexer_types_from
from specdecode.models.loader import load_model

from helpers import DEEPSEEK, make_deepseek_model

VARIANTS = list(DEEPSEEK)


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("deepseek")
    return {v: make_deepseek_model(root / v, v) for v in VARIANTS}


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


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
