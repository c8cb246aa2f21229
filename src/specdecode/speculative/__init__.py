"""Speculative decoding in three parts: propose (drafters), verify (lossless rules), policy (depth)."""
