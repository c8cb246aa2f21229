"""Built-in proposers; importing this package registers them by method name."""

from specdecode.spec.drafters import draft_model, ngram  # noqa: F401
