"""The vocabulary a drafter drafts over, and the LM-head rows that score it.

Every learned drafter ends in an LM head over the target's vocabulary (EAGLE, MTP, Medusa,
DFlash, DSpark, a draft model), or, for EAGLE-3, over its own reduced draft vocabulary (d2t).
On the default model that head (512 -> 8,192) is the largest matmul of a drafting step.
FR-Spec (METHODS.md; Zhao et al., 2025) drafts over the most frequent tokens only: the head
computes those rows, every other token gets -inf, so the drafter never proposes it.
Verification is untouched, so outputs are identical; only acceptance can drop (a rare token
the target picks is never drafted).

`speculative_config.draft_vocab_size = N` keeps the N most frequent tokens (of EAGLE-3's own
draft vocabulary, the N most frequent of those), ranked by the token counts in
`draft_vocab_frequencies` (default: `token_frequencies.json` beside the target's weights,
written by `specdecode token-frequencies`).

Greedy and sampled proposals draft with separate heads (`DraftHeads`): an all-greedy proposal is
verified by token equality, and the target's argmax is almost always a frequent token, so FR-Spec
cost MTP and the draft model no acceptance in any measurement here (EAGLE-3 at most 0.02 tokens of
mean acceptance length); a sampled one draws from q, and dropping the rare
tokens' mass lowered acceptance more than the cheaper head gained. `greedy_draft_vocab_size`
sizes the greedy head (unset: draft_vocab_size, else the method's measured default,
`DEFAULT_GREEDY_DRAFT_VOCAB_SIZE`, where token counts are at hand).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import ConfigError
from specdecode.models.inference import select_output_rows

FREQUENCIES_FILE = "token_frequencies.json"

# greedy_draft_vocab_size where the config leaves it and draft_vocab_size unset and token counts are
# at hand: the sizes measured faster than the full head at T = 0 on HumanEval and MT-Bench at equal
# acceptance (bf16, default model, BENCHMARKS.md twenty-second to twenty-fifth passes: MTP and the
# draft model, 2,048 of 8,192 tokens). EAGLE-3 drafts over its own 4,096-token head, where 2,048
# gained within the noise; Medusa, DFlash and DSpark were not measured.
DEFAULT_GREEDY_DRAFT_VOCAB_SIZE = {"mtp": 2048, "draft_model": 2048}


class ReducedHead(nn.Module):
    """An LM head over `token_ids` [n] of a `vocab_size` vocabulary, a drop-in for the full one:
    x [N, d] -> [N, vocab_size], its rows' logits at their token ids, -inf at every other id."""

    def __init__(self, rows: nn.Module, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.rows = rows
        self.register_buffer("token_ids", token_ids)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.rows(x)  # [N, n]
        out = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, scores)

    def extra_repr(self) -> str:
        return f"{len(self.token_ids)} of {self.vocab_size} tokens"


def load_frequencies(path: Path, vocab_size: int) -> torch.Tensor:
    """Token counts [vocab_size] int64 from a `specdecode token-frequencies` file."""
    try:
        data = json.loads(Path(path).read_text())
        counts = torch.tensor(data["counts"], dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"speculative_config.draft_vocab_frequencies: {str(path)!r} is not a token-frequencies "
                          f"file ({type(e).__name__}: {e}); write one with `specdecode token-frequencies`") from None
    if counts.shape != (vocab_size,):
        raise ConfigError(f"speculative_config.draft_vocab_frequencies: {str(path)!r} counts {counts.numel()} tokens, "
                          f"the target's vocabulary has {vocab_size}")
    return counts


def most_frequent(counts: torch.Tensor, token_ids: torch.Tensor, size: int) -> torch.Tensor:
    """Positions in `token_ids` of its `size` most frequent tokens, in ascending order (ties: lower position)."""
    order = torch.sort(-counts[token_ids], stable=True).indices
    return order[:size].sort().values


@dataclasses.dataclass(frozen=True)
class DraftHeads:
    """The heads a drafter scores with (the same module where both sizes agree)."""

    sampled: nn.Module  # proposals that draw or adjust tokens (speculative_config.draft_vocab_size)
    greedy: nn.Module  # all-greedy, unadjusted proposals (greedy_draft_vocab_size)

    def pick(self, greedy: bool) -> nn.Module:
        """The head for a proposal, `greedy` where it is all-greedy and unadjusted (`ChainDraft.one_hot`)."""
        return self.greedy if greedy else self.sampled


def draft_heads(ctx, head: nn.Module, token_ids: torch.Tensor | None = None) -> DraftHeads:
    """The heads a drafter drafts with, each giving logits over the target's whole vocabulary.

    `head` scores `token_ids` (None: every token of the target's vocabulary, in order). A size below
    its width keeps only the rows of the most frequent tokens (served as `head` is: packed, or
    quantised with its stored values)."""
    path = Path(ctx.config.draft_vocab_frequencies or ctx.target_dir / FREQUENCIES_FILE)
    sampled_size = ctx.config.draft_vocab_size
    greedy_size = ctx.config.greedy_draft_vocab_size
    if greedy_size is None:
        greedy_size = sampled_size
        if greedy_size is None and path.is_file():
            greedy_size = DEFAULT_GREEDY_DRAFT_VOCAB_SIZE.get(ctx.config.method)
    ids = token_ids if token_ids is not None else torch.arange(ctx.target.config.vocab_size, device=ctx.device)
    kept = [size if size and size < len(ids) else None for size in (sampled_size, greedy_size)]
    sampled = _draft_head(ctx, head, token_ids, ids, kept[0], path, "draft_vocab_size")
    if kept[1] == kept[0]:
        return DraftHeads(sampled, sampled)
    return DraftHeads(sampled, _draft_head(ctx, head, token_ids, ids, kept[1], path, "greedy_draft_vocab_size"))


def _draft_head(ctx, head: nn.Module, token_ids: torch.Tensor | None, ids: torch.Tensor, size: int | None,
                path: Path, key: str) -> nn.Module:
    """`head` over its `size` most frequent tokens of `ids` (None: all of them); `key` sized it."""
    vocab_size = ctx.target.config.vocab_size
    if size is not None:
        if not path.is_file():
            raise ConfigError(f"speculative_config.{key} needs token counts: {str(path)!r} does not exist; "
                              "write it with `specdecode token-frequencies --model <target> --out <file>` and name it "
                              "in draft_vocab_frequencies")
        keep = most_frequent(load_frequencies(path, vocab_size).to(ids.device), ids, size)
        head, ids = select_output_rows(head, keep, ctx.dtype), ids[keep]
    if token_ids is None and len(ids) == vocab_size:
        return head
    return ReducedHead(head, ids, vocab_size)
