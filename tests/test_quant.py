"""Weight-only quantisation: the layer, the model, the cache, and losslessness under int8/int4."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model
from specdecode.models.quant import QuantCache, QuantizedLinear, QuantScheme, quantize_module

SCHEMES = ["int8", "int4-g32", "int4-g64", "int4-g128"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_scheme_names_parse_and_bad_ones_are_refused():
    assert QuantScheme.parse(None) is None and QuantScheme.parse("none") is None
    assert QuantScheme.parse("int8") == QuantScheme(8, None)
    assert QuantScheme.parse("INT4") == QuantScheme(4, 32)
    assert QuantScheme.parse("int4-g128").name == "int4-g128"
    for bad in ("int3", "int4-g48", "fp8", 8):
        with pytest.raises(ConfigError, match="quantization"):
            QuantScheme.parse(bad)
    with pytest.raises(ConfigError, match="quantization"):
        LLM(quantization="int2")


@pytest.mark.parametrize("spec", SCHEMES)
def test_the_layer_is_close_to_its_float_weight_and_exact_to_its_dequantised_one(spec):
    torch.manual_seed(0)
    weight, bias = torch.randn(320, 256) * 0.05, torch.randn(320)
    layer = QuantizedLinear.from_weight(weight, bias, QuantScheme.parse(spec))
    dense = layer.dequantize()
    relative_error = ((dense - weight).norm() / weight.norm()).item()
    assert relative_error < (0.01 if spec == "int8" else 0.12)
    x = torch.randn(2, 5, 256)
    reference = x @ dense.T + bias  # [2, 5, 320]
    torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)  # float32: the dense path
    # bf16 on CPU: the packed int8 / int4 kernel multiplies by the same weights (bf16 rounding only).
    out = layer(x.bfloat16()).float()
    assert (out - reference).abs().max() < 0.05 * reference.abs().max()
    rows = layer.rows(16, 48)
    torch.testing.assert_close(rows(x), reference[..., 16:48], rtol=1e-5, atol=1e-5)
    assert rows.qweight.untyped_storage().data_ptr() == layer.qweight.untyped_storage().data_ptr()  # a view


def test_a_wide_layer_falls_back_to_the_dense_path_where_the_int4_kernel_cannot_pack():
    layer = QuantizedLinear.from_weight(torch.randn(200, 64), None, QuantScheme.parse("int4"))  # 200 % 16 != 0
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(layer(x), x @ layer.dequantize().bfloat16().T)


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_the_quantised_model_matches_the_dequantised_float_model(native_model, spec):
    scheme = QuantScheme.parse(spec)
    model = load_model(native_model, torch.float32, quantization=scheme)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert linears and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv, QuantizedLinear) and attn.qkv.split_sizes == [64, 32, 32]
    # The member projections are row views of the fused layer: same numbers, no second copy.
    x = torch.randn(1, 3, 64)
    q, k, v = attn.qkv(x)
    torch.testing.assert_close(attn.k_proj(x), k)
    ids = torch.tensor([[5, 9, 11, 3]])
    positions = torch.arange(4)[None]
    quant_logits = model.compute_logits(model(ids, positions).hidden)
    dense = load_model(native_model, torch.float32)
    with torch.no_grad():  # the float model with every linear weight replaced by its dequantised one
        for name, layer in model.named_modules():
            owner, _, attr = name.rpartition(".")
            if isinstance(layer, QuantizedLinear) and attr not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                # qkv / gate_up: the FusedLinear, whose members' weights are views of it
                getattr(dense.get_submodule(owner), attr).weight.copy_(layer.dequantize())
    torch.testing.assert_close(quant_logits, dense.compute_logits(dense(ids, positions).hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["int4-g32", "w4a8"])
def test_the_quantised_tensors_do_not_depend_on_which_dtype_loaded_the_model_first(native_model, tmp_path,
                                                                                  monkeypatch, spec):
    """The cache is keyed by the weights' dtype: a float32 checkpoint quantises to other tensors from its
    bf16 rounding, and a float32 load after a bf16 one took those (w4a8 logits 12% off int4-g32's)."""
    scheme = QuantScheme.parse(spec)

    def stored(model) -> list[torch.Tensor]:
        return [t for m in model.modules() if isinstance(m, QuantizedLinear) and not m.is_view
                for t in (m.qweight, m.scales, m.zeros)]

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "fresh"))
    alone = stored(load_model(native_model, torch.float32, quantization=scheme))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "shared"))
    from_bf16 = stored(load_model(native_model, torch.bfloat16, quantization=scheme))
    after = stored(load_model(native_model, torch.float32, quantization=scheme))
    assert all(torch.equal(a, b) for a, b in zip(after, alone, strict=True))
    # The control: this float32 checkpoint's bf16 rounding quantises to other tensors.
    assert not all(torch.equal(a, b) for a, b in zip(from_bf16, alone, strict=True))
    assert len(list((tmp_path / "shared" / "quantized").glob("*.safetensors"))) == 2


