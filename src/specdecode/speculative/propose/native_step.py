"""A chain-drafting step as one C++ call (`DraftStep` in kernels/decode_stack_cpu.cpp), for the
feature drafters (EAGLE, EAGLE-3, MTP: `for_feature_drafter`) and draft models (`for_draft_model`).

Why: on the default model (float32 activations, int8 weights, 2-core AVX2 EPYC) an EAGLE-3 drafting
step measured ~1.25 ms through `EagleProposer`'s Python step, of which the block's C++ call and the
head take ~0.4 ms: the rest is entry and mask building, the embedding, RoPE tables, the input norms
and concatenation, the head's scatter into the full vocabulary and softmax / argmax / max over it
(a draft model's step pays the same through the runner). Sampled drafting (T > 0) through the
Python step spent another ~0.24 ms a step in `ChainDraft.add_step`.

Contract: the drafter's outputs, its cache and the greedy drafted tokens are bit-identical to the
Python step's (the same ops in the same order on the same kernels; tests/test_native_draft.py); the
drafted token's probability (its confidence, read by p_min and D-Cut) is 1 / sum(exp(logits - max)),
the softmax's maximum up to rounding. A sampled chain computes q = softmax(logits / T) itself (equal
to `process_logits`' up to rounding) and draws with the row's proposal uniforms
(`ChainDraft.uniforms`) by the same inverse CDF as the Python step: the same seeded stream either
way, and the same tokens wherever the two q agree to the last bit (where they do not, both are
exact draws from the q they record, which is what verification reads).

Several sequences of an all-greedy, unadjusted batch (`ChainDraft.one_hot`) draft a step at a time,
each step one C++ call over all of them (`draft_batch`: one lean forward of the layers, each sequence
a segment with its own cache row and causal mask, then one head call over their last rows), where
the stack's lean path serves the batch (else that step runs the Python step).

The whole chain in one call is served for one sequence that is greedy in an all-greedy, unadjusted
batch, or sampled with a temperature alone (no top-k, top-p, min_p, adjustment, grammar or key).
Either is served outside autograd and `torch.compile`, where the layers are served by the C++ stack
(models/native_stack.py), the drafter is a standard variant (not the target's own MTP layers), the
embedding and the norms are plain modules in the activations' dtype, the head is a linear layer the
stack computes (or a `ReducedHead` over one, its token ids ascending), and no forward hook sits on a
module the step stands for. Anything else runs the Python step, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.engine.ragged import ForwardEntry
from specdecode.kernels import decode_stack_cpu
from specdecode.models.layers import RotaryEmbedding
from specdecode.models.llama import NATIVE_TYPES, LlamaForCausalLM
from specdecode.models.native_stack import (NativeStack, NotServed, Watch, forward_hooks, native_block_for,
                                            native_stack_for, norm_weight, served_linear)
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.chain import ChainDraft
from specdecode.speculative.propose.draft_vocab import ReducedHead
from specdecode.speculative.propose.drafters.eagle.model import Eagle1Drafter, Eagle3Drafter, EagleDrafter, MtpDrafter


class NativeDraftStep:
    """One drafter's step as a C++ `DraftStep`. Build it with `for_feature_drafter` or
    `for_draft_model`; they raise NotServed where a piece is not one the step reproduces, and
    `watch` records what was looked at (a changed model is examined again)."""

    def __init__(self, layers, embedding: nn.Module, rotary: nn.Module, inputs: tuple, head_norm: tuple,
                 head: nn.Module, served_head: nn.Module, modules: list[nn.Module], watch: Watch):
        """layers(): the stack serving the drafter's layers (or None); inputs: the C++ DraftStep's
        (attn_input, embed norm, eps, feature norm, eps, fc); head_norm: (module or None, its owner's
        attribute); head: the drafter's head and served_head what scores with it (itself, or a
        ReducedHead over its frequent rows); modules: every other module the step stands for."""
        extension = decode_stack_cpu.extension()
        if extension is None:
            raise NotServed("the decode-stack kernel is not built here")
        self._layers = layers
        self.dtype = dtype = watch.get(embedding, "weight").dtype
        if type(embedding) is not nn.Embedding or embedding.max_norm is not None:
            raise NotServed(f"embedding {embedding}")
        if type(rotary) is not RotaryEmbedding:
            raise NotServed(f"rotary {type(rotary).__name__}")
        head_ids = None
        if served_head is head:  # the whole vocabulary
            linear = served_linear(head, "lm_head", dtype, watch, NATIVE_TYPES)
        elif type(served_head) is ReducedHead:
            linear = served_linear(watch.get(served_head, "rows"), "draft head", dtype, watch, NATIVE_TYPES)
            head_ids = watch.get(served_head, "token_ids")
            if head_ids.dtype != torch.long or not head_ids.is_contiguous() or head_ids.device.type != "cpu":
                raise NotServed("draft head token ids not int64 on the CPU")
            if len(head_ids) > 1 and not bool((head_ids[1:] > head_ids[:-1]).all()):
                raise NotServed("draft head token ids not ascending")  # the first maximum would differ
        else:
            raise NotServed(f"draft head {type(served_head).__name__}")
        self._hooks = forward_hooks([*modules, embedding, rotary, head, served_head])
        self._step = extension.DraftStep(embedding.weight, watch.get(rotary, "inv_freq"),
                                         watch.get(rotary, "attention_factor"), *inputs,
                                         *_norm(*head_norm, dtype, watch), linear, head_ids)

    @classmethod
    def for_feature_drafter(cls, drafter: EagleDrafter, target: LlamaForCausalLM, draft_heads: dict[int, nn.Module],
                            watch: Watch) -> "NativeDraftStep":
        """EAGLE / EAGLE-3 / MTP (draft_heads: the proposer's head per drafter head, `draft_head`)."""
        if type(drafter) not in (Eagle1Drafter, Eagle3Drafter, MtpDrafter):
            raise NotServed(f"drafter {type(drafter).__name__}")
        block = watch.get(drafter, "layer")
        dtype = watch.get(block, "input_layernorm").weight.dtype
        if isinstance(drafter, Eagle3Drafter):  # attention reads [norm(e) ; norm(f)], f is the residual
            inputs = (True, *_norm(block, "input_layernorm", dtype, watch), *_norm(drafter, "hidden_norm", dtype, watch),
                      None)
        else:  # x = fc([e' ; f']), both normed for MTP
            mtp = drafter if isinstance(drafter, MtpDrafter) else None
            inputs = (False, *_norm(mtp, "embed_norm", dtype, watch), *_norm(mtp, "feature_norm", dtype, watch),
                      served_linear(watch.get(drafter, "fc"), "fc", dtype, watch, NATIVE_TYPES))
        head_norm = {Eagle3Drafter: (drafter, "norm"), MtpDrafter: (target.model, "norm")}.get(type(drafter), (None, ""))
        head = watch.get(drafter if isinstance(drafter, Eagle3Drafter) else target, "lm_head")
        return cls(lambda: native_block_for(block, NATIVE_TYPES), watch.get(target.model, "embed_tokens"),
                   watch.get(drafter, "rotary"), inputs, head_norm, head, draft_heads.get(id(head)),
                   list(drafter.modules()) + [getattr(*head_norm) if head_norm[0] is not None else None], watch)

    @classmethod
    def for_draft_model(cls, model: LlamaForCausalLM, watch: Watch) -> "NativeDraftStep":
        """A draft model: its embeddings enter its stack (final norm included), then its head (which
        may be a ReducedHead: FR-Spec)."""
        if model.config.sliding_window is not None:
            raise NotServed("a sliding window")
        served_head = watch.get(model, "lm_head")
        head = served_head.rows if type(served_head) is ReducedHead else served_head
        return cls(lambda: native_stack_for(model, NATIVE_TYPES), watch.get(model.model, "embed_tokens"),
                   watch.get(model.model, "rotary_emb"), (False, None, 0.0, None, 0.0, None), (None, ""), head,
                   served_head, [], watch)

    def layers_serving(self, features: torch.Tensor | None = None) -> NativeStack | None:
        """The C++ stack of the drafter's layers, where it serves a step on these features now (else None)."""
        if (features is not None and features.dtype != self.dtype) or torch.is_grad_enabled() or any(self._hooks):
            return None
        layers = self._layers()
        return layers if layers is not None and layers.serves(self.dtype) else None

    def draft(self, layers: NativeStack, chain: ChainDraft, row: int, max_tokens: list[int], tokens: list[int],
              features: torch.Tensor | None, slot: int, start: int, next_start: int, cache_k: list[torch.Tensor],
              cache_v: list[torch.Tensor], temperature: float, generator: torch.Generator | None) -> int:
        """Draft row `row` of `chain` (greedy, or sampled at `temperature` > 0 with the row's
        generator): the first step feeds tokens [T] (and features [1, T, d]) at drafter positions
        start .., step s + 1 the token drafted at s (and the drafter's output there) at
        `next_start + s`. Without a stop rule, or with D-Cut's (whose one-sequence form the C++
        chain evaluates), every step runs in one C++ call, p_min applied there; with another rule
        (greedy only: `native_temperature`), a call a step, the rule asked between them. Returns the
        number of steps run."""
        one_row = getattr(chain.stop, "one_row", None)
        if chain.stop is None or one_row is not None:
            rule = (None, None, None, None, 0.0) if one_row is None else one_row()
            sampled = (temperature, None, None) if temperature == 0 else (
                temperature, torch.tensor(chain.uniforms(row, generator), dtype=torch.float64),
                chain.probs_buffer()[row])
            drafted, tops = layers.draft_chain(self._step, cache_k, cache_v, tokens, features, slot, start, next_start,
                                               max_tokens[row], chain.p_min, *rule, *sampled)
            for step, (token, top) in enumerate(zip(drafted, tops)):
                chain.record([row], step, [token], [top])
            return len(drafted)
        for step in range(max_tokens[row]):
            ids = torch.tensor([tokens], dtype=torch.long)
            out, token, top = layers.draft_step(self._step, cache_k, cache_v, ids, features, slot, start)
            tokens = chain.record([row], step, [token], [top])
            if not chain.continuing(step, [row], tokens, max_tokens):
                return step + 1
            start = next_start + step
            if features is not None:
                features = out[:, -1:]
        return max_tokens[row]

    def batch_drafter(self, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor],
                      features: torch.Tensor | None = None):
        """`draft_batch` through the layers serving now, on this cache: (entries, features) -> its result
        or None; None where the layers do not serve (features: one of the batch's, for its dtype)."""
        layers = self.layers_serving(features)
        if layers is None:
            return None
        return lambda entries, step_features: self.draft_batch(layers, cache_k, cache_v, entries, step_features)

    def draft_batch(self, layers: NativeStack, cache_k: list[torch.Tensor], cache_v: list[torch.Tensor],
                    entries: list[ForwardEntry], features: list[torch.Tensor] | None) -> tuple | None:
        """One greedy drafting step of several sequences: entry b's tokens (and features[b] [T_b, d])
        at drafter positions entry.start.. of its slot -> (o at each entry's last position [B, d], the
        drafted tokens, their probabilities), or None where the lean path does not serve the batch."""
        ids = torch.tensor([[t for entry in entries for t in entry.token_ids]], dtype=torch.long)
        joined = None if features is None else torch.cat(features)[None]  # [1, R, d]
        return layers.draft_batch(self._step, cache_k, cache_v, ids, joined, [e.slot for e in entries],
                                  [e.start for e in entries], [len(e.token_ids) for e in entries])


