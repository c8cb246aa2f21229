"""Built-in proposers; importing this package registers them by method name."""

from specdecode.spec.drafters import dflash, draft_model, dspark, eagle, medusa, ngram  # noqa: F401
