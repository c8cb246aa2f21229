"""A separate small LM as drafter (the target's tokenizer, its own KV cache)."""
