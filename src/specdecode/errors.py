"""The project's own exception types.

Every error a user can cause (bad checkpoint, bad config, bad request) is one of these,
with a message that names the problem and what would be accepted. The server maps them to
OpenAI-style error JSON (see server/), so a client never sees a traceback.
"""


class SpecDecodeError(Exception):
    """Base class of every error specdecode raises on purpose."""


class ModelLoadError(SpecDecodeError):
    """A checkpoint directory is missing, incomplete or corrupt."""


class UnsupportedModelError(SpecDecodeError):
    """The checkpoint is readable but its architecture or options are not supported."""


class TokenizerMismatchError(SpecDecodeError):
    """A tokenizer (or drafter) does not fit the model's vocabulary."""


class ConfigError(SpecDecodeError, ValueError):
    """A configuration key has a bad value, or is unknown."""


class InvalidRequestError(SpecDecodeError, ValueError):
    """A request cannot be served as given (prompt too long, bad sampling values, ...)."""


class DrafterMismatchError(ConfigError, TokenizerMismatchError):
    """speculative_config.model was built for another target: its hidden size, vocabulary or
    token map, the target layers it taps, or ids it uses do not fit this one. Raised when the
    `LLM` is built, before any request runs."""


class CapacityError(SpecDecodeError):
    """A request can never fit the configured KV-cache memory, even when running alone."""
