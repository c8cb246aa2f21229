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

import heapq

import torch

from specdecode.sampling import SamplingBatch, exponential_noise, process_logits
from specdecode.spec.proposer import Draft
from specdecode.spec.verify import Verified


def static_tree(num_heads: int, topk: int, num_nodes: int) -> list[tuple[int, ...]]:
    """Paths of head ranks (rank of head 1, rank of head 2, ...) with the highest prior
    prod 1/(rank+2), parents before children. topk 1 gives the chain (0,), (0, 0), ..."""
    def score(path):
        out = 1.0
        for r in path:
            out /= r + 2
        return out

    chosen, frontier = [], [(-score((r,)), (r,)) for r in range(topk)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < num_nodes:
        _, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < num_heads:
            for r in range(topk):
                heapq.heappush(frontier, (-score(path + (r,)), path + (r,)))
    return sorted(chosen, key=lambda p: (len(p), p))  # by depth: parents come first


class StaticTree:
    """A fixed candidate tree over K independent per-position distributions (Medusa's heads,
    DFlash's block positions): node i carries rank paths[i][-1] of position len(paths[i]).
    Its shape never depends on the target, so point-mass verification is exact."""

    def __init__(self, depth: int, topk: int, num_nodes: int, device):
        self.paths = static_tree(depth, topk, num_nodes)
        index = {p: i for i, p in enumerate(self.paths)}
        self.parents = [index.get(p[:-1], -1) for p in self.paths]
        self.max_depth = max(len(p) for p in self.paths)
        self.topk = topk
        self.device = device
        self.node_position = torch.tensor([len(p) - 1 for p in self.paths], device=device)  # [n]
        self.node_rank = torch.tensor([p[-1] for p in self.paths], device=device)  # [n]

    def tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, K, V] -> node tokens [B, n]."""
        ranked = logits.topk(self.topk, dim=-1).indices  # [B, K, topk]
        return ranked[:, self.node_position, self.node_rank]

    def draft(self, tokens: torch.Tensor, drafting: list[bool]) -> Draft:
        """tokens [B, n] (from `tokens`) as a tree draft; rows not drafting get no nodes. Trees
        deeper than a sequence's room are dropped by the speculator (that row decodes normally)."""
        B, n = tokens.shape
        parents = torch.tensor(self.parents, device=self.device).expand(B, n).clone()
        num = torch.tensor([n if d else 0 for d in drafting], device=self.device)
        return Draft(tokens, num, parents=parents)


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
) -> tuple[Verified, torch.Tensor]:
    """Returns Verified (token_ids [B, max_depth + 1], -1 padded) and the accepted nodes
    path [B, max_depth] (node indices along the accepted path, -1 padded)."""
    B, n = token_ids.shape
    V = target_logits.shape[-1]
    device = target_logits.device
    if sampling.all_greedy:
        draws = target_logits.argmax(dim=-1)  # [B, n + 1] the target's token after each node
    else:
        rows = sampling.repeat_rows([n + 1] * B)
        probs = process_logits(target_logits.reshape(B * (n + 1), V), rows).view(B, n + 1, V)
        # One noise row per depth level and sequence: level d's draw is used at the depth-d node.
        noise = exponential_noise(B * (max_depth + 1), V, sampling.repeat_rows([max_depth + 1] * B).generators, device)
        noise = noise.view(B, max_depth + 1, V)
        greedy = target_logits.argmax(dim=-1)  # [B, n + 1]
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


def compact_accepted(kv_cache, slot_ids: torch.Tensor, starts: torch.Tensor, path: torch.Tensor,
                     num_accepted: torch.Tensor) -> None:
    """Move the K/V of accepted tree nodes to the columns a chain would have used.

    Node i was written at column start + 1 + i; the j-th accepted node belongs at
    start + 1 + j. Positions (RoPE) were depth-based, so the moved K/V are already right.
    """
    depth = path.shape[1]
    if depth == 0:
        return
    j = torch.arange(depth, device=path.device)[None, :]
    valid = j < num_accepted[:, None]
    src = starts[:, None] + 1 + torch.where(valid, path, j)  # unmatched entries copy onto themselves
    dst = starts[:, None] + 1 + j
    kv_cache.copy_columns(slot_ids, src, dst)
