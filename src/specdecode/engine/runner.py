"""The only place that turns sequences into tensors and calls the target model.

`forward` takes a ragged batch (`engine/ragged.py`): every entry brings its own new tokens
(a whole prompt, one decode token, 1 + k verify tokens, or a tree), written into its KV slot
at its own cache columns, and asks for logits at its last `num_logits` tokens. Padding
tokens of shorter entries write to the cache's scratch column and attend only to column 0,
so they can neither corrupt a sequence nor produce NaNs.
"""

from __future__ import annotations

import dataclasses

import torch

from specdecode.engine.compiled import CompiledForward
from specdecode.engine.ragged import ForwardEntry, LengthGrouping, build_attention, merge_rows
from specdecode.models.llama import KVCache, LlamaForCausalLM
from specdecode.models.quant import QuantScheme


@dataclasses.dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [B, N, V] float32; row b holds entry b's last num_logits tokens, left-aligned (then padding)
    hidden: torch.Tensor  # [B, T, d] final-normed hidden states of all new tokens (padded)
    taps: dict[int, torch.Tensor]  # layer -> [B, T, d]
    num_new: list[int]  # T_i per entry
    # A forward asked for `argmax` and served in one C++ call (one sequence, or a lean batch): each entry's
    # logits rows' torch.argmax [[N_b ints]], taken while the logits were in the caches (else None: take
    # them from `logits`).
    argmax: list[list[int]] | None = None
    # The taps concatenated along the last dimension in their requested order [B, T, n x d], where the forward
    # made them so in one C++ call (else None): `features`.
    tap_block: torch.Tensor | None = None

    def features(self, layers: tuple[int, ...]) -> torch.Tensor:
        """[B, T, len(layers) x d] the states of these tapped layers concatenated in this order (the raw feature
        of an EAGLE-3 or DFlash drafter): the forward's own block where it is that (a torch.cat here was
        ~36 us of cold host work a step in a line profile, EAGLE-3 at W4A8 with 4 in flight), else their
        concatenation."""
        if self.tap_block is not None and tuple(self.taps) == tuple(layers):
            return self.tap_block
        return torch.cat([self.taps[i] for i in layers], dim=-1)

    def first_choices(self) -> list[int] | None:
        """Each entry's argmax at its first logits row (a one-token step's greedy token), where the forward
        took them; else None."""
        return None if self.argmax is None else [row[0] for row in self.argmax]


class Runner:
    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 quantization: QuantScheme | None = None, compile: bool = False, exact: bool = False,
                 kv_cache_dtype: torch.dtype | None = None):
        self.model = model
        self.exact = exact  # attention by exact mode's invariant kernel (the model's linears are made row-invariant by LLM)
        self.quantization = quantization  # how the weights are stored (drafters follow it; cost profiles key on it)
        self.model_forward = CompiledForward(model.forward, compile, "target")  # decode / verify forwards compiled
        self.device = device
        self.dtype = dtype
        self.max_len = max_len
        self.kv_cache = KVCache(model.config, num_slots, max_len, kv_cache_dtype or dtype, device)  # int8: records
        # when a ragged batch is split into several forwards (a query head's group: the attention kernel's reach)
        self.grouping = LengthGrouping.for_device(device, model.config.num_attention_heads
                                                  // model.config.num_key_value_heads)
        self.native_chain = True  # one sequence's chain in one C++ call where served; False: always Python (A/B)
        self.forward_argmax = True  # such a call takes the argmax asked for; False: the caller takes it (A/B)

    @torch.inference_mode()
    def forward(self, entries: list[ForwardEntry], hidden_taps: tuple[int, ...] = (),
                argmax: bool = False) -> ForwardResult:
        """The entries' forward; `argmax`: the caller will take the raw logits' argmax (greedy rows
        without adjustments), which a forward served in one C++ call then computes (`ForwardResult.argmax`)."""
        argmax = argmax and self.forward_argmax

        def merge(parts: list[ForwardResult], groups: list[list[int]]) -> ForwardResult:
            return ForwardResult(
                logits=merge_rows([p.logits for p in parts], groups),
                hidden=merge_rows([p.hidden for p in parts], groups),
                taps={layer: merge_rows([p.taps[layer] for p in parts], groups) for layer in parts[0].taps},
                num_new=[len(e.token_ids) for e in entries],
                tap_block=(merge_rows([p.tap_block for p in parts], groups)
                           if all(p.tap_block is not None for p in parts) else None))

        return self.grouping.run(
            entries, lambda group: self._forward([entries[i] for i in group], hidden_taps, argmax), merge)

    def _forward(self, entries: list[ForwardEntry], hidden_taps: tuple[int, ...], argmax: bool = False) -> ForwardResult:
        native = self.native_chain and not self.exact and self.model_forward.compiled is None
        if native and all(e.positions is None and e.tree_mask is None and 1 <= e.num_logits <= len(e.token_ids)
                          for e in entries):
            if len(entries) == 1:  # one sequence's chain: embedding to logits in one C++ call, where it serves
                entry = entries[0]
                out = self.model.forward_chain(entry.token_ids, entry.slot, entry.start, entry.num_logits,
                                               self.kv_cache, hidden_taps, argmax)
                choices = None if out is None or out[3] is None else [out[3]]
            else:  # several sequences' chains (a decode or verification step): one lean C++ call, where it serves
                out = self.model.forward_chains([e.token_ids for e in entries], [e.slot for e in entries],
                                                [e.start for e in entries], [e.num_logits for e in entries],
                                                self.kv_cache, hidden_taps, argmax)
                choices = None if out is None else out[3]
            if out is not None:
                return ForwardResult(out[2], out[0], out[1], [len(e.token_ids) for e in entries], choices, out[4])
        input_ids, positions, batch = build_attention(
            entries, self.kv_cache.scratch_index, self.model.config.sliding_window, self.device)
        batch.exact = self.exact
        out = self.model_forward(input_ids.shape[1], batch, input_ids, positions, kv_cache=self.kv_cache,
                                 hidden_taps=hidden_taps)
        # LM head only where logits are needed: the last num_logits real tokens of each entry.
        num_new = [len(e.token_ids) for e in entries]
        N = max(e.num_logits for e in entries)
        num_new_t = torch.tensor(num_new)[:, None]
        num_logits = torch.tensor([e.num_logits for e in entries])[:, None]
        # Row b: tokens [T_b - num_logits_b, T_b), then repeats of its last token as padding.
        index = torch.minimum(num_new_t - num_logits + torch.arange(N)[None, :], num_new_t - 1).to(self.device)
        hidden_sel = torch.gather(out.hidden, 1, index[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
        logits = self.model.compute_logits(hidden_sel)  # [B, N, V]
        return ForwardResult(logits, out.hidden, out.taps, num_new)
