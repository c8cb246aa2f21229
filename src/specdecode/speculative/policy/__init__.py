"""Depth and verification policies: p_min / n_min, heuristic, auto-k, D-Cut, estimators, cost profile."""
