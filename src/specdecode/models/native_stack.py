"""A model's layer stack, or a drafter's one decoder block, as one C++ call
(`kernels/decode_stack_cpu.cpp`) for eager CPU inference.

Why: an eager decode token of the default model (float32 activations, int8 weights, 2-core AVX2
EPYC) measured ~3.3 ms, of which its 25 matmuls take ~0.9 ms and attention ~0.2 ms; the rest is
Python around ~150 small ops. The C++ stack runs the same ops on the same kernels in the same
order, so its results are bit-identical to the modules' (tests/test_native_stack.py checks it).

It serves a forward when every piece is one it reproduces: standard attention (not MLA / DSA),
dense SwiGLU MLPs, linear layers that are dense (`nn.Linear`, `FusedLinear`) or `QuantizedLinear`s
on a path it reproduces (int8 / int4 with its few-row kernel attached, and a packed wide copy for
verification widths, or the dequantised dense copy their forward multiplies float32 activations by;
w8a8 / w4a8 with its kernel; no exact-mode row tiling), RMSNorm weights
in the activations' dtype; any cached batch (contiguous rows writing the same columns by slices:
decode, chain and tree verification at batch 1, equal-length batches; ragged ones by index writes
and, for rows out of order, a gather, as `write_columns` / `read_columns` do), outside exact mode, autograd,
forward hooks and `torch.compile`. Packed bf16/fp16 layers (`PackedLinear`, on CPUs with AVX-512)
run the same oneDNN op and few-row bf16 kernel as their module; bf16-weight layers (`Bf16WeightLinear`,
float32 activations) the same bf16-weight kernel. Anything else runs the Python
modules, as before.

The stack holds the layers' tensors; `Watch.current()` checks, per forward, that the modules still
hold the same layers and kernels (exact mode detaches kernels, quantisation swaps layers), so a
changed model is rebuilt, never served stale.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdecode.kernels import attention_cpu, decode_stack_cpu
from specdecode.models.layers import MLP, AttentionBatch, RMSNorm, RotaryEmbedding

if TYPE_CHECKING:
    from specdecode.models.llama import LlamaForCausalLM


class NotServed(Exception):
    """A model piece the C++ stack does not reproduce (the reason is the message)."""


class Watch:
    """(object, attribute, value) triples a decision was made on; `current()` compares them by identity.
    Each is kept as the dict that holds the attribute (a module's _parameters / _buffers / _modules or
    its __dict__) and its key: a lookup there costs a tenth of nn.Module's getattr (~160 per forward)."""

    def __init__(self):
        self._dicts, self._keys, self._values = [], [], []

    def get(self, owner: object, name: str):
        value = getattr(owner, name)
        holder = owner.__dict__
        if isinstance(owner, nn.Module):
            holder = next((d for d in (owner._parameters, owner._buffers, owner._modules) if name in d), holder)
        self._dicts.append(holder)
        self._keys.append(name)
        self._values.append(value)
        return value

    def extend(self, other: "Watch") -> None:
        """Also watch what `other` watches (an object built on what another was decided on)."""
        self._dicts += other._dicts
        self._keys += other._keys
        self._values += other._values

    def current(self) -> bool:
        # Every forward asks (150 triples for the default model's chain): the C++ loop where the stack's
        # extension is built (nothing is served without it), 41 us right after a forward where Python took 71.
        extension = decode_stack_cpu.extension()
        if extension is not None:
            return extension.watch_current(self._dicts, self._keys, self._values)
        try:
            return all(map(operator.is_, map(operator.getitem, self._dicts, self._keys), self._values))
        except KeyError:  # the attribute moved (a plain object replaced by a module, or deleted)
            return False


@dataclasses.dataclass(frozen=True, slots=True)
class ServedTypes:
    """The module types the stack reproduces, exactly (a subclass may compute otherwise); given by
    models/llama.py, which defines them and calls this module (so this one does not import it)."""

    block: type  # DecoderLayer
    attention: type  # Attention
    fused_linear: type  # FusedLinear
    causal_lm: type  # LlamaForCausalLM


