"""A frozen model made ready to serve: projections fused, weights quantised or packed.

`prepare_for_inference` is the one step every served model goes through (the target in
`load_model`, and every drafter after its own loader): fuse q/k/v and gate/up, then either
quantise every linear layer (`models/quant.py`, cached by checkpoint hash), or, for bf16 /
fp16 weights on a CPU, keep them dense in oneDNN's blocked layout (`PackedLinear`), and, for
bf16 on a CPU with AVX-512 BF16, also in the few-row kernel's layout for the decode and verify
widths where it measures faster (`kernels/gemv_cpu.py`), or, for float32 layers whose weights are
bf16 values (a bf16 checkpoint served in float32) on a CPU with AVX-512, keep those weights as
bf16 for a float32 kernel that widens them as it reads (`Bf16WeightLinear`, `kernels/gemv_bf16w_cpu.py`).

Why packing: a one-row bf16 matmul reads its weight in PyTorch's plain layout at a fraction of
the memory bandwidth. Measured here (2 threads, all 25 matmuls of the default model in turn,
so weights come from memory as in a real forward): 3.9 ms plain against 2.0-2.3 ms packed at
one row, 4.0 against 2.8 ms at eight rows; the results are bit-identical (same oneDNN kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specdecode.kernels import build, gemv_bf16w_cpu, gemv_cpu, gemv_int4_cpu, gemv_int8_cpu
from specdecode.models.quant import QuantizedLinear, QuantScheme, quantize_checkpoint_model
from specdecode.models.served_linear import ServedLinear
from specdecode.models.weight_layout import lay_out_in_forward_order

log = logging.getLogger(__name__)

PACK_BATCH_HINT = 8  # oneDNN picks its layout for this many rows; measured best over 1-16 rows here


# The packed matmul as an opaque custom op: inductor (torch.compile) cannot lower the mkldnn op
# itself, so a compiled forward calls it as an external kernel between its fused parts.
@torch.library.custom_op("specdecode::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can pack (and run) a dense layer of this dtype here. Its bf16/fp16 paths need
    AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU such as AMD EPYC Zen 3, packing a bf16 weight
    raises, so those layers stay plain `nn.Linear`s."""
    if not (torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return _mkldnn_supports(dtype)


@functools.cache
def _mkldnn_supports(dtype: torch.dtype) -> bool:
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(ServedLinear):
    """A frozen dense linear layer with its weight pre-packed for oneDNN (CPU, bf16/fp16).
    `split_sizes` makes it return one view per fused projection, like `FusedLinear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, split_sizes: list[int] | None = None):
        super().__init__(split_sizes)
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()
        # Decode and verify widths (attach_few_row_kernels below): (the weight in the few-row
        # kernel's blocked layout, the most rows it serves); eager forwards that narrow take it.
        self.few_rows: tuple[torch.Tensor, int] | None = None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Compiled forwards keep oneDNN: with the few-row kernel in their 1-token graph, compiled
            # plain decoding ran faster but n-gram speculation in `specdecode bench` ran 1.02x plain
            # instead of 1.7-1.8x; not understood yet, so the kernel serves eager forwards only.
            return packed_linear(x, self.packed, self.bias, self.out_features)  # eager skips the op's dispatch (+50 us)
        if self.few_rows is not None and x.numel() <= self.few_rows[-1] * self.in_features:
            rows = x.reshape(-1, self.in_features)  # the kernel takes 2-D rows
            out = gemv_cpu.few_rows_linear(rows, self.few_rows[0], self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """[N, K] the dense weight, recovered exactly: identity rows through the packed matmul
        (each output is one weight times 1 plus zeros, so nothing rounds)."""
        eye = torch.eye(self.in_features, dtype=self.dtype, device=self.packed.device)
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").t().contiguous()

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.dtype} packed"


class Bf16WeightLinear(ServedLinear):
    """A frozen linear layer whose weights are bf16 values, served with float32 activations: the weights
    kept as bf16 (half of float32's bytes) in the few-row bf16 kernel's blocked layout, each product and
    sum in float32 (kernels/gemv_bf16w_cpu.cpp, at every width). For bf16 checkpoints served in float32
    on CPUs without bf16 arithmetic. `split_sizes` makes it return one view per fused projection."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, split_sizes: list[int] | None = None):
        super().__init__(split_sizes)
        self.out_features, self.in_features = weight.shape
        self.blocked = gemv_bf16w_cpu.block_weight(weight.detach())  # [ceil(N / 64), K / 2, 64, 2] bf16
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # the kernel takes 2-D rows
        return gemv_bf16w_cpu.linear(rows, self.blocked, self.bias, self.out_features).view(*x.shape[:-1], -1)

    def dense_weight(self) -> torch.Tensor:
        """[N, K] float32, the weight (exactly: bf16 values)."""
        groups, half_k, group, pair = self.blocked.shape
        dense = self.blocked.transpose(1, 2).reshape(groups * group, half_k * pair)
        return dense[: self.out_features].float()

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bf16 weights, float32 activations"


def holds_bf16_values(module: nn.Module) -> bool:
    """Whether every linear layer under `module` has float32 weights that are all bf16 values (a bf16
    checkpoint served in float32; fused projections' members are views of their weights)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and all(m.weight.dtype == torch.float32 and torch.equal(m.weight, m.weight.bfloat16().float())
                                 for m in linears)


class FusedMember(nn.Module):
    """One projection of a packed fused layer (`q_proj` of `qkv`, ...), for code that calls it
    alone: it runs the fused matmul and returns its part, so the dense weights can be freed."""

    def __init__(self, fused: "PackedLinear | Bf16WeightLinear", index: int):
        super().__init__()
        self._fused = [fused]  # a list: not registered a second time as a submodule
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0](x)[self.index]


def swap_linears(module: nn.Module, layer_class: type[PackedLinear | Bf16WeightLinear]) -> nn.Module:
    """Replace every dense linear layer (and fused projection) under `module` by a `layer_class` made from
    its weight and bias (PackedLinear: oneDNN's packed layout; Bf16WeightLinear: its weights being bf16
    values, `holds_bf16_values`)."""
    from specdecode.models.llama import replace_linears

    def fused_layer(name: str, fused) -> tuple[nn.Module, list[FusedMember]]:
        layer = layer_class(fused.weight, fused.bias, list(fused.sizes))
        return layer, [FusedMember(layer, index) for index in range(len(fused.sizes))]

    return replace_linears(module, fused_layer, lambda name, linear: layer_class(linear.weight, linear.bias))


# Widths the few-row kernels are probed at. The bf16 kernel (broadcast form) read the default model's 25
# layers in turn in 1.37-1.49 ms at 1-4 rows and 1.71 / 2.55 ms at 8 / 16, against oneDNN's 2.23-2.40 /
# 2.68 / 3.27 on a 2-core AVX-512 BF16 EPYC (benchmarks/few_row_kernel.py), so verification widths are
# probed too. The int8 kernel beat
# `_weight_int8pack_mm` at every width up to 16 rows over the default model's 25 layers in turn on
# AVX2-only AMD EPYCs (Zen 3: 1.84 / 2.86 / 3.51 ms at 1 / 2 / 4 rows against 3.13 / 4.00 / 5.07;
# Zen 4: 0.68 / 1.34 / 1.88 / 3.89 / 7.29 ms at 1 / 2 / 4 / 8 / 16 rows against 1.07 / 1.63 / 2.33 /
# 4.19 / 8.21). The int kernels are probed to 64 rows (batches of verifications): on a 2-core Ice Lake Xeon
# with float32 activations, past 16 rows the layers took the dense float32 copy, 16.5-18.1 ms for the 25
# layers at 16-32 rows where the int4 kernel took 3.8-6.9 (64 rows: level or faster) and the int8 one
# 3.5-6.5 (BENCHMARKS.md "forty-fifth pass"); the probe keeps whichever wins at each width.
FEW_ROWS_PROBE = {"bf16": (1, 2, 4, 8, 16), "int8": (1, 2, 4, 8, 16, 32, 64), "int4": (1, 2, 4, 8, 16, 32, 64)}


@dataclasses.dataclass(frozen=True, slots=True)
class _FewRowKind:
    """How one few-row kernel serves one kind of layer (`layer.few_rows` holds what it needs)."""

    name: str
    source: Path  # the kernel's C++ source (its digest keys the cached width choices)
    serves: Callable[[nn.Module, torch.dtype], bool]  # layers of this kind it can serve at dtype
    prepare: Callable[[nn.Module, torch.dtype], tuple]  # layer, activations' dtype -> its kernel tensors (all but the width)
    call: Callable[[torch.Tensor, tuple, nn.Module], torch.Tensor]  # x [M, K] rows, those tensors, layer -> y


def _bf16_few_rows(x: torch.Tensor, tensors: tuple, layer: "PackedLinear") -> torch.Tensor:
    return gemv_cpu.few_rows_linear(x, tensors[0], layer.bias, layer.out_features)


def _int8_few_rows(x: torch.Tensor, tensors: tuple, layer: QuantizedLinear) -> torch.Tensor:
    return gemv_int8_cpu.few_rows_linear(x, *tensors, layer.out_features)


def _int4_few_rows(x: torch.Tensor, tensors: tuple, layer: QuantizedLinear) -> torch.Tensor:
    return gemv_int4_cpu.few_rows_linear(x, *tensors, layer.out_features, layer.scheme.group_size)


def _int4_tensors(layer: QuantizedLinear, dtype: torch.dtype) -> tuple:
    # bf16 activations on an AVX-512 BF16 CPU: the kernel's pair layout (vdpbf16ps, bf16 scales and zeros:
    # bf16 values wherever quantize_weight made them), else its lane layout (AVX-512) or its AVX2 one.
    bf16_values = all(torch.equal(t, t.bfloat16().to(t.dtype)) for t in (layer.scales, layer.zeros))
    pack = gemv_int4_cpu.packer(dtype, layer.scheme.group_size, bf16_values)
    packed, scale_offsets = pack(layer.unpacked_int4(), layer.scales, layer.zeros)
    return packed, scale_offsets, None if layer.bias is None else layer.bias.float().contiguous()


FEW_ROW_KINDS = (
    _FewRowKind("bf16", gemv_cpu.SOURCE, lambda m, dtype: (isinstance(m, PackedLinear) and m.dtype == dtype
                                          and gemv_cpu.fits(m.in_features, dtype, m.packed.device)),
                lambda m, dtype: (gemv_cpu.block_weight(m.dense_weight()),), _bf16_few_rows),
    # bf16/fp16 activations (against PyTorch's int kernel) and float32 ones (against the dense copy).
    _FewRowKind("int8", gemv_int8_cpu.SOURCE, lambda m, dtype: (isinstance(m, QuantizedLinear) and m.scheme.bits == 8 and m.scheme.weight_only and not m.is_view
                                          and dtype in (torch.bfloat16, torch.float16, torch.float32)
                                          and gemv_int8_cpu.fits(m.in_features, m.qweight.device)),
                lambda m, dtype: (gemv_int8_cpu.block_weight(m.qweight), m.scales.float().contiguous(),
                           None if m.bias is None else m.bias.float().contiguous()), _int8_few_rows),
    # int4 layers: against PyTorch's int4 kernel (bf16/fp16) or the dense copy (float32).
    _FewRowKind("int4", gemv_int4_cpu.SOURCE, lambda m, dtype: (
        isinstance(m, QuantizedLinear) and m.scheme.bits == 4 and m.scheme.weight_only and not m.is_view
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
        and gemv_int4_cpu.fits(m.in_features, m.scheme.group_size, m.qweight.device)),
        _int4_tensors, _int4_few_rows),
)


def attach_few_row_kernels(module: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Give every packed bf16 layer and int8 layer under `module` whose shape measures faster under
    its few-row kernel that kernel's tensors and the most rows it serves (`layer.few_rows`). Returns
    {"KxN": few_rows} for the shapes that got one."""
    from specdecode.models.kernel_probe import faster_by_width, load_choices, save_choices

    cached, measured, chosen = load_choices(), False, {}
    for kind in FEW_ROW_KINDS:
        widths = FEW_ROWS_PROBE[kind.name]
        by_shape: dict[str, list[nn.Module]] = {}
        for layer in module.modules():
            if getattr(layer, "few_rows", 0) is None and kind.serves(layer, dtype):
                # The kernel's build and the probed widths are part of the key: a choice made for
                # another build or over other widths is not this one.
                key = (f"{layer.in_features}x{layer.out_features}-{kind.name}-{build.source_digest(kind.source)}"
                       f"-few-rows{max(widths)}-{dtype}")
                by_shape.setdefault(key, []).append(layer)
        for key, group in by_shape.items():
            if key in cached and cached[key] is None:
                continue
            tensors = [kind.prepare(layer, dtype) for layer in group]
            if key not in cached:
                candidate = [functools.partial(kind.call, tensors=t, layer=layer) for t, layer in zip(tensors, group)]
                faster = faster_by_width(candidate, [layer._matmul for layer in group], group[0].in_features, dtype,
                                          widths)
                few = 0  # the widest width it wins before a width it loses (a tie goes on)
                for rows, wins in zip(widths, faster):
                    if wins is False:
                        break
                    if wins:
                        few = rows
                cached[key], measured = few or None, True
            if cached[key] is None:
                continue
            for layer, t in zip(group, tensors):
                layer.few_rows = (*t, cached[key])
            chosen[key.split("-")[0]] = cached[key]
    if measured:
        save_choices(cached)
        if chosen:
            log.info("layers take a few-row kernel up to these widths (rows): %s", chosen)
    return chosen


def detach_few_row_kernels(module: nn.Module) -> None:
    """Back to one kernel at every width (exact mode: its row tilings are probed on that kernel)."""
    for layer in module.modules():
        if isinstance(layer, (PackedLinear, QuantizedLinear)):
            layer.few_rows = None


def select_output_rows(layer: nn.Module, index: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """The output rows `index` [n] of a served linear layer (dense, packed or quantised) as a layer
    of their own, served the same way: quantised rows keep their stored values, packed ones are
    packed again."""
    bias = None if layer.bias is None else layer.bias[index].clone()
    if isinstance(layer, QuantizedLinear):
        stored = {name: getattr(layer, name).index_select(0, index).contiguous()
                  for name in ("qweight", "scales", "zeros") if hasattr(layer, name)}
        rows = QuantizedLinear(stored, layer.in_features, len(index), layer.scheme, bias)
        rows.prepare(dtype)
        if layer.few_rows is not None:  # served the same way: a few-row kernel only where the layer had one
            attach_few_row_kernels(rows, dtype)
        return rows
    if isinstance(layer, PackedLinear):
        rows = PackedLinear(layer.dense_weight()[index], bias)
        if layer.few_rows is not None:
            attach_few_row_kernels(rows, dtype)
        return rows
    if isinstance(layer, Bf16WeightLinear):
        return Bf16WeightLinear(layer.dense_weight()[index], bias)
    rows = nn.Linear(layer.in_features, len(index), bias=bias is not None, device=layer.weight.device,
                     dtype=layer.weight.dtype).requires_grad_(False)
    rows.weight.copy_(layer.weight[index])
    if bias is not None:
        rows.bias.copy_(bias)
    return rows


def prepare_for_inference(module: nn.Module, checkpoint_dir: Path | None, dtype: torch.dtype, device,
                          quantization: QuantScheme | None = None) -> nn.Module:
    """Fuse, then quantise (`quantization` set) or pack (bf16/fp16 on CPU); float32 keeps bf16 weights
    where they are bf16 values and the kernel serves (a CPU with AVX-512), else stays as is.
    `checkpoint_dir` keys the quantisation cache (None: quantise without caching)."""
    from specdecode.models.llama import fuse_projections

    module = fuse_projections(module.eval().requires_grad_(False))
    if quantization is not None:
        quantize_checkpoint_model(module, checkpoint_dir, quantization, dtype)
        for layer in module.modules():
            if isinstance(layer, QuantizedLinear) and not layer.is_view:
                layer.prepare(dtype)
        attach_few_row_kernels(module, dtype)
        lay_out_in_forward_order(module)
        return module
    if can_pack(dtype, device):
        module = swap_linears(module, PackedLinear)
        attach_few_row_kernels(module, dtype)
        lay_out_in_forward_order(module)
    elif dtype == torch.float32 and gemv_bf16w_cpu.available(device) and holds_bf16_values(module):
        module = swap_linears(module, Bf16WeightLinear)
        lay_out_in_forward_order(module)
    return module
