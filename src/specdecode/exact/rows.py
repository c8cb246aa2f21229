"""Row-invariant linear layers: a token's output row must not depend on how many rows share the call.

Matmul kernels choose their blocking by the number of rows M, so a row computed alone can
differ in its last bits from the same row computed among others. Measured on this project's
CPUs (bf16, oneDNN packed weights): every layer of the default model gives identical rows for
M = 1..64 except the 1408 -> 512 down projection, whose rows 8.. differ once M > 8; float32
`F.linear` differs between M = 1 and every M > 1; the int8 and int4 kernels are invariant.

So exact mode does not trust a kernel: at load, `make_rows_invariant` probes each kind of layer
(every M up to `MAX_TILE`, every row position against the row alone, on random rows and on
`probe_inputs`, which make any change of summation order visible in bf16) and records the
largest row count T for which every call is invariant. A call with more rows is cut into chunks
of T, each a call the probe checked. T = 1 (every row alone) is always exact. The bf16 packed
layers with more than 1024 inputs failed even at M = 2 (oneDNN blocks K differently by M), so in
exact mode they are packed as chunks of at most 1024 inputs (`EXACT_PACKED_K`, models/inference.py),
which the probe then finds invariant.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.llama import tile_rows

MAX_TILE = 64  # rows probed; calls with more rows run in chunks of at most this many


def probe_inputs(in_features: int, out_features: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 x [rows, K] and weight [N, K] (+-1) on which a different summation order shows even
    after rounding to bf16: pairs of +-2^30 terms that cancel exactly, spread over K, between ordinary
    terms. Whatever the kernel sums while a spike is in its accumulator loses its low bits, so two
    orders give results far apart (random data alone changes a bf16 output once in ~10^4)."""
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


def probe_row_tile(layer, in_features: int, out_features: int, dtype: torch.dtype, device,
                   max_tile: int = MAX_TILE) -> int:
    """The largest T <= max_tile such that f(x[:M])[j] == f(x[j:j+1]) bitwise for every M <= T and j < M,
    where f is the layer on random rows, and a layer of the same kind and shape with `probe_inputs`' weights."""
    x_adv, weight = probe_inputs(in_features, out_features, max_tile)
    x_random = torch.randn(max_tile, in_features, generator=torch.Generator().manual_seed(1))
    for fn, x in ((_rows_of(layer), x_random), (_same_kind(layer, weight, dtype), x_adv)):
        if fn is None:  # a kind of layer this module cannot rebuild: probed on random rows only
            continue
        x = x.to(dtype=dtype, device=device)
        alone = torch.cat([fn(x[j:j + 1]) for j in range(max_tile)])
        for M in range(2, max_tile + 1):
            if not torch.equal(fn(x[:M]), alone[:M]):
                max_tile = M - 1
                break
    return max_tile


def _rows_of(layer):
    """x [M, K] -> [M, N] through the layer (fused projections' views concatenated)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = layer(x)
        return torch.cat(out, dim=-1) if isinstance(out, (tuple, list)) else out
    return fn


def _same_kind(layer, weight: torch.Tensor, dtype: torch.dtype):
    """A layer that runs the same kernel as `layer` (same class, shape, scheme, dtype) with `weight`."""
    from specdecode.models.inference import PackedLinear
    from specdecode.models.llama import FusedLinear
    from specdecode.models.quant import QuantizedLinear

    if isinstance(layer, PackedLinear):
        max_k = None if layer.k_chunks is None else max(b - a for a, b in layer.k_chunks)
        return _rows_of(PackedLinear(weight.to(layer.dtype), None, max_k=max_k))
    if isinstance(layer, QuantizedLinear):
        quantized = QuantizedLinear.from_weight(weight, None, layer.scheme)
        quantized.prepare(dtype)
        return _rows_of(quantized)
    if isinstance(layer, (nn.Linear, FusedLinear)):
        return lambda x: torch.nn.functional.linear(x, weight.to(device=x.device, dtype=x.dtype))
    return None


class RowTiled(nn.Module):
    """A dense `nn.Linear` or fused projection called on at most `tile` rows at a time. (Packed and
    quantised layers take the tile as their `row_tile` instead: no extra module call per forward.)"""

    def __init__(self, layer, tile: int, in_features: int):
        super().__init__()
        self.layer = layer if isinstance(layer, nn.Module) else None
        self._callable = layer  # FusedLinear (fp32 fused projections) is a plain callable
        self.tile = tile
        self.in_features = in_features

    def forward(self, x: torch.Tensor):
        if x.numel() <= self.tile * self.in_features:
            return self._callable(x)
        return tile_rows(self._callable, x, self.tile)

    def extra_repr(self) -> str:
        return f"tile={self.tile}"


def _features(layer) -> tuple[int, int]:
    """(in, out) features of a linear layer or fused projection."""
    if hasattr(layer, "in_features"):
        return layer.in_features, layer.out_features
    return layer.weight.shape[1], layer.weight.shape[0]  # FusedLinear


def make_rows_invariant(model: nn.Module, dtype: torch.dtype, device) -> dict[str, int]:
    """Wrap every linear layer and fused projection under `model` in a `RowTiled` (in place), at the
    tile its probe found. Returns {module path: tile} of those below MAX_TILE. Probes are shared
    by layers of the same kind and shape."""
    from specdecode.models.inference import FusedMember, PackedLinear
    from specdecode.models.llama import FUSED_MEMBERS, FusedLinear
    from specdecode.models.quant import QuantizedLinear

    layer_types = (nn.Linear, PackedLinear, QuantizedLinear)
    tiles: dict[tuple, int] = {}
    wrapped: dict[str, int] = {}

    def tile_of(layer) -> int:
        K, N = _features(layer)
        key = (type(layer).__name__, K, N, getattr(getattr(layer, "scheme", None), "name", None))
        if key not in tiles:
            with torch.inference_mode():
                tiles[key] = probe_row_tile(layer, K, N, dtype, device)
        return tiles[key]

    for owner_name, owner in list(model.named_modules()):
        if isinstance(owner, (RowTiled, FusedMember)):
            continue
        prefix = f"{owner_name}." if owner_name else ""
        candidates = [(name, getattr(owner, name, None)) for name in FUSED_MEMBERS]
        candidates += [(name, child) for name, child in owner.named_children() if isinstance(child, layer_types)]
        for name, layer in candidates:
            if not isinstance(layer, layer_types + (FusedLinear,)):
                continue
            tile = tile_of(layer)  # MAX_TILE too: longer calls (prefills) go in chunks of what was probed
            if isinstance(layer, (PackedLinear, QuantizedLinear)):
                layer.row_tile = tile
            else:
                setattr(owner, name, RowTiled(layer, tile, _features(layer)[0]))
            if tile < MAX_TILE:
                wrapped[prefix + name] = tile
    return wrapped
