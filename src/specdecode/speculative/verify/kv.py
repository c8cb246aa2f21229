"""KV-cache compaction after a tree verification: the accepted path's K/V move to the
columns a chain would have used, so the cache again holds exactly the committed prefix."""

from __future__ import annotations

import torch


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
