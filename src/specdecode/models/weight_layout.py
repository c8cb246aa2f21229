"""The weights a forward streams, laid out in one buffer in the order the forward reads them.

Each kernel's weight layout (the few-row bf16 / int8 / int4 blocks, the w8a8 / w4a8 tiles, dense
copies) is built by its own allocation, and `attach_few_row_kernels` builds them grouped by
shape: every layer's qkv block, then every o_proj block, and so on. A one-token forward then
jumps across the heap from layer to layer, and where the allocator puts each block depends on
what the process allocated before (a second engine's blocks fill the first one's freed holes).
Measured on the default model, bf16, one-token forwards of two engines in one process in
interleaved blocks: the engine built first 1.09-1.21x slower than the one built second (the
slowness followed the model when the two runners swapped models, not the KV cache). Its blocks
copied into one buffer in forward order later in the process: 1.01-1.04x the second's time,
whatever the blocks' alignment (64 bytes to 64 KiB); copied at its load: still 1.05-1.26x, unless
the buffer sits on transparent huge pages (1.01-1.04x, and 0.92x against a second engine not
laid out). The bench's second plain engine read 1.16-1.18x the first before, 0.99-1.02x after.

So, once a model's kernel tensors exist, `lay_out_in_forward_order` copies them into one buffer on
huge pages, layer by layer in module order (a decoder's modules register in the order its forward
runs them), and points the layers at the copies. Plain copies: every kernel computes bit-identical
results.
Registered parameters and buffers (the checkpoint's tensors, `state_dict`) are left alone, and
so are oneDNN's opaque packed weights, which cannot be viewed into a buffer.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

ALIGN = 64  # bytes: a cache line, and every element size the kernels read
HUGE_PAGE = 2 << 20  # bytes: x86-64 / arm64 transparent huge pages
MADV_HUGEPAGE = 14

# Where a served layer keeps the tensors its kernels stream (besides registered parameters / buffers):
# a tuple (few_rows), a tensor (a Bf16WeightLinear's blocked weights), or a dict of tuples / tensors
# ((dtype, device) -> what a kernel takes).
KERNEL_ATTRIBUTES = ("few_rows", "blocked", "_kernel_weights", "_dense")


def lay_out_in_forward_order(module: nn.Module) -> int:
    """Copy every CPU kernel tensor of `module`'s layers into one buffer in module order (a layer's
    `wide` dense copy right after it); returns the bytes moved (0: nothing to move)."""
    layers = []
    for layer in module.modules():
        layers.append(layer)
        wide = getattr(layer, "wide", None)
        if isinstance(wide, tuple) and isinstance(wide[0], nn.Module):
            layers.append(wide[0])
    registered = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    tensors: dict[int, torch.Tensor] = {}  # id -> tensor, first use first
    for layer in layers:
        for name in KERNEL_ATTRIBUTES:
            for tensor in _tensors(getattr(layer, name, None)):
                if id(tensor) not in registered and _movable(tensor):
                    tensors.setdefault(id(tensor), tensor)
    if not tensors:
        return 0
    offsets, total = {}, 0
    for key, tensor in tensors.items():
        offsets[key] = total
        total += -(-tensor.nbytes // ALIGN) * ALIGN
    buffer, start = _huge_page_buffer(total)
    copies = {}
    for key, tensor in tensors.items():
        at = start + offsets[key]
        copy = buffer[at: at + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copy.copy_(tensor)
        copies[key] = copy
    for layer in layers:
        for name in KERNEL_ATTRIBUTES:
            value = getattr(layer, name, None)
            if value is not None and any(id(t) in copies for t in _tensors(value)):
                setattr(layer, name, _replaced(value, copies))
    return total


def _huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """An uninitialised uint8 buffer and the offset in it of `nbytes` that start on a huge-page
    boundary and are marked for transparent huge pages (Linux `madvise`, before any page is touched:
    the pages are allocated as the copies fault them in). Elsewhere, or where that fails, a buffer
    aligned to `ALIGN`."""
    buffer = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if sys.platform.startswith("linux"):  # MADV_HUGEPAGE's value is Linux's
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(buffer.data_ptr() + start), ctypes.c_size_t(length), MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass  # no madvise here: ordinary pages, the same numbers
    return buffer, start


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _movable(tensor: torch.Tensor) -> bool:
    """A dense CPU tensor that owns its whole storage: a view's base (or a registered tensor, which
    the caller excludes) stays where it is, so moving it would only add a copy."""
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_mkldnn
            and tensor.is_contiguous() and tensor.nbytes > 0 and tensor.untyped_storage().nbytes() == tensor.nbytes)


def _replaced(value, copies: dict[int, torch.Tensor]):
    if isinstance(value, torch.Tensor):
        return copies.get(id(value), value)
    if isinstance(value, tuple):
        return tuple(_replaced(item, copies) for item in value)
    if isinstance(value, list):
        return [_replaced(item, copies) for item in value]
    if isinstance(value, dict):
        return {key: _replaced(item, copies) for key, item in value.items()}
    return value
