"""Token trees: attention masks, positions and lossless verification.

A tree draft for one sequence is a list of nodes 0..n-1 with `parents[i]` in {-1 (the
root = the sequence's last committed token), 0..i-1} and a token each. The target sees
[root, node 0, ..., node n-1] in one forward: node i attends to the committed prefix and to
its ancestors only (`tree_attention_mask`), at RoPE position root + depth(i).

Verification walks down from the root. At the current node the target's next token y is
drawn exactly as plain decoding would draw it (argmax at temperature 0; a sample from the
processed distribution otherwise). If a child of the node carries y, that child is
accepted and the walk continues there; otherwise y is committed (recovered token) and the
step ends; at a leaf, y is the bonus token. Every committed token is thus a draw from the
target given the committed prefix, so the output distribution is the target's: this is
the point-mass form of multi-draft verification (METHODS.md section 1), exact for any tree
whose shape does not depend on the target's draws (deterministic top-k expansion, static
trees, chains).
"""

from __future__ import annotations

import torch

from specdecode.sampling import SamplingBatch, adjust_logits, argmax, process_logits, race_noise
from specdecode.speculative.verify.chain import Verified


def node_depths(parents: list[int]) -> list[int]:
    """Depth of every node (children of the root have depth 1); parents precede children."""
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool over [root, nodes...]: True where the row may attend the column
    (itself and its ancestors)."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        row = i + 1
        if p >= 0:
            mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask


def verify_tree(
    token_ids: torch.Tensor,  # [B, n] node tokens, -1 padded
    parents: torch.Tensor,  # [B, n] parent node index, -1 = root, padding nodes -2
    target_logits: torch.Tensor,  # [B, n + 1, V] at [root, node 0, ..., node n-1]
    sampling: SamplingBatch,
    max_depth: int,  # fixed per engine, so seeded rows draw the same noise whatever the batch
    rows: SamplingBatch | None = None,  # B * (n + 1) rows [root, nodes] with their path as context; None = repeats
) -> tuple[Verified, torch.Tensor]:
    """Returns Verified (token_ids [B, max_depth + 1], -1 padded) and the accepted nodes
    path [B, max_depth] (node indices along the accepted path, -1 padded). Each row is
    adjusted with its node's path as context (`rows`), as plain decoding would be there."""
    if token_ids.shape[1] == 0:  # no row drafted: one padding node that matches nothing
        token_ids = token_ids.new_full((token_ids.shape[0], 1), -1)
        parents = parents.new_full((parents.shape[0], 1), -2)
        target_logits = torch.cat([target_logits[:, :1], target_logits[:, :1]], dim=1)
        if rows is not None:
            rows = rows.select([b for b in range(token_ids.shape[0]) for _ in range(2)])
    B, n = token_ids.shape
    V = target_logits.shape[-1]
    device = target_logits.device
    if rows is not None and rows.adjusts:
        target_logits = adjust_logits(target_logits.reshape(B * (n + 1), V), rows).view(B, n + 1, V)
    if sampling.all_greedy:
        draws = argmax(target_logits)  # [B, n + 1] the target's token after each node
    else:
        rows = rows if rows is not None else sampling.repeat_rows([n + 1] * B)
        probs = process_logits(target_logits.reshape(B * (n + 1), V), rows).view(B, n + 1, V)
        # One noise row per depth level and sequence: level d's draw is used at the depth-d node
        # (keyed rows: the noise of position root + d, as plain decoding draws it).
        noise = race_noise(sampling.repeat_rows([max_depth + 1] * B), V).view(B, max_depth + 1, V)
        greedy = argmax(target_logits)  # [B, n + 1]
    current = torch.full((B,), -1, dtype=torch.long, device=device)  # -1 = root
    alive = torch.ones(B, dtype=torch.bool, device=device)
    out = torch.full((B, max_depth + 1), -1, dtype=torch.long, device=device)
    path = torch.full((B, max_depth), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    batch_index = torch.arange(B, device=device)
    for d in range(max_depth + 1):  # a loop over depth levels (few), not over tokens
        if sampling.all_greedy:
            y = draws[batch_index, current + 1]
        else:
            sampled = (probs[batch_index, current + 1] / noise[:, d]).argmax(dim=-1)  # [B] exponential race
            y = torch.where(sampling.temperature > 0, sampled, greedy[batch_index, current + 1])
        out[:, d] = torch.where(alive, y, out[:, d])
        if d == max_depth:
            break
        match = (parents == current[:, None]) & (token_ids == y[:, None]) & alive[:, None]  # [B, n]
        found = match.any(dim=1)
        child = match.long().argmax(dim=1)
        path[:, d] = torch.where(found, child, path[:, d])
        num_accepted += found.long()
        current = torch.where(found, child, current)
        alive = alive & found
    return Verified(out, num_accepted), path
