"""DSpark: confidence-scheduled block drafting (DeepSeek DeepSpec; METHODS.md 2.8).

Backbone: the DFlash block pass (`drafters/dflash`). On top of it:
- Markov head, a rank-r bigram bias: logits_j = U_j + W2(W1[x_{j-1}]), drawn left to right, so
  position j sees the token drafted before it (x_0 = the anchor). q_j stays an exact softmax:
  standard rejection sampling applies.
- Confidence head: c_j = sigmoid(v . [h_j ; W1[x_{j-1}]]) estimates P(token j accepted | the
  earlier ones were). It reads the prefix only, never x_j itself, which is what lets the
  scheduler use it without biasing verification. Calibrated position by position (per-position
  temperature on the logit, fitted left to right on held-out data so that the cumulative product
  matches the measured survival).
- Scheduling: the calibrated confidences feed `confidence_threshold` (verify only the confident
  prefix) and `verify_pruning: "dcut"` (the DSpark / D-Cut batch scheduler in `speculative/policy`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from specdecode.models.checkpoint import save_checkpoint
from specdecode.speculative.propose.drafters.dflash.model import DFlashConfig, DFlashDrafter, load_block_drafter


@dataclasses.dataclass(slots=True)
class DSparkConfig:
    backbone: DFlashConfig
    markov_rank: int = 128
    confidence_temperatures: list[float] = dataclasses.field(default_factory=list)  # per draft position

    def to_json(self) -> dict:
        return {**self.backbone.to_json(), "architectures": ["SpecdecodeDSparkDrafter"],
                "dspark_config": {"markov_rank": self.markov_rank,
                                  "confidence_temperatures": list(self.confidence_temperatures)}}

    @classmethod
    def from_json(cls, data: dict) -> "DSparkConfig":
        extra = data["dspark_config"]
        return cls(DFlashConfig.from_json(data), extra["markov_rank"], list(extra["confidence_temperatures"]))


class DSparkDrafter(DFlashDrafter):
    def __init__(self, cfg: DSparkConfig, vocab_size: int):
        super().__init__(cfg.backbone)
        self.dspark = cfg
        d, r = cfg.backbone.layers.hidden_size, cfg.markov_rank
        self.markov_in = nn.Embedding(vocab_size, r)  # W1
        self.markov_out = nn.Linear(r, vocab_size, bias=False)  # W2, zero-initialised: starts as plain DFlash
        nn.init.zeros_(self.markov_out.weight)
        nn.init.normal_(self.markov_in.weight, 0.0, 0.02)
        self.confidence = nn.Linear(d + r, 1)

    def markov_logits(self, base_logits: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """U_j [.., V] + W2 W1[x_{j-1}] for previous tokens [..]."""
        return base_logits + self.markov_out(self.markov_in(previous)).float()

    def confidence_logit(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Raw logit of c_j from h_j [.., d] and x_{j-1} [..]."""
        return self.confidence(torch.cat([hidden, self.markov_in(previous).to(hidden.dtype)], dim=-1)).squeeze(-1).float()

    def calibrated(self, logit: torch.Tensor, position: int) -> torch.Tensor:
        """c_j with the fitted per-position temperature (position 0 = first draft)."""
        temps = self.dspark.confidence_temperatures
        t = temps[min(position, len(temps) - 1)] if temps else 1.0
        return torch.sigmoid(logit / t)


def save_dspark(drafter: DSparkDrafter, out: Path, target_dir: Path, report: dict | None = None) -> None:
    save_checkpoint(drafter.state_dict(), drafter.dspark.to_json(), out, target_dir, report)


def load_dspark(path: Path, dtype, device) -> DSparkDrafter:
    """The Markov head is as wide as the vocabulary the drafter was built for (its layers' config),
    so a drafter for another vocabulary loads and is then refused by the target fit check."""
    def build(config: dict) -> DSparkDrafter:
        cfg = DSparkConfig.from_json(config)
        return DSparkDrafter(cfg, cfg.backbone.layers.vocab_size)

    return load_block_drafter(path, "DSpark", build, dtype, device)
