"""n-gram prompt lookup (model-free)."""
