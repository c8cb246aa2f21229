"""Exact mode: speculation changes nothing but speed, bit for bit (README "Exact mode").
Its C++ kernels (invariant attention, keyed noise) live in `specdecode/kernels/exact_cpu`.

- `rows`: linear layers probed and tiled so a row never depends on the rows beside it;
- `noise`: the definition of the keyed noise;
- `bisect`: the per-op bisection tool that finds where two ways of computing a token differ.
"""
