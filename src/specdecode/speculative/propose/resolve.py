"""Where a drafter's checkpoint comes from, and whether it was built for this target (width,
vocabulary and token map, tapped layers, token ids)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specdecode.defaults import is_default_model, models_dir
from specdecode.errors import ConfigError, DrafterMismatchError
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


def check_fits_target(ctx: ProposerContext, drafter_dir: Path, *, hidden_size: int | None = None,
                      vocab_size: int | None = None, taps: dict[str, Sequence[int]] | None = None,
                      token_ids: dict[str, Sequence[int]] | None = None) -> None:
    """A learned drafter must have been built for this target; each family passes what its
    checkpoint declares, and a mismatch is a `DrafterMismatchError` (a ConfigError) naming it:
    - hidden_size: the width at which it reads the target's features or embeddings;
    - vocab_size: the vocabulary it speaks; its tokenizer.json, when it has one, must map every
      token to the target's id (`check_same_vocabulary`);
    - taps: config key -> the target hidden_states indices it reads, each in 0 .. num_hidden_layers;
    - token_ids: config key -> target token ids it uses (a mask id, draft-to-target ids), each < vocab_size."""
    target = ctx.target.config
    where = f"speculative_config.model {str(drafter_dir)!r}"
    if hidden_size is not None and hidden_size != target.hidden_size:
        raise DrafterMismatchError(f"{where} was built for a target with hidden_size {hidden_size}; this target's "
                                   f"hidden_size is {target.hidden_size}")
    check_same_vocabulary(drafter_dir, vocab_size, ctx)
    for key, layers in (taps or {}).items():
        outside = [i for i in layers if not 0 <= i <= target.num_hidden_layers]
        if outside:
            raise DrafterMismatchError(
                f"{where} reads target layers {key}={list(layers)}, but this target has {target.num_hidden_layers} "
                f"layers (hidden_states indices 0..{target.num_hidden_layers}): it was built for another target")
    for key, ids in (token_ids or {}).items():
        outside = [i for i in ids if not 0 <= i < target.vocab_size]
        if outside:
            raise DrafterMismatchError(f"{where}: {key} uses token id {outside[0]}, outside this target's vocabulary "
                                       f"(vocab_size {target.vocab_size}): it was built for another target")


def check_same_vocabulary(drafter_dir: Path, drafter_vocab_size: int | None, ctx: ProposerContext) -> None:
    """A drafter must speak the target's vocabulary: same size (when it declares one), same
    token -> id map (when it has a tokenizer.json)."""
    where = f"speculative_config.model {str(drafter_dir)!r}"
    if drafter_vocab_size is not None and drafter_vocab_size != ctx.target.config.vocab_size:
        raise DrafterMismatchError(f"{where}: the drafter's vocab_size is {drafter_vocab_size}, the target's is "
                                   f"{ctx.target.config.vocab_size}; a drafter must use the target's tokenizer")
    if (drafter_dir / "tokenizer.json").is_file():
        ours, theirs = ctx.tokenizer._tok.get_vocab(), Tokenizer(drafter_dir)._tok.get_vocab()
        if theirs != ours:
            token = next((t for t in ours if theirs.get(t) != ours[t]), None) or next(t for t in theirs if t not in ours)
            raise DrafterMismatchError(
                f"{where}: the drafter's tokenizer.json maps tokens differently from the target's (token {token!r}: "
                f"id {theirs.get(token)} there, {ours.get(token)} in the target's); a drafter must use the "
                "target's tokenizer")
