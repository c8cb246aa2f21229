"""Interop with other engines' formats: GGUF (llama.cpp) and the speculators layout (vLLM)."""
