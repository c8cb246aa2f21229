"""Built-in drafter families, one sub-package each (network in `model.py`, proposer in
`proposer.py`); importing this package registers every method by name."""

from specdecode.speculative.propose.drafters.dflash import proposer as _dflash  # noqa: F401
from specdecode.speculative.propose.drafters.draft_model import proposer as _draft_model  # noqa: F401
from specdecode.speculative.propose.drafters.dspark import proposer as _dspark  # noqa: F401
from specdecode.speculative.propose.drafters.eagle import proposer as _eagle  # noqa: F401
from specdecode.speculative.propose.drafters.medusa import proposer as _medusa  # noqa: F401
from specdecode.speculative.propose.drafters.ngram import proposer as _ngram  # noqa: F401
