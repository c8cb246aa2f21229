"""Ragged batches: per-entry new tokens at per-entry cache columns, as padded tensors.

`ForwardEntry` is one sequence's part of a forward; `build_attention` turns a list of them
into input ids, RoPE positions and the attention metadata every model (target or drafter)
takes. A batch is padded to its longest entry, so `LengthGrouping` cuts entries of very
different lengths into separate forwards where padding would cost more than a forward;
the runner and the drafters that run their own ragged forwards share it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

import torch

from specdecode.kernels import attention_cpu
from specdecode.models.llama import AttentionBatch

Result = TypeVar("Result")


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


def build_attention(entries: list[ForwardEntry], scratch: int, sliding_window: int | None, device) -> tuple:
    """input_ids [B, T], positions [B, T], AttentionBatch for a ragged batch (vectorised;
    only tree entries and custom positions touch their own rows)."""
    if len(entries) == 1 and entries[0].positions is None and entries[0].tree_mask is None and sliding_window is None:
        return _one_chain(entries[0], device)
    return _ragged(entries, scratch, sliding_window, device)


def _ragged(entries: list[ForwardEntry], scratch: int, sliding_window: int | None, device) -> tuple:
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
    same_columns = all(e.start == entries[0].start and len(e.token_ids) == T for e in entries)  # no padding
    batch = AttentionBatch(
        attn_mask=mask[:, None].to(device),  # [B, 1, T, S]
        slot_ids=torch.tensor(slots, device=device),
        write_indices=write.to(device),
        num_keys=S,
        slot_range=(slots[0], slots[0] + B) if contiguous else None,
        write_start=entries[0].start if contiguous and same_columns else None,
        sees_all=bool(mask.all()),
    )
    return input_ids.to(device), positions.to(device), batch


def _one_chain(entry: ForwardEntry, device) -> tuple:
    """`build_attention` for one sequence whose tokens follow each other (batch-1 decode, chain
    verify, prefill): the same tensors from 4-5 ops instead of ~20 (measured in one process: 105-120 us by the general
    path, 20-35 us here, at 1 and 5 tokens)."""
    T, start = len(entry.token_ids), entry.start
    S = start + T
    positions = torch.arange(start, S)[None]  # [1, T], also the cache columns written
    if T == 1:  # the one token sees every column
        mask = torch.ones(1, 1, 1, S, dtype=torch.bool)
    else:  # token t sees columns up to its own
        mask = (torch.arange(S)[None, :] <= positions[0, :, None])[None, None]  # [1, 1, T, S]
    batch = AttentionBatch(attn_mask=mask.to(device), slot_ids=torch.tensor([entry.slot], device=device),
                           write_indices=positions.clone().to(device), num_keys=S, slot_range=(entry.slot, entry.slot + 1),
                           write_start=start, sees_all=T == 1)
    return torch.tensor([entry.token_ids], dtype=torch.long).to(device), positions.to(device), batch


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


@dataclasses.dataclass(frozen=True, slots=True)
class LengthGrouping:
    """Runs a ragged batch as one padded forward, or as length groups merged back in entry order."""

    overhead_tokens: int  # a forward's fixed cost in padded tokens (`forward_overhead_tokens`)
    alone_from: int | None = None  # entries of at least this many tokens run as forwards of their own

    @classmethod
    def for_device(cls, device, group: int = 1) -> "LengthGrouping":
        """On a CPU, an entry too wide for the cached attention kernel (its `group` x T query rows per KV
        head past `attention_cpu.max_rows`: a prompt) runs as its own forward. PyTorch's flash kernel,
        which serves it, rounds a row by the padded key count beside it, so prompts prefilled together
        decoded otherwise than alone (3 of 32 HumanEval prompts at 4 in flight, bf16 and W4A8, 128
        tokens); and the unpadded forwards measured no slower (2-core EPYC, 32 prompts in batches of
        4: W4A8 0.41 s apart against 0.47 s together, bf16 0.49 against 0.51)."""
        rows = attention_cpu.max_rows() if torch.device(device).type == "cpu" else None
        return cls(forward_overhead_tokens(device), None if rows is None else rows // group + 1)

    def run(self, entries: list[ForwardEntry], forward: Callable[[list[int]], Result],
            merge: Callable[[list[Result], list[list[int]]], Result] | None = None) -> Result | None:
        """forward(entry indices) per group; with several groups, merge(parts, groups) (None: no result)."""
        if len(entries) == 1:  # nothing to group (batch 1: every step's host work is a token's)
            return forward([0])
        lengths = [len(e.token_ids) for e in entries]
        if self.alone_from is not None and max(lengths) >= self.alone_from:
            groups = [[i] for i, n in enumerate(lengths) if n >= self.alone_from]
            rest = [i for i, n in enumerate(lengths) if n < self.alone_from]
            if rest:
                groups += [[rest[j] for j in group]
                           for group in length_groups([lengths[i] for i in rest], self.overhead_tokens)]
        else:
            groups = length_groups(lengths, self.overhead_tokens)
        if len(groups) == 1:
            return forward(groups[0])
        parts = [forward(group) for group in groups]
        return merge(parts, groups) if merge is not None else None
