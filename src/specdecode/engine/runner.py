"""The only place that turns sequences into tensors and calls the target model.

`forward` takes a ragged batch: every entry brings its own new tokens (a whole prompt, one
decode token, 1 + k verify tokens, or a tree), written into its KV slot at its own cache
columns, and asks for logits at its last `num_logits` tokens. Padding tokens of shorter
entries write to the cache's scratch column and attend only to column 0, so they can
neither corrupt a sequence nor produce NaNs.
"""

from __future__ import annotations

import dataclasses

import torch

from specdecode.models.llama import AttentionBatch, KVCache, LlamaForCausalLM


@dataclasses.dataclass(slots=True)
class ForwardEntry:
    slot: int
    token_ids: list[int]  # new tokens, T_i of them
    start: int  # cache column of the first new token (= tokens already cached)
    num_logits: int = 1  # logits for the last num_logits new tokens
    positions: list[int] | None = None  # RoPE positions; None = start, start+1, ... (chain)
    tree_mask: torch.Tensor | None = None  # [T_i, T_i] bool among new tokens; None = causal


@dataclasses.dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [B, N, V] float32; row b holds entry b's last num_logits tokens, left-aligned
    hidden: torch.Tensor  # [B, T, d] final-normed hidden states of all new tokens (padded)
    taps: dict[int, torch.Tensor]  # layer -> [B, T, d]
    num_new: list[int]  # T_i per entry


def build_attention(entries: list[ForwardEntry], scratch: int, sliding_window: int | None, device) -> tuple:
    """input_ids [B, T], positions [B, T], AttentionBatch for a ragged batch."""
    B = len(entries)
    T = max(len(e.token_ids) for e in entries)
    S = max(e.start + len(e.token_ids) for e in entries)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    positions = torch.zeros(B, T, dtype=torch.long)
    write = torch.full((B, T), scratch, dtype=torch.long)
    mask = torch.zeros(B, 1, T, S, dtype=torch.bool)
    mask[:, :, :, 0] = True  # padding rows see column 0 only
    key_cols = torch.arange(S)
    for b, e in enumerate(entries):
        n = len(e.token_ids)
        cols = torch.arange(e.start, e.start + n)
        input_ids[b, :n] = torch.tensor(e.token_ids)
        pos = torch.tensor(e.positions) if e.positions is not None else cols
        positions[b, :n] = pos
        write[b, :n] = cols
        # Every new token sees the committed prefix [0, start) ...
        rows = key_cols[None, :] < e.start  # [1, S]
        # ... and, among the new tokens, itself and its ancestors (chain: all earlier ones).
        among = e.tree_mask if e.tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        m = rows.expand(n, S).clone()
        m[:, e.start:e.start + n] = among
        if sliding_window is not None:
            m &= key_cols[None, :] > (pos[:, None] - sliding_window)
        mask[b, 0, :n] = m
    slots = [e.slot for e in entries]
    contiguous = slots == list(range(slots[0], slots[0] + B))
    batch = AttentionBatch(
        attn_mask=mask.to(device),
        slot_ids=torch.tensor(slots, device=device),
        write_indices=write.to(device),
        num_keys=S,
        slot_range=(slots[0], slots[0] + B) if contiguous else None,
    )
    return input_ids.to(device), positions.to(device), batch


class Runner:
    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_len = max_len
        self.kv_cache = KVCache(model.config, num_slots, max_len, dtype, device)

    @torch.inference_mode()
    def forward(self, entries: list[ForwardEntry], hidden_taps: tuple[int, ...] = ()) -> ForwardResult:
        input_ids, positions, batch = build_attention(
            entries, self.kv_cache.scratch_index, self.model.config.sliding_window, self.device)
        out = self.model(input_ids, positions, batch, self.kv_cache, hidden_taps)
        # LM head only where logits are needed: the last num_logits real tokens of each entry.
        num_new = [len(e.token_ids) for e in entries]
        N = max(e.num_logits for e in entries)
        index = torch.zeros(len(entries), N, dtype=torch.long)
        for b, e in enumerate(entries):
            first = num_new[b] - e.num_logits
            index[b, : e.num_logits] = torch.arange(first, num_new[b])
            index[b, e.num_logits:] = num_new[b] - 1
        index = index.to(self.device)
        hidden_sel = torch.gather(out.hidden, 1, index[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
        logits = self.model.compute_logits(hidden_sel)  # [B, N, V]
        return ForwardResult(logits, out.hidden, out.taps, num_new)
