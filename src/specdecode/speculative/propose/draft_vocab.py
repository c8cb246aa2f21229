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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import ConfigError
from specdecode.models.inference import select_output_rows

FREQUENCIES_FILE = "token_frequencies.json"


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


def draft_head(ctx, head: nn.Module, token_ids: torch.Tensor | None = None) -> nn.Module:
    """The head a drafter drafts with, giving logits over the target's whole vocabulary.

    `head` scores `token_ids` (None: every token of the target's vocabulary, in order). With
    speculative_config.draft_vocab_size set below its width, only the rows of the most frequent
    tokens are kept (served as `head` is: packed, or quantised with its stored values)."""
    vocab_size = ctx.target.config.vocab_size
    size = ctx.config.draft_vocab_size
    ids = token_ids if token_ids is not None else torch.arange(vocab_size, device=ctx.device)
    if size is not None and size < len(ids):
        path = ctx.config.draft_vocab_frequencies or ctx.target_dir / FREQUENCIES_FILE
        if not Path(path).is_file():
            raise ConfigError(f"speculative_config.draft_vocab_size needs token counts: {str(path)!r} does not exist; "
                              "write it with `specdecode token-frequencies --model <target> --out <file>` and name it "
                              "in draft_vocab_frequencies")
        keep = most_frequent(load_frequencies(path, vocab_size).to(ids.device), ids, size)
        head, ids = select_output_rows(head, keep, ctx.dtype), ids[keep]
    if token_ids is None and len(ids) == vocab_size:
        return head
    return ReducedHead(head, ids, vocab_size)
