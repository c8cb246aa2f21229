"""EAGLE-2 dynamic draft trees, expanded level by level inside a feature drafter's own cache.

Each level feeds the K frontier nodes of every row as one ragged drafter forward whose
`tree_mask` lets a node see its ancestors (columns written by earlier levels) and itself.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdecode.engine.ragged import ForwardEntry
from specdecode.speculative.propose.proposer import Draft


class TreeDrafter(Protocol):
    def tree_root(self, seqs, active: list[int]) -> torch.Tensor:
        """Catch up on the committed positions; the drafter's output at the last one [A, d]."""

    def tree_level(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        """One level: K nodes per row (features[a] [K, d]) -> outputs [A, K, d]."""

    def vocab_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Outputs [.., d] -> logits over the target vocabulary [.., V]."""


def propose_dynamic_tree(drafter: TreeDrafter, seqs, max_tokens: list[int], topk: int, depth: int, num_nodes: int,
                         device) -> Draft:
    """EAGLE-2 dynamic tree: expand the global top-k frontier (by cumulative log-probability)
    for `depth` levels, then keep the best `num_nodes` nodes. Scores never increase along a
    path, so the kept set is a tree. Children are the drafter's top-k tokens, chosen
    deterministically: the verifier treats them as point masses (exact under sampling)."""
    B, K, D = len(seqs), topk, depth
    active = [b for b in range(B) if max_tokens[b] > 0]
    if not active:
        return Draft.empty(B, device, tree=True)
    o_root = drafter.tree_root(seqs, active)  # [A, d]
    A = len(active)
    scores, tokens = torch.log_softmax(drafter.vocab_logits(o_root), dim=-1).topk(K)  # [A, K]
    all_tokens, all_scores, all_parents, all_depths = [tokens], [scores], [torch.full((A, K), -1)], [1] * K
    frontier_index = torch.arange(K).expand(A, K)  # node indices of the frontier
    frontier_feat = o_root[:, None, :].expand(A, K, o_root.shape[-1])
    ancestors = torch.zeros(A, K, 0, dtype=torch.bool)  # [A, K, written] drafter columns each frontier node sees
    written, num_made = 0, K
    base = [seqs[b].num_tokens - 1 for b in active]  # first drafter column past the committed ones
    for d in range(1, D):
        token_host = tokens.tolist()
        entries = [ForwardEntry(seqs[b].slot, token_host[a], start=base[a] + written,
                                positions=[base[a] - 1 + d] * K,
                                tree_mask=torch.cat([ancestors[a], torch.eye(K, dtype=torch.bool)], dim=1))
                   for a, b in enumerate(active)]
        o = drafter.tree_level(entries, [frontier_feat[a] for a in range(A)])  # [A, K, d]
        child_scores, child_tokens = torch.log_softmax(drafter.vocab_logits(o), dim=-1).topk(K)  # [A, K, K]
        cumulative = (scores[:, :, None] + child_scores).reshape(A, K * K)
        all_tokens.append(child_tokens.reshape(A, K * K))
        all_scores.append(cumulative)
        all_parents.append(frontier_index.cpu()[:, :, None].expand(A, K, K).reshape(A, K * K))
        all_depths += [d + 1] * (K * K)
        scores, pick = cumulative.topk(K)  # the next frontier: global top-k of this level
        parent_slot = (pick // K).cpu()
        tokens = child_tokens.reshape(A, K * K).gather(1, pick)
        frontier_index = num_made + pick.cpu()
        frontier_feat = o.gather(1, (pick // K)[:, :, None].expand(-1, -1, o.shape[-1]))
        own_column = torch.nn.functional.one_hot(parent_slot, K).bool()  # the parent's column in this level
        ancestors = torch.cat([ancestors.gather(1, parent_slot[:, :, None].expand(-1, -1, written)), own_column], dim=2)
        written += K
        num_made += K * K
    return select_tree(torch.cat(all_tokens, 1), torch.cat(all_scores, 1), torch.cat(all_parents, 1),
                       torch.tensor(all_depths), active, B, num_nodes, device)

def select_tree(tokens, scores, parents, depths, active: list[int], B: int, num_nodes: int, device) -> Draft:
    """Best `num_nodes` nodes by score (ties: shallower first), ordered by depth."""
    A, M = tokens.shape
    n = min(num_nodes, M)
    keep = (scores.cpu() - 1e-6 * depths[None, :]).topk(n).indices  # [A, n]
    order = torch.argsort(depths[keep] * M + keep, dim=1)  # by depth, so parents precede children
    keep = keep.gather(1, order)
    new_position = torch.full((A, M), -2, dtype=torch.long)
    new_position.scatter_(1, keep, torch.arange(n).expand(A, n))
    kept_parents = parents.gather(1, keep)
    remapped = torch.where(kept_parents >= 0, new_position.gather(1, kept_parents.clamp(min=0)), kept_parents)
    out_tokens = torch.full((B, n), -1, dtype=torch.long)
    out_parents = torch.full((B, n), -2, dtype=torch.long)
    num = torch.zeros(B, dtype=torch.long)
    rows = torch.tensor(active)
    out_tokens[rows] = tokens.cpu().gather(1, keep)
    out_parents[rows] = remapped
    num[rows] = n
    return Draft(out_tokens.to(device), num.to(device), parents=out_parents.to(device))
