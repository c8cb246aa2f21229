"""Speculative-decoding statistics, in three layers like vLLM's:

1. per step: the verifier reports, per sequence, how many draft tokens it proposed and how
   many were accepted (`SpecStats.observe`);
2. per request: a `SpecStats` lives on each Sequence and is returned as `outputs[i].metrics`;
3. aggregate: the engine merges finished requests' stats; the server exports them as
   Prometheus counters (`specdecode:num_drafts`, ...), from which e.g.
   mean acceptance length = 1 + rate(num_accepted_tokens) / rate(num_drafts).

Definitions (see spec/verify.py for accepted / recovered / bonus):
- acceptance_rate = accepted draft tokens / proposed draft tokens;
- mean_acceptance_length = tokens committed per verification step, including the
  recovered/bonus token = 1 + accepted / num_drafts (vLLM's definition);
- per-position acceptance i = P(position i accepted | positions < i accepted)
  = accepted_per_position[i] / reached_per_position[i].
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification steps that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # [k] accepted at position i
    reached_per_position: list[int] = dataclasses.field(default_factory=list)  # [k] drafted with all earlier accepted
    draft_time: float = 0.0  # seconds spent proposing (shared batch time is split evenly)
    verify_time: float = 0.0  # seconds spent in the target's verify forward + verification

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._grow(num_draft_tokens)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
        for i in range(min(num_accepted + 1, num_draft_tokens)):
            self.reached_per_position[i] += 1

    def _grow(self, n: int) -> None:
        while len(self.accepted_per_position) < n:
            self.accepted_per_position.append(0)
            self.reached_per_position.append(0)

    def merge(self, other: "SpecStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.accepted_per_position))
        for i, (a, r) in enumerate(zip(other.accepted_per_position, other.reached_per_position)):
            self.accepted_per_position[i] += a
            self.reached_per_position[i] += r
        self.draft_time += other.draft_time
        self.verify_time += other.verify_time

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position)]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "draft_time": round(self.draft_time, 6),
            "verify_time": round(self.verify_time, 6),
        }

    def summary(self) -> str:
        per_pos = ", ".join(f"{x:.2f}" for x in self.per_position_acceptance)
        return (f"mean acceptance length {self.mean_acceptance_length:.2f}, acceptance rate "
                f"{self.acceptance_rate:.1%} ({self.num_accepted_tokens}/{self.num_draft_tokens} in "
                f"{self.num_drafts} drafts), per-position [{per_pos}]")