def native_batch_served(sampling: SamplingBatch, device: torch.device, compiled: bool, enabled: bool) -> bool:
    """Whether a proposal of several sequences may draft through `NativeDraftStep.draft_batch`: an
    all-greedy, unadjusted batch on a CPU, eager, the proposer's `native_drafting` on."""
    return ChainDraft.one_hot(sampling) and device.type == "cpu" and not compiled and enabled


def native_temperature(active: list[int], sampling: SamplingBatch, chain: ChainDraft, device: torch.device,
                       compiled: bool, enabled: bool) -> float | None:
    """The temperature a proposal may draft at through the C++ step (0: greedy), or None: one
    sequence, on a CPU, eager, the proposer's `native_drafting` on, and either an all-greedy,
    unadjusted batch or a sampled row with a temperature alone, drafted without a stop rule or
    with one the C++ chain evaluates."""
    if len(active) != 1 or device.type != "cpu" or compiled or not enabled:
        return None
    if ChainDraft.one_hot(sampling):
        return 0.0
    row = active[0]
    if (sampling.greedy[row] or sampling.keyed_rows or sampling.needs_filter or sampling.min_p is not None
            or sampling.adjusts or sampling.constrained
            or (chain.stop is not None and getattr(chain.stop, "one_row", None) is None)):
        return None
    return float(sampling.temperature[row])


def _norm(owner: nn.Module | None, name: str, dtype: torch.dtype, watch: Watch) -> tuple[torch.Tensor | None, float]:
    """An RMSNorm attribute's (weight, eps) for the C++ step ((None, 0.0): none)."""
    module = None if owner is None else watch.get(owner, name)
    return norm_weight(module, dtype, watch), 0.0 if module is None else module.eps
