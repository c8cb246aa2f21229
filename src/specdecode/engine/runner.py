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
    # [T_i, E + T_i] bool; None = causal. Columns: the E cache columns just before `start`
    # (tree nodes written by an earlier forward, e.g. a drafter expanding a tree level by
    # level), then the new tokens. Columns before start - E are the committed prefix, seen by all.
    tree_mask: torch.Tensor | None = None


@dataclasses.dataclass(slots=True)
class ForwardResult:
    logits: torch.Tensor  # [B, N, V] float32; row b holds entry b's last num_logits tokens, left-aligned (then padding)
    hidden: torch.Tensor  # [B, T, d] final-normed hidden states of all new tokens (padded)
    taps: dict[int, torch.Tensor]  # layer -> [B, T, d]
    num_new: list[int]  # T_i per entry


def build_attention(entries: list[ForwardEntry], scratch: int, sliding_window: int | None, device) -> tuple:
    """input_ids [B, T], positions [B, T], AttentionBatch for a ragged batch (vectorised;
    only tree entries and custom positions touch their own rows)."""
    B = len(entries)
    num_new = torch.tensor([len(e.token_ids) for e in entries])  # [B]
    starts = torch.tensor([e.start for e in entries])  # [B]
    T = int(num_new.max())
    S = int((starts + num_new).max())
    input_ids = torch.tensor([e.token_ids + [0] * (T - len(e.token_ids)) for e in entries], dtype=torch.long)
    t = torch.arange(T)
    real = t[None, :] < num_new[:, None]  # [B, T]
    cols = starts[:, None] + t[None, :]  # [B, T] cache column of each new token
    positions = cols.clone()
    key_cols = torch.arange(S)
    # Chain rule: token t sees every column up to its own; padding rows see column 0 only.
    mask = key_cols[None, None, :] <= cols[:, :, None]  # [B, T, S]
    for b, e in enumerate(entries):
        n = len(e.token_ids)
        if e.positions is not None:
            positions[b, :n] = torch.tensor(e.positions)
        if e.tree_mask is not None:  # itself and its ancestors only
            earlier = e.tree_mask.shape[1] - n
            mask[b, :n, e.start - earlier:e.start + n] = e.tree_mask
    if sliding_window is not None:
        mask &= key_cols[None, None, :] > (positions[:, :, None] - sliding_window)
    mask = torch.where(real[:, :, None], mask, key_cols[None, None, :] == 0)
    write = torch.where(real, cols, torch.full_like(cols, scratch))
    slots = [e.slot for e in entries]
    contiguous = slots == list(range(slots[0], slots[0] + B))
    batch = AttentionBatch(
        attn_mask=mask[:, None].to(device),  # [B, 1, T, S]
        slot_ids=torch.tensor(slots, device=device),
        write_indices=write.to(device),
        num_keys=S,
        slot_range=(slots[0], slots[0] + B) if contiguous else None,
    )
    return input_ids.to(device), positions.to(device), batch


# What one more forward costs, in padded tokens: a forward's fixed cost (weight streaming, kernel
# launches, Python) is worth ~100 tokens of extra width for the default model and its draft model
# on a 2-core CPU (measured: draft model [1,1,1] 3.6 ms, [150] 8.3 ms, [150,1,1,1] padded 22.4 ms).
# On a GPU, extra width is nearly free until a forward is compute-bound while every forward pays
# its launches (not measured here): only prompt-sized gaps are worth a second forward there.
def forward_overhead_tokens(device) -> int:
    return 128 if torch.device(device).type == "cpu" else 2048


def length_groups(lengths: list[int], overhead: int) -> list[list[int]]:
    """Entry indices of a ragged batch, split into forwards of similar lengths.

    A batch is padded to its longest entry, so a drafter's 150-token catch-up of a newly
    admitted request next to three 1-token steps costs 600 tokens of compute (measured 22 ms
    padded against 12 ms as two forwards). Sorted by length, the entries are cut into the
    groups that minimise padded tokens + `overhead` per forward (exact dynamic programme; the
    common case, near-equal lengths, returns one group without it)."""
    B, longest = len(lengths), max(lengths)
    if B * longest - sum(lengths) <= overhead:
        return [list(range(B))]
    order = sorted(range(B), key=lengths.__getitem__)
    best, cut = [0] + [B * longest + overhead] * B, [0] * (B + 1)  # best[i]: the i shortest, cut[i]: last group's start
    for i in range(1, B + 1):
        width = lengths[order[i - 1]]
        for j in range(i):
            cost = best[j] + overhead + (i - j) * width
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], B
    while i:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


def merge_rows(parts: list[torch.Tensor], groups: list[list[int]]) -> torch.Tensor:
    """Per-group row tensors [b_g, T_g, ...] -> [B, max T_g, ...] in entry order (zero-padded)."""
    width = max(p.shape[1] for p in parts)
    out = parts[0].new_zeros(sum(len(g) for g in groups), width, *parts[0].shape[2:])
    for part, group in zip(parts, groups):
        out[torch.tensor(group, device=out.device), : part.shape[1]] = part
    return out


class Runner:
    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_len = max_len
        self.kv_cache = KVCache(model.config, num_slots, max_len, dtype, device)
        self.forward_overhead_tokens = forward_overhead_tokens(device)  # when a ragged batch is split (`length_groups`)

    @torch.inference_mode()
    def forward(self, entries: list[ForwardEntry], hidden_taps: tuple[int, ...] = ()) -> ForwardResult:
        groups = length_groups([len(e.token_ids) for e in entries], self.forward_overhead_tokens)
        if len(groups) == 1:
            return self._forward(entries, hidden_taps)
        parts = [self._forward([entries[i] for i in group], hidden_taps) for group in groups]
        return ForwardResult(
            logits=merge_rows([p.logits for p in parts], groups),
            hidden=merge_rows([p.hidden for p in parts], groups),
            taps={layer: merge_rows([p.taps[layer] for p in parts], groups) for layer in parts[0].taps},
            num_new=[len(e.token_ids) for e in entries])

    def _forward(self, entries: list[ForwardEntry], hidden_taps: tuple[int, ...]) -> ForwardResult:
        input_ids, positions, batch = build_attention(
            entries, self.kv_cache.scratch_index, self.model.config.sliding_window, self.device)
        out = self.model(input_ids, positions, batch, self.kv_cache, hidden_taps)
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
