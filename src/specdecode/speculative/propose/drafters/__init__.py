"""Built-in drafter families, one sub-package each: the network in `model.py`, the proposer in
`proposer.py`. `specdecode.speculative.propose.builtin` registers them all."""
