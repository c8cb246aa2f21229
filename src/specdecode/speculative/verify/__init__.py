"""Lossless verification: chain rule, tree walk, KV compaction. Pure functions of drafts and logits."""
