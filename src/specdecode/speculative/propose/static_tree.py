"""Static candidate trees over K independent per-position distributions (Medusa heads,
DFlash block positions). A tree's shape never depends on the target, so the point-mass
tree walk in `speculative/verify/tree.py` verifies it exactly."""

from __future__ import annotations

import heapq

import torch

from specdecode.speculative.propose.proposer import Draft


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
