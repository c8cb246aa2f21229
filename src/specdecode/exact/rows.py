"""Row-invariant linear layers: a token's output row must not depend on how many rows share the call.

Matmul kernels choose their blocking by the number of rows M, so a row computed alone can
differ in its last bits from the same row computed among others. Measured on this project's
CPUs: int8 and int4 kernels give identical rows for every M up to 64; packed bf16 layers
(oneDNN) do for K <= 1024 inputs, but for the default model's 1408 -> 512 down projection a
row computed alone (M = 1, a matrix-vector kernel) differs from the same row in any call of
M >= 2, and every M >= 2 agrees; float32 `F.linear` behaves the same way at every shape.

So exact mode does not trust a kernel: at load, `make_rows_invariant` probes each kind of layer
and gives it the first `RowTiling` (models/llama.py) under which every call of M <= `MAX_TILE`
rows gives each row exactly as the row computed alone under the same tiling:
1. chunks of `MAX_TILE` rows, calls of fewer than m rows padded with zero rows to m, for m in
   `MIN_ROWS` (m = 1: no padding; the down projection and float32 layers: m = 2, so a decode
   costs a two-row call, about what one row costs);
2. else calls of exactly P rows for P in `FIXED_TILES` (a kernel whose rows agree only at one size);
3. else one row per call (always exact).
Probes use random rows and `probe_inputs`, whose cancelling +-2^30 pairs make any change of
summation order visible after bf16 rounding (random rows alone flip a bf16 output once in ~10^4
values and missed the down projection).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.llama import RowTiling, tile_rows

MAX_TILE = 64  # calls are probed up to this many rows; longer ones (prefills) run in chunks of it
MIN_ROWS = (1, 2, 4, 8, 16)  # smallest call sizes tried, in order
FIXED_TILES = (8, 16, 4, 2)  # then fixed call sizes (a decode pays P rows, a verify of k + 1 tokens ceil((k + 1) / P) calls)


def probe_inputs(in_features: int, out_features: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 x [rows, K] and weight [N, K] (+-1) on which a different summation order shows even
    after rounding to bf16: pairs of +-2^30 terms that cancel exactly, spread over K, between ordinary
    terms. Whatever the kernel sums while a spike is in its accumulator loses its low bits, so two
    orders give results far apart."""
    generator = torch.Generator().manual_seed(0)
    K, N = in_features, out_features
    x = torch.randn(rows, K, generator=generator)
    weight = torch.randint(0, 2, (N, K), generator=generator).float() * 2 - 1  # +-1: exact in every format
    for a in sorted({0, K // 3, K // 2, K - 2} | set(torch.randint(0, K - 1, (4,), generator=generator).tolist())):
        b = (a + 1 + int(torch.randint(0, K - 1, (1,), generator=generator))) % K
        if a == b:
            continue
        x[:, a], x[:, b] = 2.0 ** 30, -(2.0 ** 30)
        weight[:, b] = weight[:, a]  # equal columns (equal after quantisation too): the pair cancels in every output
    return x, weight


def _invariant(fn, x: torch.Tensor, tiling: RowTiling, max_rows: int) -> int:
    """The largest M0 <= max_rows such that every call of M <= M0 rows gives each row as computed alone,
    calls made through `tiling`."""
    def call(rows: torch.Tensor) -> torch.Tensor:
        return tile_rows(fn, rows, tiling)

    alone = torch.cat([call(x[j:j + 1]) for j in range(max_rows)])
    for M in range(2, max_rows + 1):
        if not torch.equal(call(x[:M]), alone[:M]):
            return M - 1
    return max_rows


def probe_row_tiling(layer, in_features: int, out_features: int, dtype: torch.dtype, device) -> RowTiling:
    """The `RowTiling` under which `layer`'s rows are invariant (see the module docstring), probed on
    the layer itself with random rows and on a layer of the same kind with `probe_inputs`."""
    x_adv, weight = probe_inputs(in_features, out_features, MAX_TILE)
    x_random = torch.randn(MAX_TILE, in_features, generator=torch.Generator().manual_seed(1))
    probes = [(_rows_of(layer), x_random.to(dtype=dtype, device=device))]
    same_kind = _same_kind(layer, weight, dtype)
    if same_kind is not None:  # a kind of layer this module cannot rebuild: probed on random rows only
        probes.append((same_kind, x_adv.to(dtype=dtype, device=device)))

    candidates = ([RowTiling(MAX_TILE, m) for m in MIN_ROWS] + [RowTiling(p, p) for p in FIXED_TILES])
    for tiling in candidates:
        if all(_invariant(fn, x, tiling, min(tiling.tile, MAX_TILE)) == min(tiling.tile, MAX_TILE) for fn, x in probes):
            return tiling
    return RowTiling(1)


def _rows_of(layer):
    """x [M, K] -> [M, N] through the layer (fused projections' views concatenated)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        return torch.cat(out, dim=-1) if isinstance(out, (tuple, list)) else out
    return fn


def _same_kind(layer, weight: torch.Tensor, dtype: torch.dtype):
    """A layer that runs the same kernel as `layer` (same class, shape, scheme, dtype) with `weight`."""
    from specdecode.models.inference import Bf16WeightLinear, PackedLinear
    from specdecode.models.llama import FusedLinear
    from specdecode.models.quant import QuantizedLinear

    if isinstance(layer, PackedLinear):
        return _rows_of(PackedLinear(weight.to(layer.dtype), None))
    if isinstance(layer, Bf16WeightLinear):
        return _rows_of(Bf16WeightLinear(weight, None))  # +-1: bf16 values
    if isinstance(layer, QuantizedLinear):
        quantized = QuantizedLinear.from_weight(weight, None, layer.scheme)
        quantized.prepare(dtype)
        return _rows_of(quantized)
    if isinstance(layer, (nn.Linear, FusedLinear)):
        return lambda x: torch.nn.functional.linear(x, weight.to(device=x.device, dtype=x.dtype))
    return None


class RowTiled(nn.Module):
    """A dense `nn.Linear` or fused projection called under a `RowTiling`. (Packed, bf16-weight and
    quantised layers take it as their `row_tiling` attribute instead: no extra module call per forward.)"""

    def __init__(self, layer, tiling: RowTiling):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias  # the layer's own tensors (same state_dict names)
        self.sizes = getattr(layer, "sizes", None)  # FusedLinear: one output view per member
        self.tiling = tiling
        self.out_features, self.in_features = layer.weight.shape

    def forward(self, x: torch.Tensor):
        def matmul(rows: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(rows, self.weight, self.bias)

        out = tile_rows(matmul, x, self.tiling) if self.tiling.applies(x) else matmul(x)
        return out if self.sizes is None else out.split(self.sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{self.tiling}"


def _features(layer) -> tuple[int, int]:
    """(in, out) features of a linear layer or fused projection."""
    if hasattr(layer, "in_features"):
        return layer.in_features, layer.out_features
    return layer.weight.shape[1], layer.weight.shape[0]  # FusedLinear


def make_rows_invariant(model: nn.Module, dtype: torch.dtype, device) -> dict[str, RowTiling]:
    """Give every linear layer and fused projection under `model` the `RowTiling` its probe found
    (in place; dense layers are wrapped in a `RowTiled`). Returns {module path: tiling} of the
    layers that needed more than chunking (padded, fixed-size or single-row calls). Probes are shared by
    layers of the same kind and shape."""
    from specdecode.models.inference import Bf16WeightLinear, FusedMember, PackedLinear
    from specdecode.models.llama import FUSED_MEMBERS, FusedLinear
    from specdecode.models.quant import QuantizedLinear
    from specdecode.models.inference import detach_few_row_kernels

    detach_few_row_kernels(model)  # one kernel at every width: the tilings are probed on oneDNN's
    layer_types = (nn.Linear, PackedLinear, Bf16WeightLinear, QuantizedLinear)
    tilings: dict[tuple, RowTiling] = {}
    special: dict[str, RowTiling] = {}
    for owner_name, owner in list(model.named_modules()):
        if isinstance(owner, (RowTiled, FusedMember)):
            continue
        prefix = f"{owner_name}." if owner_name else ""
        candidates = [(name, getattr(owner, name, None)) for name in FUSED_MEMBERS]
        candidates += [(name, child) for name, child in owner.named_children() if isinstance(child, layer_types)]
        for name, layer in candidates:
            if not isinstance(layer, layer_types + (FusedLinear,)):
                continue
            K, N = _features(layer)
            key = (type(layer).__name__, K, N, getattr(getattr(layer, "scheme", None), "name", None))
            if key not in tilings:
                with torch.inference_mode():
                    tilings[key] = probe_row_tiling(layer, K, N, dtype, device)
            tiling = tilings[key]
            if isinstance(layer, (PackedLinear, Bf16WeightLinear, QuantizedLinear)):
                layer.row_tiling = tiling
            else:
                setattr(owner, name, RowTiled(layer, tiling))
            if tiling != RowTiling(MAX_TILE):
                special[prefix + name] = tiling
    return special
