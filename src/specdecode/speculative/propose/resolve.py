"""Where a drafter's checkpoint comes from, and whether it speaks the target's vocabulary."""

from __future__ import annotations

from pathlib import Path

from specdecode.defaults import is_default_model, models_dir
from specdecode.errors import ConfigError, TokenizerMismatchError
from specdecode.speculative.propose.proposer import ProposerContext
from specdecode.tokenizer import Tokenizer


def resolve_drafter_dir(ctx: ProposerContext, default_name: str) -> Path:
    """speculative_config.model, or the drafter shipped for this method with the default model."""
    method = ctx.config.method
    if ctx.config.model is not None:
        path = Path(ctx.config.model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"speculative_config.model {str(path)!r} is not a checkpoint directory (no config.json)")
        return path
    if not is_default_model(ctx.target_dir):
        raise ConfigError(f"speculative_config.model is required for method {method!r}: drafters are shipped "
                          "only for the embedded default model")
    path = models_dir() / default_name
    if not (path / "config.json").is_file():
        raise ConfigError(f"the shipped {method!r} drafter is missing at {path}; train it with "
                          f"`specdecode train-drafter --method {method}` or pass speculative_config.model")
    return path


def check_same_vocabulary(drafter_dir: Path, drafter_vocab_size: int, ctx: ProposerContext) -> None:
    """A drafter must speak the target's vocabulary: same size, same token -> id map."""
    if drafter_vocab_size != ctx.target.config.vocab_size:
        raise TokenizerMismatchError(
            f"speculative_config.model: the drafter's vocab_size is {drafter_vocab_size}, the target's is "
            f"{ctx.target.config.vocab_size}; a drafter must use the target's tokenizer")
    if (drafter_dir / "tokenizer.json").is_file():
        drafter_vocab = Tokenizer(drafter_dir)._tok.get_vocab()
        if drafter_vocab != ctx.tokenizer._tok.get_vocab():
            raise TokenizerMismatchError(
                "speculative_config.model: the drafter's tokenizer.json maps tokens differently from the "
                "target's; a drafter must use the target's tokenizer")