def test_the_cache_stores_the_quantised_tensors_and_a_reload_uses_them(native_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    scheme = QuantScheme.parse("int8")
    first = load_model(native_model, torch.bfloat16, quantization=scheme)
    files = list((tmp_path / "quantized").glob("*.safetensors"))
    assert len(files) == 1 and "int8" in files[0].name
    cache = QuantCache(files[0])
    assert cache.get("model.layers.0.self_attn.qkv") is not None and cache.get("lm_head") is not None
    # A reload takes the cached tensors (poison one to prove it), copied into aligned memory:
    # safetensors' buffers are not 64-byte aligned and the int8 kernel crashed on them.
    stored = cache.get("lm_head")
    cache.put("lm_head", {"qweight": torch.zeros_like(stored["qweight"]), "scales": stored["scales"]})
    cache.save()
    second = load_model(native_model, torch.bfloat16, quantization=scheme)
    assert second.lm_head.qweight.abs().sum() == 0
    assert second.model.layers[0].self_attn.qkv.qweight.data_ptr() % 64 == 0
    ids = torch.randint(3, 300, (1, 200))
    out = second(ids, torch.arange(200)[None]).hidden  # a prefill-sized bf16 forward through the kernels
    torch.testing.assert_close(out, first(ids, torch.arange(200)[None]).hidden)
    # A corrupt cache file is re-made, not trusted.
    files[0].write_bytes(b"not safetensors")
    third = load_model(native_model, torch.bfloat16, quantization=scheme)
    assert third.lm_head.qweight.abs().sum() > 0


def test_quantize_module_replaces_every_linear_of_a_drafter_module():
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False))
    x = torch.randn(4, 64)
    quantize_module(module, QuantScheme.parse("int8"))
    assert isinstance(module[0], QuantizedLinear) and isinstance(module[2], QuantizedLinear)
    assert module(x).shape == (4, 16)


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_plain_decoding_under_quantisation_is_deterministic_and_differs_from_float(native_model, spec):
    quantized = generate_ids(native_model, PROMPTS, GREEDY, quantization=spec)
    assert quantized == generate_ids(native_model, PROMPTS, GREEDY, quantization=spec)
    # Different weights, different model: if this ever held, quantisation would not be running.
    assert quantized != generate_ids(native_model, PROMPTS, GREEDY)


def test_a_layer_whose_input_is_no_multiple_of_the_int4_group_stays_dense():
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    quantize_module(module, QuantScheme.parse("int4"))  # groups of 32: 16 inputs do not fit
    assert isinstance(module[0], torch.nn.Linear) and isinstance(module[1], QuantizedLinear)


# ---- verification widths: the dense copy of a quantised layer (models/wide_kernels.py) ----------

needs_packing = pytest.mark.skipif(
    not __import__("specdecode.models.inference", fromlist=["can_pack"]).can_pack(torch.bfloat16, torch.device("cpu")),
    reason="oneDNN packing unavailable")


@needs_packing
@pytest.mark.parametrize("spec", ["int8", "int4-g32"])
def test_a_quantised_layer_runs_its_dense_copy_from_its_wide_width_on(spec):
    from specdecode.models.inference import PackedLinear

    torch.manual_seed(0)
    layer = QuantizedLinear.from_weight(torch.randn(64, 128), None, QuantScheme.parse(spec))
    layer.prepare(torch.bfloat16)
    dense = PackedLinear(layer.dequantize().to(torch.bfloat16), None)
    x = torch.randn(8, 128).to(torch.bfloat16)
    kernel_only = layer(x)
    layer.wide = (dense, 4)
    assert torch.equal(layer(x[:3]), kernel_only[:3])  # below the width: the int kernel
    assert torch.equal(layer(x[:4]), dense(x[:4]))  # from it on: the dense copy
    assert torch.equal(layer(x[None]), dense(x)[None])  # rows counted over the leading dimensions
    torch.testing.assert_close(layer(x).float(), x.float() @ layer.dequantize().T, rtol=0.02, atol=0.05)


@needs_packing
def test_wide_kernels_follow_the_cached_choice_and_can_be_turned_off(native_model, tmp_path,
                                                                                  monkeypatch):
    import json

    from specdecode.models import kernel_probe, wide_kernels

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    llm = LLM(native_model, dtype="bfloat16", quantization="int8", max_num_seqs=2)  # measures, then caches
    cache = json.loads(kernel_probe.cache_path().read_text())
    layers = [m for m in llm.model.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
    shapes = {wide_kernels.choice_key(m, torch.bfloat16) for m in layers}
    assert shapes <= set(cache) and all(cache[key] is None or cache[key] in wide_kernels.PROBE_ROWS for key in shapes)
    # A cached choice is what every later start runs (no timing involved).
    forced = {key: (2 if i % 2 == 0 else None) for i, key in enumerate(sorted(shapes))}
    kernel_probe.cache_path().write_text(json.dumps(forced))
    llm = LLM(native_model, dtype="bfloat16", quantization="int8", max_num_seqs=2)
    for m in (m for m in llm.model.modules() if isinstance(m, QuantizedLinear) and not m.is_view):
        want = forced[wide_kernels.choice_key(m, torch.bfloat16)]
        assert (m.wide is None) if want is None else (m.wide[1] == want)
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids  # runs
    llm = LLM(native_model, dtype="bfloat16", quantization="int8", max_num_seqs=2, verify_kernels="quantized")
    assert all(m.wide is None for m in llm.model.modules() if isinstance(m, QuantizedLinear))  # exact mode: test_exact
    with pytest.raises(ConfigError, match="verify_kernels"):
        LLM(native_model, quantization="int8", verify_kernels="dense")
