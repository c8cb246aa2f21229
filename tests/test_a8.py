"""W8A8 / W4A8 (int8 / int4 weights, activations quantised to int8 per block of 32): the kernels
(kernels/gemm_a8_cpu.cpp) against their PyTorch references bit for bit, width invariance, the schemes
through the layer and the model, and their refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, generate_ids

from specdecode import LLM, SamplingParams
from specdecode.errors import ConfigError
from specdecode.kernels import gemm_a8_cpu
from specdecode.models.loader import load_model
from specdecode.models.quant import QuantizedLinear, QuantScheme, quantize_module
from specdecode.train.drafter import DrafterTrainConfig
from specdecode.train.qat import enable_qat

W8A8 = QuantScheme.parse("w8a8")
W4A8 = QuantScheme.parse("w4a8")
SCHEMES = ["w8a8", "w4a8"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
needs_kernel = pytest.mark.skipif(not gemm_a8_cpu.available("cpu"),
                                  reason="the W8A8 kernel needs AVX-512 VNNI and a C++ compiler")


def _layer(n: int, k: int, seed: int = 0, bias: bool = False, scheme: QuantScheme = W8A8) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    return QuantizedLinear.from_weight(torch.randn(n, k, generator=g) * 0.05, b, scheme)


def _kernel(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    op = gemm_a8_cpu.w8a8_linear if layer.scheme.bits == 8 else gemm_a8_cpu.w4a8_linear
    return op(x, *layer.a8_arguments(x.device))


def _reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    if layer.scheme.bits == 8:
        return gemm_a8_cpu.reference_w8a8(x, layer.qweight, layer.scales, layer.bias)
    return gemm_a8_cpu.reference_w4a8(x, layer.unpacked_int4(), layer.scales, layer.zeros, layer.bias)


def test_the_schemes_parse_and_are_not_weight_only():
    assert W8A8 == QuantScheme(8, None, 8) and W8A8.name == "w8a8" and not W8A8.weight_only
    assert W4A8 == QuantScheme(4, 32, 8) and W4A8.name == "w4a8" and not W4A8.weight_only
    assert QuantScheme.parse("int8").weight_only and QuantScheme.parse("W8A8") == W8A8
    assert W8A8.fits(64) and not W8A8.fits(48) and W4A8.fits(64) and not W4A8.fits(48)  # whole blocks of 32
    with pytest.raises(ConfigError, match="w8a8, w4a8"):
        QuantScheme.parse("w2a8")


@pytest.mark.parametrize("spec", SCHEMES)
def test_the_reference_is_close_to_the_float_matmul_and_can_tell_weights_apart(spec):
    layer = _layer(96, 256, bias=True, scheme=QuantScheme.parse(spec))
    x = torch.randn(5, 256)
    exact = x @ layer.dequantize().T + layer.bias  # [5, 96] float32, activations unquantised
    ours = _reference(layer, x)
    assert ((ours - exact).norm() / exact.norm()).item() < 0.02  # int8 activations: about 0.6% here
    assert not torch.equal(ours, exact)  # the activations are quantised: another model
    wrong = _reference(_layer(96, 256, seed=1, bias=True, scheme=layer.scheme), x)
    assert ((wrong - exact).norm() / exact.norm()).item() > 0.5  # the check can fail


def test_activation_codes_and_scales_are_llama_cpp_q8_0s():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    codes, scales = gemm_a8_cpu.quantize_activations(x)
    assert scales[0, 0] == 1.0 and codes[0, 0].abs().sum() == 0  # an all-zero block
    assert scales[0, 1] == pytest.approx(2.0 / 127)
    assert codes[0, 1, :3].tolist() == [64.0, -127.0, 32.0]  # round(1 / (2/127)) = round(63.5) = 64 (to even)


@needs_kernel
@pytest.mark.parametrize("spec", SCHEMES)
@pytest.mark.parametrize("n,k", [(16, 32), (37, 64), (512, 512), (130, 1408), (8192, 512)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_its_reference_bit_for_bit(spec, n, k, bias, dtype):
    layer = _layer(n, k, bias=bias, scheme=QuantScheme.parse(spec))
    for m in (1, 2, 3, 4, 5, 8, 17):
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(dtype)
        x[0, :32] = 0  # an all-zero block
        out = _kernel(layer, x)
        assert out.shape == (m, n) and out.dtype == dtype
        assert torch.equal(out, _reference(layer, x)), m


@needs_kernel
@pytest.mark.parametrize("spec", SCHEMES)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(spec):
    layer = _layer(300, 512, bias=True, scheme=QuantScheme.parse(spec))
    x = torch.randn(19, 512).bfloat16()
    alone = torch.cat([_kernel(layer, x[i:i + 1]) for i in range(19)])
    for m in range(1, 20):
        assert torch.equal(_kernel(layer, x[:m]), alone[:m]), m
    assert torch.equal(_kernel(layer, x.view(1, 19, 512)), alone[None])  # any leading shape


@needs_kernel
def test_bad_inputs_are_refused():
    w4 = _layer(16, 64, scheme=W4A8)
    nibbles, scale_zeros, _, _ = w4.a8_arguments(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="bf16 scales and zeros"):
        gemm_a8_cpu.w4a8_linear(torch.randn(2, 64), nibbles, scale_zeros.float(), None, 16)
    with pytest.raises(RuntimeError, match="packed weight"):
        gemm_a8_cpu.w4a8_linear(torch.randn(2, 64), nibbles[:, :4], scale_zeros, None, 16)
    layer = _layer(16, 64)
    packed, scales, bias, n = layer.a8_arguments(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        gemm_a8_cpu.w8a8_linear(torch.randn(2, 48), packed, scales, bias, n)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        gemm_a8_cpu.w8a8_linear(torch.randn(2, 64).half(), packed, scales, bias, n)
    with pytest.raises(RuntimeError, match="packed weight"):
        gemm_a8_cpu.w8a8_linear(torch.randn(2, 64), packed.view(torch.int8), scales, bias, n)
    with pytest.raises(RuntimeError, match="scales"):
        gemm_a8_cpu.w8a8_linear(torch.randn(2, 64), packed, scales[:8], bias, n)


@pytest.mark.parametrize("spec", SCHEMES)
def test_the_layer_takes_the_kernel_or_the_reference_with_the_same_numbers(monkeypatch, spec):
    layer = _layer(48, 64, bias=True, scheme=QuantScheme.parse(spec))
    x = torch.randn(2, 3, 64).bfloat16()
    reference = _reference(layer, x)
    assert torch.equal(layer(x), reference)
    monkeypatch.setattr(gemm_a8_cpu, "available", lambda device="cpu": False)
    fallback = _layer(48, 64, bias=True, scheme=layer.scheme)
    assert torch.equal(fallback(x), reference)


@pytest.mark.parametrize("spec", SCHEMES)
def test_modules_quantise_only_layers_of_whole_blocks(spec):
    module = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 8))
    quantize_module(module, QuantScheme.parse(spec))
    assert isinstance(module[0], torch.nn.Linear) and isinstance(module[1], QuantizedLinear)
    assert module(torch.randn(3, 16)).shape == (3, 8)


@pytest.mark.parametrize("spec", SCHEMES)
def test_quantisation_aware_and_matched_drafter_training_refuse_them(spec):
    with pytest.raises(ConfigError, match="weight-only"):
        enable_qat(torch.nn.Sequential(torch.nn.Linear(64, 64)), QuantScheme.parse(spec))
    for key in ("target_quantization", "qat"):
        with pytest.raises(ValueError, match="weight-only"):
            DrafterTrainConfig(method="eagle3", **{key: spec})


@pytest.mark.parametrize("spec,weight_only", [("w8a8", "int8"), ("w4a8", "int4-g32")])
def test_the_model_is_its_own_decoding_deterministic_and_close_to_weight_only(native_model, spec, weight_only):
    theirs = load_model(native_model, torch.float32, quantization=QuantScheme.parse(weight_only))
    ours = load_model(native_model, torch.float32, quantization=QuantScheme.parse(spec))
    ids, positions = torch.tensor([[5, 9, 11, 3, 7, 2]]), torch.arange(6)[None]
    with torch.no_grad():
        a = theirs.compute_logits(theirs(ids, positions).hidden)
        b = ours.compute_logits(ours(ids, positions).hidden)
    assert not torch.equal(a, b)  # the activations really are quantised
    assert ((a - b).norm() / a.norm()).item() < 0.05
    decoded = generate_ids(native_model, PROMPTS, GREEDY, quantization=spec)
    assert decoded == generate_ids(native_model, PROMPTS, GREEDY, quantization=spec)


@needs_kernel
@pytest.mark.parametrize("quantization", SCHEMES)
@pytest.mark.parametrize("method", [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                                    {"method": "draft_model", "num_speculative_tokens": 3}])
def test_greedy_speculation_equals_plain_decoding_in_bf16(lean_model, native_drafter, method, quantization):
    """Every matmul is width-invariant under w8a8 / w4a8, and so is the attention kernel, so bf16
    verification reproduces bf16 decoding. On heads of 16, which PyTorch's attention serves, a verify
    step's padded batch rounded otherwise and draft-model speculation left plain decoding's tokens."""
    spec = dict(method, **({"model": str(native_drafter)} if method["method"] == "draft_model" else {}))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(lean_model, dtype="bfloat16", quantization=quantization,
                                      max_num_seqs=4).generate(PROMPTS, params)]
    llm = LLM(lean_model, dtype="bfloat16", quantization=quantization, max_num_seqs=4,
              speculative_config=spec)
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
