"""The int8 KV cache (`kv_cache_dtype="int8"`): one record per (token, KV head), its values and scale, read
by every consumer of the target's cache (the attention op, the C++ stack's lean path, PyTorch's kernel on
the dequantised values) or refused by name where it is not."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, make_deepseek_model

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.kernels import attention_cpu, gemm_a8_cpu
from specdecode.models import llama, native_stack

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_the_cache_holds_records_at_about_half_a_bf16_caches_bytes(lean_model):
    plain = LLM(lean_model, dtype="bfloat16", max_num_seqs=2)
    int8 = LLM(lean_model, dtype="bfloat16", max_num_seqs=2, kv_cache_dtype="int8")
    k, D = int8.runner.kv_cache.k[0], int8.model.config.head_dim
    assert k.dtype == torch.int8 and k.shape[-1] == D + 4 and k.stride(1) == D + 4  # head-major records
    ratio = int8.runner.kv_cache.nbytes() / plain.runner.kv_cache.nbytes()
    assert ratio == pytest.approx((D + 4) / (2 * D))


@pytest.mark.parametrize("value,message", [("fp8", "fp8 caches need a GPU"), ("int4", "accepted: auto, int8"),
                                           (8, "accepted: auto, int8")])
def test_unsupported_cache_dtypes_are_refused_by_name(native_model, value, message):
    with pytest.raises(ConfigError, match=message):
        LLM(native_model, kv_cache_dtype=value)


def test_exact_mode_and_mla_models_refuse_an_int8_cache(native_model, tmp_path):
    with pytest.raises(ConfigError, match="exact=True keeps the KV cache in the served dtype"):
        LLM(native_model, exact=True, kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="MLA / DSA"):
        LLM(make_deepseek_model(tmp_path / "v3", "deepseek_v3"), kv_cache_dtype="int8")


def test_an_int8_cache_stays_close_to_the_served_dtypes(lean_model):
    """Quantisation changes the logits a little, not the model: a prompt's next-token logits with an int8
    cache against a bf16 one (a cache of other keys would differ by far more)."""
    ids = torch.randint(3, 320, (1, 60), generator=torch.Generator().manual_seed(0))[0].tolist()
    logits = {}
    for kv in ("auto", "int8"):
        llm = LLM(lean_model, dtype="bfloat16", max_num_seqs=1, kv_cache_dtype=kv)
        from specdecode.engine.ragged import ForwardEntry

        out = llm.runner.forward([ForwardEntry(0, ids[:50], 0, num_logits=50)])  # prefill
        steps = [llm.runner.forward([ForwardEntry(0, [t], 50 + i)]).logits[0, -1] for i, t in enumerate(ids[50:])]
        logits[kv] = torch.cat([out.logits[0], torch.stack(steps)]).float()
    gap = (logits["int8"] - logits["auto"]).abs().mean().item()
    spread = (logits["auto"][1:] - logits["auto"][:-1]).abs().mean().item()  # the next position's logits
    assert 0 < gap < 0.1 * spread


@pytest.mark.skipif(not (gemm_a8_cpu.available("cpu") and attention_cpu.serves_int8()),
                    reason="the lean path and the int8 attention kernel need AVX-512 (VNNI)")
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3", "mtp"])
def test_greedy_speculation_in_bf16_reads_the_same_int8_cache_as_plain_decoding(lean_model, lean_drafters,
                                                                                monkeypatch, method):
    """bf16, W4A8, heads of 32: plain decoding, verification and drafting on the C++ lean path with the int8
    attention kernel; every token equals plain decoding's."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        spec["model"] = str(lean_drafters[method])
    common = dict(dtype="bfloat16", quantization="w4a8", max_num_seqs=4, kv_cache_dtype="int8")
    plain = [o.token_ids for o in LLM(lean_model, **common).generate(PROMPTS, GREEDY)]
    llm = LLM(lean_model, speculative_config=spec, **common)
    lean = native_stack.native_stack_for(llm.model, llama.NATIVE_TYPES)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert lean.lean_forwards() > 0