class NativeStack:
    """Decoder blocks (a model's whole stack with its final norm, or one drafter block) as one C++ call."""

    def __init__(self, blocks: list[nn.Module], final_norm: nn.Module | None, watch: Watch, types: ServedTypes,
                 lean_rows: int = 0):
        """Raises NotServed where a block is not one the stack reproduces; `watch` records what was
        looked at (also when it raises, so a model changed since is examined again). `lean_rows` > 0:
        the lean path serves up to that many tokens, its bf16 layers on the few-row kernel at any width
        (a model's `lean_rows`, measured on whole forwards: engine/lean_width.py)."""
        extension = decode_stack_cpu.extension()
        if extension is None:
            raise NotServed("the decode-stack kernel is not built here")
        first_norm = getattr(blocks[0], "input_layernorm", None)
        if not isinstance(first_norm, RMSNorm):
            raise NotServed(f"block {type(blocks[0]).__name__}")
        self.dtype = first_norm.weight.dtype

        def linear(owner: nn.Module, name: str):
            return served_linear(watch.get(owner, name), name, self.dtype, watch, types)

        layers = []
        for block in blocks:
            attn, mlp = watch.get(block, "self_attn"), watch.get(block, "mlp")
            if type(block) is not types.block or type(attn) is not types.attention or type(mlp) is not MLP:
                raise NotServed(f"block {type(block).__name__}({type(attn).__name__}, {type(mlp).__name__})")
            if attn.qkv is None or mlp.gate_up is None:
                raise NotServed("projections not fused")
            norms = [watch.get(block, "input_layernorm"), watch.get(block, "post_attention_layernorm"),
                     watch.get(attn, "q_norm"), watch.get(attn, "k_norm")]
            if len({n.eps for n in norms if n is not None}) != 1:
                raise NotServed("norms of one layer with different eps")
            layers.append(extension.Layer(
                *(norm_weight(n, self.dtype, watch) for n in norms), norms[0].eps,
                linear(attn, "qkv"), linear(attn, "o_proj"), linear(mlp, "gate_up"), linear(mlp, "down_proj"),
                attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.down_proj.in_features))
        self._hooks = forward_hooks([*(m for block in blocks for m in block.modules()), final_norm])
        # The modules' cached attention takes the attention op in every forward the stack serves
        # (eager, no autograd, CPU) where it is built: so does the stack.
        self._stack = extension.Stack(layers, norm_weight(final_norm, self.dtype, watch),
                                      0.0 if final_norm is None else final_norm.eps, attention_cpu.available(),
                                      lean_rows)
        self._k: list[torch.Tensor] = []  # the caches bound to the C++ stack
        self._v: list[torch.Tensor] = []

    def bind(self, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor]):
        """Make these (one K and one V per block) the caches the C++ stack reads and writes; returns the
        C++ stack (what a C++ step or chain call takes)."""
        if len(cache_k) != len(self._k) or not all(map(operator.is_, cache_k, self._k)) \
                or not all(map(operator.is_, cache_v, self._v)):
            self._stack.bind_cache(list(cache_k), list(cache_v))
            self._k, self._v = list(cache_k), list(cache_v)
        return self._stack

    def draft_step(self, step, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], *args):
        """A C++ DraftStep (speculative/propose/native_step.py) through these layers on this cache:
        step.step(layers, *args)."""
        return step.step(self.bind(cache_k, cache_v), *args)

    def draft_chain(self, step, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], *args):
        """A C++ DraftStep's greedy chain (several steps, one call) through these layers on this cache:
        step.chain(layers, *args)."""
        return step.chain(self.bind(cache_k, cache_v), *args)

    def draft_batch(self, step, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], *args):
        """A C++ DraftStep's greedy step of several sequences (one lean forward) through these layers on
        this cache: step.batch(layers, *args), None where the lean path does not serve it."""
        return step.batch(self.bind(cache_k, cache_v), *args)

    def chain_forward(self, chain, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], *args):
        """A C++ ChainForward (`NativeChain`) through this stack on this cache: chain.forward(stack, *args)."""
        return chain.forward(self.bind(cache_k, cache_v), *args)

    def lean_forwards(self) -> int:
        """How many forwards took the C++ stack's lean path (decode_stack_cpu.cpp `Stack::lean_forward`)."""
        return self._stack.lean_forwards()

    def serves(self, dtype: torch.dtype) -> bool:
        """Whether a forward on activations of `dtype` is one the stack runs now (`batch_served` checked first)."""
        return dtype == self.dtype and not torch.is_grad_enabled() and not any(self._hooks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: AttentionBatch,
                cache_k: list[torch.Tensor], cache_v: list[torch.Tensor], hidden_taps: tuple[int, ...] = (),
                attn_input: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [B, T, d] (a model: its embeddings; a block: its residual input), one cache K and V per
        block -> (the last block's output [B, T, d], final-normed where the stack has the final norm;
        {tap: [B, T, d]}, models/llama.py's numbering). `attn_input` replaces the first block's input
        norm as what attention reads (EAGLE-3)."""
        self.bind(cache_k, cache_v)
        mask = batch.attn_mask
        num_keys = mask.shape[-1] if mask is not None else batch.num_keys
        taps = list(hidden_taps)
        if batch.slot_range is not None and batch.write_start is not None:  # slices of the cache (no indices)
            rows = (*batch.slot_range, batch.write_start, num_keys, None if batch.sees_all else mask, taps, attn_input)
        else:  # a ragged batch: its tokens' columns written by index, its rows read by a gather unless contiguous
            rows = (*(batch.slot_range or (-1, -1)), -1, num_keys, None if batch.sees_all else mask, taps, attn_input,
                    batch.slot_ids, batch.write_indices)
        hidden, tapped = self._stack.forward(x, cos, sin, *rows)
        return hidden, dict(zip(taps, tapped))


class NativeChain:
    """A model's forward for one sequence's contiguous new tokens (embedding, RoPE, its stack, the LM
    head at the last rows) as one C++ call (`ChainForward` in decode_stack_cpu.cpp), bit-identical to
    the runner's Python around the stack (`build_attention`, the embedding and rotary modules, the
    gather of the last rows, `compute_logits`). Raises NotServed where a piece is not one it
    reproduces; `watch` records what was looked at."""

    def __init__(self, model: "LlamaForCausalLM", watch: Watch, types: ServedTypes):
        extension = decode_stack_cpu.extension()
        if extension is None:
            raise NotServed("the decode-stack kernel is not built here")
        if type(model) is not types.causal_lm or model.config.sliding_window is not None:
            raise NotServed(f"model {type(model).__name__} (sliding window {model.config.sliding_window})")
        embedding, rotary = watch.get(model.model, "embed_tokens"), watch.get(model.model, "rotary_emb")
        self.dtype = watch.get(embedding, "weight").dtype
        if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
            raise NotServed(f"embedding {embedding}")
        if type(rotary) is not RotaryEmbedding:
            raise NotServed(f"rotary {type(rotary).__name__}")
        head = watch.get(model, "lm_head")
        # The model's stack, watched with the chain: one lookup and one check a forward serve both.
        self.stack = native_stack_for(model, types)
        if self.stack is None:
            raise NotServed("the model's layer stack")
        watch.extend(_STACKS[model][0])
        modules = [model, model.model, embedding, rotary, head]
        self._hooks = forward_hooks(modules)
        self._chain = extension.ChainForward(embedding.weight, watch.get(rotary, "inv_freq"),
                                             watch.get(rotary, "attention_factor"),
                                             served_linear(head, "lm_head", self.dtype, watch, types))

    def forward(self, token_ids: list[int], slot: int, start: int, num_logits: int, kv_cache,
                hidden_taps: tuple[int, ...], argmax: bool = False) -> tuple | None:
        """(final-normed hidden [1, T, d], {tap: [1, T, d]}, logits [1, num_logits, V] float32, with `argmax`
        each logits row's torch.argmax as a list, else None, the taps concatenated in order [1, T, n x d]
        or None without taps: `ForwardResult.tap_block`), or None where it does not serve now (autograd,
        a forward hook)."""
        if any(self._hooks) or not self.stack.serves(self.dtype):
            return None
        taps = list(hidden_taps)
        hidden, tapped, logits, choices, block = self.stack.chain_forward(
            self._chain, kv_cache.k, kv_cache.v, token_ids, slot, start, num_logits, taps, argmax)
        return hidden, dict(zip(taps, tapped)), logits, choices if argmax else None, block

    def forward_batch(self, token_ids: list[list[int]], slots: list[int], starts: list[int], num_logits: list[int],
                      kv_cache, hidden_taps: tuple[int, ...], argmax: bool = False) -> tuple | None:
        """B sequences' new tokens (sequence b's token_ids[b] written at columns starts[b].. of cache row
        slots[b], causal; its logits at its last num_logits[b]): `forward`'s tuple for the batch (hidden
        [B, W, d], taps, logits [B, N, V] float32 padded as Runner._forward pads them, each sequence's
        argmaxes or None), or None where the stack's lean path does not serve it (the ragged batch's
        Python path then runs)."""
        if any(self._hooks) or not self.stack.serves(self.dtype):
            return None
        taps = list(hidden_taps)
        ids = torch.tensor([[t for row in token_ids for t in row]], dtype=torch.long)
        out = self._chain.batch(self.stack.bind(kv_cache.k, kv_cache.v), ids, slots, starts,
                                [len(row) for row in token_ids], num_logits, taps, argmax)
        if out is None:
            return None
        hidden, tapped, logits, choices, block = out
        return hidden, dict(zip(taps, tapped)), logits, choices if argmax else None, block


def forward_hooks(modules: list[nn.Module | None]) -> list[dict]:
    """The forward (pre-)hook dicts of these modules and the global ones: a C++ path that stands for
    the modules calls none, so it serves only while every one is empty (`any(hooks)`, per call;
    exact/bisect.py records every module's output through them)."""
    hooks = torch.nn.modules.module
    return [hooks._global_forward_pre_hooks, hooks._global_forward_hooks,
            *(d for m in modules if m is not None for d in (m._forward_pre_hooks, m._forward_hooks))]


def norm_weight(norm: nn.Module | None, dtype: torch.dtype, watch: Watch) -> torch.Tensor | None:
    """An RMSNorm's weight as the C++ code applies it (None: no norm); raises NotServed otherwise."""
    if norm is None:
        return None
    weight = watch.get(norm, "weight")
    if type(norm) is not RMSNorm or weight.dtype != dtype or weight.device.type != "cpu":
        raise NotServed(f"norm {norm}")
    watch.get(norm, "eps")
    return weight


def served_linear(layer: nn.Module, name: str, dtype: torch.dtype, watch: Watch, types: ServedTypes):
    """A linear layer as the C++ code computes it (a `Linear` of decode_stack_cpu.cpp): the path its
    module takes for activations of `dtype`; raises NotServed where that path is not reproduced."""
    extension = decode_stack_cpu.extension()
    if _is_served_class(layer, "PackedLinear"):  # its _matmul: the few-row bf16 kernel up to its width, else oneDNN
        if watch.get(layer, "row_tiling") is not None or layer.dtype != dtype:
            raise NotServed(f"{name}: a row tiling or weight dtype {layer.dtype}")
        few_rows = watch.get(layer, "few_rows")
        return extension.packed_linear(watch.get(layer, "packed"), watch.get(layer, "bias"), layer.out_features,
                                       *(few_rows if few_rows is not None else (None, 0)))
    if _is_served_class(layer, "Bf16WeightLinear"):  # its forward: the bf16-weight op at every width
        if watch.get(layer, "row_tiling") is not None or dtype != torch.float32:
            raise NotServed(f"{name}: a row tiling or {dtype} activations")
        return extension.bf16w_linear(watch.get(layer, "blocked"), watch.get(layer, "bias"), layer.out_features)
    if hasattr(layer, "few_rows_arguments"):  # a QuantizedLinear (not imported: it imports models/llama.py)
        if watch.get(layer, "row_tiling") is not None:
            raise NotServed(f"{name}: a row tiling")
        scheme = watch.get(layer, "scheme")
        if not scheme.weight_only:  # w8a8 / w4a8: its kernel at every width
            arguments = layer.a8_arguments(layer.qweight.device) if dtype in (torch.float32, torch.bfloat16) else None
            if arguments is None:
                raise NotServed(f"{name}: {scheme.name} without its kernel")
            return extension.a8_linear(scheme.bits, *arguments)
        wide = watch.get(layer, "wide")  # (its dense copy, packed, the width from which it serves)
        if wide is not None and not _is_served_class(wide[0], "PackedLinear"):
            raise NotServed(f"{name}: wide copy {wide[0]}")
        if watch.get(layer, "few_rows") is not None:  # the few-row op of its width (int8 or int4)
            few_rows = extension.int8_linear if watch.get(layer, "scheme").bits == 8 else extension.int4_linear
            served = few_rows(*layer.few_rows_arguments(dtype, layer.qweight.device))
            if wide is None:
                return served
            return extension.with_wide(served, served_linear(wide[0], f"{name}.wide", dtype, watch, types), wide[1])
        if wide is not None:
            raise NotServed(f"{name}: a wide copy beside PyTorch's int kernels")
        if layer.uses_dense_copy(dtype, layer.qweight.device):  # what its forward runs: F.linear
            return extension.dense_linear(layer.dense_weight(dtype), layer.bias_as(dtype))
        raise NotServed(f"{name}: PyTorch's int kernels")
    if isinstance(layer, types.fused_linear) or type(layer) is nn.Linear:
        if layer.weight.dtype != dtype:
            raise NotServed(f"{name}: weight dtype {layer.weight.dtype}")
        return extension.dense_linear(watch.get(layer, "weight"), watch.get(layer, "bias"))
    raise NotServed(f"{name}: {type(layer).__name__}")


def _is_served_class(layer: nn.Module, name: str) -> bool:
    """Whether `layer` is exactly the models/inference.py class `name` (a subclass may compute otherwise),
    told by its class's qualified name: inference.py imports models/llama.py, which imports this module."""
    cls = type(layer)
    return cls.__name__ == name and cls.__module__ == "specdecode.models.inference"


def batch_served(batch: AttentionBatch | None) -> bool:
    """Whether a cached forward's batch is one the C++ stack runs: any batch with cache rows and write
    columns, not exact mode (cheap: checked before anything else)."""
    if batch is None or batch.exact:
        return False
    sliced = batch.slot_range is not None and batch.write_start is not None
    return sliced or (batch.slot_ids is not None and batch.write_indices is not None)


# module -> (what its stack was decided on, the stack or None); weak: no reference keeps a model alive,
# and the module itself holds nothing that deepcopy or pickling would trip on.
_STACKS: "weakref.WeakKeyDictionary[nn.Module, tuple[Watch, NativeStack | None]]" = weakref.WeakKeyDictionary()
_CHAINS: "weakref.WeakKeyDictionary[nn.Module, tuple[Watch, NativeChain | None]]" = weakref.WeakKeyDictionary()


def current_or_rebuilt(entry: tuple[Watch, object] | None, build) -> tuple[Watch, object]:
    """`entry` (what a C++ object was decided on, the object or None) while what it was built from
    is unchanged, else a new one from build(watch) (None where that raises NotServed)."""
    if entry is not None and entry[0].current():
        return entry
    watch = Watch()
    try:
        return watch, build(watch)
    except NotServed:
        return watch, None


def _cached(store: weakref.WeakKeyDictionary, module: nn.Module, build):
    """The module's C++ object in `store`, built on first use and again when what it was built from changed."""
    entry = store.get(module)
    if entry is None or not entry[0].current():
        entry = store[module] = current_or_rebuilt(None, build)
    return entry[1]


def native_stack_for(model: "LlamaForCausalLM", types: ServedTypes) -> NativeStack | None:
    """A model's layer stack and final norm as one C++ call (None: not served)."""
    def build(watch: Watch) -> NativeStack:
        if model.config.is_mla or model.config.has_dsa:
            raise NotServed("MLA / DSA attention")
        blocks = [watch.get(model.model.layers, str(i)) for i in range(model.config.num_hidden_layers)]
        return NativeStack(blocks, watch.get(model.model, "norm"), watch, types, watch.get(model, "lean_rows"))

    return _cached(_STACKS, model, build)


def native_chain_for(model: "LlamaForCausalLM", types: ServedTypes) -> NativeChain | None:
    """The pieces around a model's stack for one-sequence forwards, in C++ (None: not served)."""
    return _cached(_CHAINS, model, lambda watch: NativeChain(model, watch, types))


def native_block_for(block: nn.Module, types: ServedTypes) -> NativeStack | None:
    """One decoder block (a drafter's) as one C++ call (None: not served)."""
    return _cached(_STACKS, block, lambda watch: NativeStack([block], None, watch, types))


def serve_by_modules(module: nn.Module) -> None:
    """Run every model and decoder block under `module` by its Python modules (A/B measurements)."""
    for m in module.modules():
        _STACKS[m] = _CHAINS[m] = (Watch(), None)  # nothing watched: the decision stands
