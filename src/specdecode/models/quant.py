"""Weight-only quantisation: int8 per output channel, int4 in groups along the input; and W8A8 / W4A8.

`quantize_module` replaces every linear layer of a frozen inference model (the target, a
draft model, an EAGLE/MTP/DFlash/DSpark/Medusa drafter) by a `QuantizedLinear`; embeddings
and norms stay in the activation dtype. A `QuantizedLinear` stands for the dense weight
`dequantize()` returns, exactly: every kernel below computes `x @ dequantize().T` and they
differ only in rounding, like dense matmuls of different widths do.

Kernels, chosen per call from the activation dtype (measured here, 2 threads, one row,
512 -> 2816: bf16 dense 106-133 us, int8 41-83 us, int4 49 us; LM head 512 -> 8192: bf16
328 us, int8 119-159 us, int4 192 us; see BENCHMARKS.md "Weight-only quantisation"):
- bf16 / fp16 on CPU: PyTorch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`.
  They cost one weight read per row (a GEMV each), so a verify forward of n rows costs
  about n times the one-row matmul; from a measured width on, a dense copy takes over
  (`models/wide_kernels.py`). Inductor's dequantise-GEMM measured 2.8-6x slower than
  `_weight_int8pack_mm` here, torchao 0.18's int8 weight-only layer 3.7x slower at one row and
  its CPU int4 1.4x slower (`benchmarks/torchao_kernels.py`). On an AVX2-only CPU (AMD EPYC
  Zen 3) `_weight_int8pack_mm` is compute-bound at decode widths, so int8 layers take
  specdecode's own few-row kernel there (kernels/gemv_int8_cpu.cpp) up to a measured width,
  eager and compiled: the layer's whole matmul (kernel, or past its width the fallback) is one
  C++ dispatcher op, `specdecode_int8::int8_linear`; int4 layers likewise take
  kernels/gemv_int4_cpu.cpp (`specdecode_int4::int4_linear`) where it measures faster.
- float32 (the tests' precision), and devices without those kernels (CUDA is not wired yet):
  a dense matmul with the dequantised weight, built once on first use (so it holds a dense
  copy too). Correct everywhere; fast only where dense is. On AVX2 int8 layers serve float32
  activations at 1-16 rows from the few-row kernel too (it converts the activation row, not
  the weight): float32 + int8 decoding measured 3.4x the dense copy's speed here; int4 layers
  (QAT int4 drafters next to a float32 target) take the int4 few-row kernel the same way.
A layer whose input width is no multiple of the int4 group size stays in the model's dtype.

`w8a8` / `w4a8` (opt-in) are not weight-only: int8 weights as `int8` stores them (int4 as `int4-g32`
does), times activations quantised to int8 per row and block of 32 inputs at every matmul (llama.cpp's
Q8_0 activations), so each is another model, with its own quality cost (BENCHMARKS.md). Their kernels
(kernels/gemm_a8_cpu.cpp, AVX-512 VNNI) serve every width and are bitwise width-invariant; elsewhere
PyTorch ops compute the same numbers, slower.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kernels import gemm_a8_cpu, gemv_int4_cpu, gemv_int8_cpu
from specdecode.models.served_linear import ServedLinear

log = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 32  # measured: the highest top-1 agreement with bf16 (95.0%; g64 94.4%, g128 93.4%; BENCHMARKS.md)


@dataclasses.dataclass(frozen=True, slots=True)
class QuantScheme:
    bits: int  # 8 or 4
    group_size: int | None  # int4: input columns sharing one scale and zero; int8: None (per output channel)
    # None: weight-only (activations in the model's dtype); 8: activations quantised to int8 per row
    # and block of 32 inputs at every matmul (`w8a8`, `w4a8`: kernels/gemm_a8_cpu.py), a model of its own.
    activation_bits: int | None = None

    @property
    def name(self) -> str:
        if self.activation_bits is not None:
            return f"w{self.bits}a{self.activation_bits}"
        return "int8" if self.bits == 8 else f"int4-g{self.group_size}"

    @property
    def weight_only(self) -> bool:
        return self.activation_bits is None

    @classmethod
    def parse(cls, spec: "str | QuantScheme | None") -> "QuantScheme | None":
        """None / "none" -> None; "int8"; "int4" (groups of 32); "int4-g32" / "int4-g64" / "int4-g128";
        "w8a8" / "w4a8" (int8 weights per channel / int4 in groups of 32, int8 activations per block of 32)."""
        if spec is None or isinstance(spec, QuantScheme):
            return spec
        from specdecode.errors import ConfigError

        if not isinstance(spec, str):
            raise ConfigError(f"quantization must be a string or None, got {type(spec).__name__}")
        text = spec.strip().lower()
        if text in ("", "none"):
            return None
        if text == "int8":
            return cls(8, None)
        if text == "w8a8":
            return cls(8, None, 8)
        if text == "w4a8":
            return cls(4, gemm_a8_cpu.BLOCK, 8)
        match = re.fullmatch(r"int4(?:-g(\d+))?", text)
        if match:
            group = int(match.group(1) or DEFAULT_INT4_GROUP)
            if group in INT4_GROUP_SIZES:
                return cls(4, group)
        raise ConfigError(f"quantization {spec!r} is not supported; accepted: none, int8, int4 "
                          f"(groups of {DEFAULT_INT4_GROUP}), " + ", ".join(f"int4-g{g}" for g in INT4_GROUP_SIZES)
                          + ", w8a8, w4a8")

    def fits(self, in_features: int) -> bool:
        """Whether a layer of this input size can take the scheme (int4: whole groups; w8a8 / w4a8: whole
        activation blocks); one that cannot stays in the model's dtype."""
        unit = gemm_a8_cpu.BLOCK if self.activation_bits is not None else self.group_size
        return unit is None or in_features % unit == 0


