"""Compiled kernels the engine builds on first use (C++ through PyTorch's extension builder).

`exact_cpu`: exact mode's width- and batch-invariant attention and position-keyed noise.
Depends on nothing in specdecode but `defaults` and `errors`, so models and sampling can use it.
"""
