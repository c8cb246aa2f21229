"""The drafter contract: `Proposer` protocol, the `Draft` it returns, and the registry.

A method registers its proposer class by name with `@register("name")`; the engine builds
whatever `speculative_config.method` names and never branches on it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from specdecode.config import SpeculativeConfig
    from specdecode.engine.runner import ForwardResult
    from specdecode.engine.sequence import Sequence
    from specdecode.models.llama import LlamaForCausalLM
    from specdecode.sampling import SamplingBatch
    from specdecode.spec.verify import Verified
    from specdecode.tokenizer import Tokenizer


@dataclasses.dataclass(slots=True)
class Draft:
    token_ids: torch.Tensor  # [B, k] int64, padded with -1
    num_tokens: torch.Tensor  # [B] int64 drafts per sequence (0 = decode normally this step)
    probs: torch.Tensor | None = None  # [B, k, V] processed draft distribution q; None = one-hot drafts
    confidence: torch.Tensor | None = None  # [B, k] drafter's estimate that each token is accepted
    parents: torch.Tensor | None = None  # [B, k] tree drafts: parent node (-1 root, -2 padding); None = chain

    @classmethod
    def empty(cls, batch_size: int, device) -> "Draft":
        return cls(torch.full((batch_size, 0), -1, dtype=torch.long, device=device),
                   torch.zeros(batch_size, dtype=torch.long, device=device))

    def truncate(self, limits: list[int]) -> "Draft":
        """Keep at most limits[b] tokens (tree: nodes) of sequence b; what is kept is unchanged."""
        limit = torch.tensor(limits, dtype=torch.long, device=self.num_tokens.device)
        num = torch.minimum(self.num_tokens, limit)
        k = int(max(limits)) if limits else 0
        k = min(k, self.token_ids.shape[1])
        cols = torch.arange(k, device=self.token_ids.device)[None, :]
        token_ids = torch.where(cols < num[:, None], self.token_ids[:, :k], torch.full_like(self.token_ids[:, :k], -1))
        probs = self.probs[:, :k] if self.probs is not None else None
        confidence = self.confidence[:, :k] if self.confidence is not None else None
        # A prefix of a tree's node list is a tree (parents precede children).
        parents = None
        if self.parents is not None:
            parents = torch.where(cols < num[:, None], self.parents[:, :k], torch.full_like(self.parents[:, :k], -2))
        return Draft(token_ids, num, probs, confidence, parents)

    def drop_rows(self, rows: list[int]) -> "Draft":
        """The same draft with no tokens for the given sequences (they decode normally)."""
        if not rows:
            return self
        index = torch.tensor(rows, device=self.num_tokens.device)
        num = self.num_tokens.clone()
        num[index] = 0
        token_ids = self.token_ids.clone()
        token_ids[index] = -1
        parents = None
        if self.parents is not None:
            parents = self.parents.clone()
            parents[index] = -2
        return Draft(token_ids, num, self.probs, self.confidence, parents)


@dataclasses.dataclass(slots=True)
class ProposerContext:
    """What a proposer may use of the target engine."""

    config: "SpeculativeConfig"
    target: "LlamaForCausalLM"
    target_dir: Path
    tokenizer: "Tokenizer"
    num_slots: int
    max_len: int
    dtype: torch.dtype
    device: torch.device


class Proposer(Protocol):
    hidden_taps: tuple[int, ...]  # target layers whose hidden states this drafter reads (HF numbering)
    max_tree_depth: int  # tree drafters: the deepest node they ever propose (0 for chain drafters)
    # Set by the speculator where a depth policy prunes while drafting (D-Cut); autoregressive
    # chain drafters pass it to ChainDraft. None: draft up to max_tokens.
    draft_stop: "Callable[[int, list[list[float]], list[int]], list[int]] | None"

    def __init__(self, ctx: ProposerContext) -> None: ...

    def propose(self, seqs: list["Sequence"], max_tokens: list[int], sampling: "SamplingBatch") -> Draft:
        """Draft at most max_tokens[b] tokens after each sequence's committed tokens."""

    def on_prefill(self, seqs: list["Sequence"], result: "ForwardResult") -> None:
        """The target just prefilled these sequences (result holds its taps)."""

    def on_commit(self, seqs: list["Sequence"], draft: Draft, verified: "Verified", result: "ForwardResult") -> None:
        """Sync drafter state with what was committed (before tokens are appended)."""

    def pending_tokens(self, seq: "Sequence") -> int:
        """Committed tokens the drafter must catch up on before its next draft (prices drafting)."""

    def release(self, seq: "Sequence") -> None:
        """The sequence finished or was aborted: drop per-request state."""


PROPOSERS: dict[str, type] = {}


def register(name: str):
    def wrap(cls):
        PROPOSERS[name] = cls
        cls.method_name = name
        return cls

    return wrap


class ProposerBase:
    """No-op hooks for proposers that keep no per-step state."""

    hidden_taps: tuple[int, ...] = ()
    max_tree_depth: int = 0
    draft_stop = None
    # Prior cost of one drafting step as a fraction of the target's one-token step at the same
    # batch size (auto-k and D-Cut use it until drafting has been measured): a small model's share.
    draft_cost_prior: float = 0.5

    def pending_tokens(self, seq) -> int:
        """Committed tokens the drafter has not consumed yet: its next proposal feeds them all
        first (the whole prompt, the first time). Stateless drafters have none."""
        return 0

    def on_prefill(self, seqs, result) -> None:
        pass

    def on_commit(self, seqs, draft, verified, result) -> None:
        pass

    def release(self, seq) -> None:
        pass


def resolve_drafter_dir(ctx: ProposerContext, default_name: str) -> Path:
    """speculative_config.model, or the drafter shipped for this method with the default model."""
    from specdecode.defaults import is_default_model, models_dir
    from specdecode.errors import ConfigError

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
    from specdecode.errors import TokenizerMismatchError
    from specdecode.tokenizer import Tokenizer

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