def quantize_weight(weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """weight [N, K] -> the stored tensors of its quantised form (see QuantizedLinear)."""
    w = weight.detach().float()
    N, K = w.shape
    # Scales (and int4 zeros) are rounded to bf16 values here, so the bf16 kernels multiply by
    # exactly the numbers `dequantize()` uses: the layer is one model at every width and dtype.
    if scheme.bits == 8:  # symmetric, per output channel: w = q * scale, q in [-127, 127]
        scale = _bf16_exact((w.abs().amax(dim=1) / 127).clamp(min=1e-8))  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        return {"qweight": q, "scales": scale}
    group = scheme.group_size
    if K % group:
        raise ValueError(f"int4 groups of {group} need an input size divisible by {group}, got {K}")
    # Asymmetric per group (like llama.cpp's Q4_1, in tinygemm's form): w = (q - 8) * scale + zero, q in [0, 15].
    wg = w.view(N, K // group, group)
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)  # [N, K/g]
    scale = _bf16_exact(((high - low) / 15).clamp(min=1e-8))
    zero = _bf16_exact(low + 8 * scale)
    q = torch.round((wg - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8).view(N, K)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # [N, K/2], two columns per byte, the even one low
    return {"qweight": packed, "scales": scale, "zeros": zero}


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """float32 tensor holding the nearest bf16 values."""
    return x.to(torch.bfloat16).float()


class QuantizedLinear(ServedLinear):
    """A frozen linear layer with int8 or int4 weights; `split_sizes` makes it return one
    view per fused projection (q/k/v, gate/up), like `FusedLinear`."""

    def __init__(self, stored: dict[str, torch.Tensor], in_features: int, out_features: int, scheme: QuantScheme,
                 bias: torch.Tensor | None = None, split_sizes: list[int] | None = None):
        super().__init__(split_sizes)
        self.scheme = scheme
        self.in_features, self.out_features = in_features, out_features
        for name, tensor in stored.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)
        self._kernel_weights: dict[tuple, tuple] = {}  # (dtype, device) -> packed tensors for the kernel
        self._dense: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> dequantised weight, for the dense path
        self.is_view = False  # rows of a fused layer (`rows`), kept for code that calls a member alone
        # Verification widths (models/wide_kernels.py): (the dequantised weight packed densely, the
        # rows from which it runs instead of the int kernel); a tuple, so it is not a submodule.
        self.wide: tuple[nn.Module, int] | None = None
        # Decode widths (models/inference.py attach_few_row_kernels): (the weight in the few-row kernel's
        # layout, fp32 scales [N] (int4: scales and offsets), fp32 bias [N] | None, the most rows it serves).
        self.few_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int] | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, scheme: QuantScheme,
                    split_sizes: list[int] | None = None) -> "QuantizedLinear":
        N, K = weight.shape
        return cls(quantize_weight(weight, scheme), K, N, scheme, None if bias is None else bias.detach().clone(),
                   split_sizes)

    # ---- the weight it stands for --------------------------------------------------------

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the exact weight every kernel multiplies by (w8a8 / w4a8: by the quantised activations)."""
        if self.scheme.bits == 8:
            return self.qweight.float() * self.scales[:, None]
        N, K, g = self.out_features, self.in_features, self.scheme.group_size
        q = self.unpacked_int4().float().view(N, K // g, g)
        return ((q - 8) * self.scales[..., None] + self.zeros[..., None]).view(N, K)

    def unpacked_int4(self) -> torch.Tensor:
        """[N, K] int32 values in [0, 15] (int4 only)."""
        N, K = self.out_features, self.in_features
        return torch.stack((self.qweight & 0xF, self.qweight >> 4), dim=-1).view(N, K).to(torch.int32)

    # ---- kernels -------------------------------------------------------------------------

    def _uses_kernel(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether PyTorch's weight-only int kernels serve `dtype` activations (w8a8 / w4a8 layers: never)."""
        if not self.scheme.weight_only:
            return False
        # The CPU int4 kernel packs output rows in blocks of 16; other layers take the dense path.
        shape_ok = self.scheme.bits == 8 or self.out_features % 16 == 0
        return shape_ok and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)

    def uses_dense_copy(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether, without its few-row kernel or a wide copy, the layer multiplies `dtype`
        activations by its dequantised weight (`F.linear`), not by PyTorch's int kernels (nor, w8a8 / w4a8,
        by quantised activations)."""
        return self.scheme.weight_only and not self._uses_kernel(dtype, device)

    def a8_arguments(self, device: torch.device) -> tuple | None:
        """What `gemm_a8_cpu.w8a8_linear` / `w4a8_linear` take after x (the kernel's weight layout, its
        scales (w4a8: and zeros), the padded fp32 bias, out features), built once; None where the
        kernels do not serve `device`."""
        key = ("a8", device)
        if key in self._kernel_weights:  # every call after the first: one dict lookup
            return self._kernel_weights[key]
        if not gemm_a8_cpu.available(device):
            return None
        bias = None if self.bias is None else gemm_a8_cpu.pad_outputs(self.bias)
        if self.scheme.bits == 8:
            weights = (gemm_a8_cpu.pack_w8(self.qweight), gemm_a8_cpu.pad_outputs(self.scales))
        else:
            weights = gemm_a8_cpu.pack_w4(self.unpacked_int4(), self.scales, self.zeros)
        self._kernel_weights[key] = (*weights, bias, self.out_features)
        return self._kernel_weights[key]

    def _a8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Quantised activations times int8 / int4 weights: the kernel (float32 / bf16 activations on a CPU
        with AVX-512 VNNI), else the same numbers from PyTorch ops."""
        arguments = self.a8_arguments(x.device) if x.dtype in (torch.float32, torch.bfloat16) else None
        if self.scheme.bits == 8:
            if arguments is not None:
                return gemm_a8_cpu.w8a8_linear(x, *arguments)
            return gemm_a8_cpu.reference_w8a8(x, self.qweight, self.scales, self.bias)
        if arguments is not None:
            return gemm_a8_cpu.w4a8_linear(x, *arguments)
        return gemm_a8_cpu.reference_w4a8(x, self.unpacked_int4(), self.scales, self.zeros, self.bias)

    def _kernel_tensors(self, dtype: torch.dtype) -> tuple:
        key = (dtype, self.qweight.device)
        if key not in self._kernel_weights:
            if self.scheme.bits == 8:
                self._kernel_weights[key] = (self.qweight, self.scales.to(dtype))
            else:  # tinygemm's layout: scales and zeros [K/g, N, 2]
                packed = torch._convert_weight_to_int4pack_for_cpu(self.unpacked_int4(), 1)
                scales_zeros = torch.stack((self.scales, self.zeros), dim=-1).transpose(0, 1).contiguous().to(dtype)
                self._kernel_weights[key] = (packed, scales_zeros)
        return self._kernel_weights[key]

    def prepare(self, dtype: torch.dtype) -> None:
        """Build what forward will use for `dtype` activations now, not on the first call (a
        compiled forward traced the lazy build and recompiled once it existed)."""
        if not self.scheme.weight_only:
            self.a8_arguments(self.qweight.device)
        elif self._uses_kernel(dtype, self.qweight.device):
            self._kernel_tensors(dtype)
        else:
            self.dense_weight(dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] `dequantize()` in `dtype`, built once: what the dense path multiplies by."""
        key = (dtype, self.qweight.device)
        if key not in self._dense:
            self._dense[key] = self.dequantize().to(dtype)
        return self._dense[key]

    def bias_as(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The bias in `dtype` (None without one): what the dense path and PyTorch's int kernels add."""
        return None if self.bias is None else self.bias.to(dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.scheme.weight_only:  # one kernel at every width: no few-row or wide choice
            return self._a8_matmul(x)
        compiling = torch.compiler.is_compiling()
        if self.wide is not None and not compiling and x.numel() >= self.wide[1] * self.in_features:
            return self.wide[0](x)  # a wide forward: the dense copy (bias included)
        # The few-row ops have no backward: a forward that needs x's gradient (a drafter trained
        # through the frozen target's head) takes the differentiable paths below.
        if self.few_rows is not None and (self.wide is None or not compiling) and not (
                x.requires_grad and torch.is_grad_enabled()):
            return self._few_rows_matmul(x)
        if not self.uses_dense_copy(x.dtype, x.device):
            qweight, scales = self._kernel_tensors(x.dtype)
            group = 0 if self.scheme.bits == 8 else self.scheme.group_size
            wide, wide_from = (self.wide[0].packed, self.wide[1]) if self.wide is not None else (None, 0)
            bias = self.bias_as(x.dtype)
            if compiling:  # one opaque op: the width choice is no shape guard of the graph
                return quantized_linear(x, qweight, scales, bias, self.out_features, group, wide, wide_from)
            return _quantized_matmul(x, qweight, scales, bias, self.out_features, group, wide, wide_from)
        return F.linear(x, self.dense_weight(x.dtype), self.bias_as(x.dtype))

    def _few_rows_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The few-row int8 / int4 kernel up to its measured width, then the dense copy (float32
        activations) or PyTorch's int kernel: one C++ op, eager and compiled alike."""
        op = gemv_int8_cpu.int8_linear if self.scheme.bits == 8 else gemv_int4_cpu.int4_linear
        return op(x, *self.few_rows_arguments(x.dtype, x.device))

    def few_rows_arguments(self, dtype: torch.dtype, device: torch.device) -> tuple:
        """What `int8_linear` / `int4_linear` take after x for `dtype` activations (the few-row kernel
        attached): the kernel's weight layout, fp32 scales (int4: and offsets) and bias, out features
        (int4: and the group size), its width, then the wider rows' weights."""
        if self.uses_dense_copy(dtype, device):
            dense, qweight, qscales = self.dense_weight(dtype), None, None
        else:
            dense, (qweight, qscales) = None, self._kernel_tensors(dtype)
        few, few_scales, few_bias, few_upto = self.few_rows
        group = () if self.scheme.bits == 8 else (self.scheme.group_size,)
        return (few, few_scales, few_bias, self.out_features, *group, few_upto, dense, qweight, qscales,
                self.bias_as(dtype))

    def rows(self, start: int, stop: int) -> "QuantizedLinear":
        """Output rows [start, stop) as a layer of their own, sharing this one's storage."""
        stored = {name: getattr(self, name)[start:stop] for name in ("qweight", "scales", "zeros") if hasattr(self, name)}
        bias = None if self.bias is None else self.bias[start:stop]
        rows = QuantizedLinear(stored, self.in_features, stop - start, self.scheme, bias)
        rows.is_view = True  # `prepare` leaves it lazy: an int4 kernel layout of its own would be a copy
        return rows

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.scheme.name}"


