"""Proposing drafts: the contract, the registry, chain and tree building, and the drafter families."""
