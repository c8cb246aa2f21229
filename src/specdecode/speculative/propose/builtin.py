"""Importing this module registers every built-in drafter family by method name.

It is separate from `drafters/__init__.py` so that importing one family's network (for
training or export) does not load every proposer.
"""

from specdecode.speculative.propose.drafters.dflash import proposer as _dflash  # noqa: F401
from specdecode.speculative.propose.drafters.draft_model import proposer as _draft_model  # noqa: F401
from specdecode.speculative.propose.drafters.dspark import proposer as _dspark  # noqa: F401
from specdecode.speculative.propose.drafters.eagle import proposer as _eagle  # noqa: F401
from specdecode.speculative.propose.drafters.medusa import proposer as _medusa  # noqa: F401
from specdecode.speculative.propose.drafters.ngram import proposer as _ngram  # noqa: F401