def _quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                      out_features: int, group_size: int, wide: torch.Tensor | None, wide_from: int) -> torch.Tensor:
    """x [..., K] -> [..., N] through PyTorch's int kernels (group_size 0: int8; else int4 in tinygemm's
    layout, `scales` its scales and zeros); from `wide_from` rows on, the dense packed copy `wide`."""
    if wide is not None and x.numel() >= wide_from * x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, wide, bias, "none", [], "")
    rows = x.reshape(-1, x.shape[-1])  # the kernels take 2-D rows
    if group_size == 0:
        out = torch._weight_int8pack_mm(rows, qweight, scales)
    else:
        out = torch._weight_int4pack_mm_for_cpu(rows, qweight, group_size, scales)
    out = out.view(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


# The quantised matmul as an opaque custom op for compiled forwards: the dense copy's width
# threshold, checked inside, would otherwise be a shape guard, and each range of widths a graph
# of its own, compiled the first time a step of that width ran (measured: inside timed rounds).
@torch.library.custom_op("specdecode::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int, group_size: int, wide: torch.Tensor | None, wide_from: int) -> torch.Tensor:
    return _quantized_matmul(x, qweight, scales, bias, out_features, group_size, wide, wide_from)


@quantized_linear.register_fake
def _quantized_linear_shape(x, qweight, scales, bias, out_features, group_size, wide, wide_from):
    return x.new_empty(*x.shape[:-1], out_features)


def quantize_module(module: nn.Module, scheme: QuantScheme | None, cache: "QuantCache | None" = None) -> nn.Module:
    """Replace every linear layer under `module` by a QuantizedLinear (in place; returns it).

    A fused projection becomes one fused quantised layer and its member layers (`q_proj`, ...)
    views of its rows, so the dense weights are freed. `cache` supplies already-quantised
    tensors by layer name, and records new ones."""
    if scheme is None:
        return module
    from specdecode.models.llama import replace_linears

    def quantized(name: str, weight: torch.Tensor, bias, split_sizes=None) -> QuantizedLinear:
        stored = cache.get(name) if cache is not None else None
        if stored is None:
            stored = quantize_weight(weight, scheme)
            if cache is not None:
                cache.put(name, stored)
        else:  # copied: safetensors' buffers are not 64-byte aligned, and the int8 kernel crashes on them
            stored = {k: v.to(weight.device, copy=True) for k, v in stored.items()}
        N, K = weight.shape
        return QuantizedLinear(stored, K, N, scheme, None if bias is None else bias.detach().clone(), split_sizes)

    def fits(weight: torch.Tensor) -> bool:
        # An input width that is no multiple of the int4 group (DSpark's rank-16 Markov head) keeps
        # that layer in the model's dtype; it is small by construction.
        return scheme.fits(weight.shape[1])

    def fused_layer(name: str, fused):
        if not fits(fused.weight):
            return fused, []  # kept, and its members as they are
        layer = quantized(name, fused.weight, fused.bias, list(fused.sizes))
        starts = [sum(fused.sizes[:i]) for i in range(len(fused.sizes))]
        return layer, [layer.rows(start, start + size) for start, size in zip(starts, fused.sizes)]

    def linear_layer(name: str, linear: nn.Linear):
        return quantized(name, linear.weight, linear.bias) if fits(linear.weight) else linear

    return replace_linears(module, fused_layer, linear_layer)


class QuantCache:
    """Quantised tensors on disk, keyed by the checkpoint's content hash, the scheme and the
    dtype of the weights quantised: a restart loads them instead of quantising again (safetensors,
    one file per model)."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, torch.Tensor] = {}
        self.dirty = False
        if path.is_file():
            from safetensors.torch import load_file

            try:
                self.tensors = load_file(str(path))
            except Exception as e:  # a truncated or foreign file is re-made, not trusted
                log.warning("ignoring the unreadable quantisation cache %s (%s)", path, e)

    @classmethod
    def for_checkpoint(cls, model_dir: Path, scheme: QuantScheme, dtype: torch.dtype) -> "QuantCache":
        """`dtype`: the weights' as quantised (the served dtype's rounding of the checkpoint). A float32
        checkpoint quantises to other tensors from its float32 weights than from their bf16 rounding:
        without it in the key, a model's quantised tensors depended on which dtype loaded it first
        (a float32 w4a8 load after a bf16 one took the bf16 rounding's tensors, logits 12% away)."""
        from specdecode.defaults import cache_root

        name = f"{checkpoint_hash(model_dir)}-{scheme.name}-{str(dtype).removeprefix('torch.')}.safetensors"
        return cls(cache_root() / "quantized" / name)

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        prefix = name + "/"
        found = {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        return found or None

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        for k, v in tensors.items():
            self.tensors[f"{name}/{k}"] = v.detach().cpu().contiguous()
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        from safetensors.torch import save_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        save_file(self.tensors, str(tmp))
        tmp.replace(self.path)  # atomic: a crash mid-write leaves no half file under the real name
        self.dirty = False


# ---- checkpoints that store their linear layers quantised ----------------------------------------
# A drafter trained quantisation-aware for one scheme is served with `quantize_weight(bf16(w))` of
# each linear layer; its checkpoint can hold exactly those tensors instead of w (int4-g32: 0.625
# bytes a weight instead of 2). config.json's specdecode.stored_quantization names the scheme;
# layer P is stored as P.qweight (int8 / packed uint8), P.scales and, for int4, P.zeros (bf16: they
# are bf16 values). Served at that scheme the layers are these tensors, bit for bit; anything else
# (another scheme, no quantisation, training) sees the dense weights they dequantise to.

_STORED_PARTS = ("qweight", "scales", "zeros")


def store_quantized_state(state: dict[str, torch.Tensor], linear_names: list[str],
                          scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """`state` with each named linear layer's weight (P.weight) replaced by its stored quantised form."""
    out = dict(state)
    for name in linear_names:
        weight = out.pop(f"{name}.weight", None)
        if weight is None:
            continue
        for part, tensor in quantize_weight(weight.detach().to(torch.bfloat16).float(), scheme).items():
            out[f"{name}.{part}"] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return out


def stored_quantized_layers(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{P: {qweight, scales[, zeros]}} of every layer a checkpoint stores quantised (float32 scales)."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name, _, part = key.rpartition(".")
        if part in _STORED_PARTS and f"{name}.qweight" in state:
            layers.setdefault(name, {})[part] = tensor.float() if tensor.is_floating_point() else tensor
    return layers


def dequantize_stored_state(state: dict[str, torch.Tensor], scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every stored quantised layer as its dense float32 weight
    (P.weight: exactly what the int kernels multiply by)."""
    layers = stored_quantized_layers(state)
    out = {k: v for k, v in state.items() if k.rpartition(".")[0] not in layers}
    for name, stored in layers.items():
        N = stored["qweight"].shape[0]
        K = stored["qweight"].shape[1] * (2 if scheme.bits == 4 else 1)
        out[f"{name}.weight"] = QuantizedLinear(stored, K, N, scheme).dequantize()
    return out


class StoredQuantized:
    """quantize_module's `cache` for a checkpoint that stores its layers quantised: a fused layer
    (q/k/v, gate/up) is its members' stored rows, concatenated (quantisation is per output row)."""

    def __init__(self, layers: dict[str, dict[str, torch.Tensor]]):
        self.layers = layers

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        from specdecode.models.llama import FUSED_MEMBERS

        if name in self.layers:
            return self.layers[name]
        owner, _, fused = name.rpartition(".")
        members = [f"{owner}.{m}" if owner else m for m in FUSED_MEMBERS.get(fused, ())]
        if not members or not all(m in self.layers for m in members):
            return None
        return {part: torch.cat([self.layers[m][part] for m in members]) for part in self.layers[members[0]]}

    def put(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """A layer the checkpoint keeps dense is quantised at load; nothing to record."""

    def save(self) -> None:
        pass


def stored_scheme(model_dir: Path | None) -> QuantScheme | None:
    """The scheme a checkpoint stores its linear layers in (config.json specdecode.stored_quantization)."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    import json

    try:
        spec = json.loads((Path(model_dir) / "config.json").read_text()).get("specdecode", {}).get("stored_quantization")
    except (OSError, ValueError, AttributeError):
        return None
    return QuantScheme.parse(spec) if spec else None


def checkpoint_hash(model_dir: Path) -> str:
    """sha256 of the checkpoint's config and weight files (content, not paths or mtimes)."""
    digest = hashlib.sha256()
    files = sorted(Path(model_dir).glob("*.safetensors")) + [Path(model_dir) / "config.json"]
    for f in files:
        if f.is_file():
            digest.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:20]


def quantize_checkpoint_model(module: nn.Module, model_dir: Path | None, scheme: QuantScheme | None,
                              dtype: torch.dtype) -> nn.Module:
    """quantize_module with the on-disk cache of `model_dir`'s checkpoint (None: no cache); `dtype`:
    the module's weights' (they are quantised as loaded)."""
    if scheme is None:
        return module
    if stored_scheme(model_dir) == scheme:  # the checkpoint holds these very tensors: nothing to quantise
        from safetensors.torch import load_file

        quantize_module(module, scheme, StoredQuantized(stored_quantized_layers(
            load_file(str(Path(model_dir) / "model.safetensors")))))
        return module
    cache = QuantCache.for_checkpoint(model_dir, scheme, dtype) if model_dir is not None else None
    quantize_module(module, scheme, cache)
    if cache is not None:
        try:
            cache.save()
        except OSError as e:  # a read-only cache directory costs a re-quantisation next time, nothing else
            log.warning("could not write the quantisation cache %s: %s", cache.path, e)
    return module
