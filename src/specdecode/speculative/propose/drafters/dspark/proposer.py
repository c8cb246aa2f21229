"""The DSpark proposer: DFlash's block pass, drawn left to right through the Markov head, with
calibrated confidences attached (prefix-only, so depth policies may use them losslessly)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.speculative.propose.drafters.dflash.proposer import DFlashProposer
from specdecode.speculative.propose.drafters.dspark.model import load_dspark
from specdecode.speculative.propose.registry import register


@register("dspark")
class DSparkProposer(DFlashProposer):
    supports_tree = False  # the Markov head makes each position depend on the token drawn before it

    def _load(self, ctx, path: Path):
        return load_dspark(path, ctx.dtype, ctx.device)

    default_checkpoint = f"{DEFAULT_MODEL_NAME}-dspark"

    def start_block(self, seqs, active: list[int]) -> torch.Tensor:
        """The previous token of every active row: x_0 = the anchor (last committed token)."""
        return torch.tensor([seqs[b].last_token_id for b in active], device=self.device)

    def draw_step(self, chain, rows, index, step, hidden, base, previous, sampling) -> None:
        """Markov-corrected q_j given the token drawn before it, then the calibrated confidence c_j."""
        prev = previous[index]
        chosen = chain.add_step(rows, step, self.drafter.markov_logits(base[index, step], prev), sampling)
        conf = self.drafter.calibrated(self.drafter.confidence_logit(hidden[index, step + 1], prev), step)
        chain.set_confidence(rows, step, conf.tolist())
        previous[index] = torch.tensor(chosen, device=self.device).clamp(min=0)
