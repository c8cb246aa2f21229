"""Medusa: K extra heads on the target's last hidden state (METHODS.md 2.4).

Head i (1-based) reads h_t, the final-normed hidden state at the last committed position,
and predicts token t+i+1: `h + SiLU(W_i h)` (W_i zero-initialised, so a fresh head starts
as the target's own next-token head), then the target's LM head (shared, which keeps a head
at d^2 parameters instead of d x V).

Drafts are deterministic (top-ranked tokens), so verification treats them as point masses:
exact under sampling too. With `tree_topk` 1 the draft is a chain (top-1 of every head);
with `tree_topk` > 1 it is a static tree: the `tree_num_nodes` paths of head ranks with the
highest prior score, prod_d 1 / (rank_d + 2), expanded from the top `tree_topk` of each head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.errors import ConfigError, ModelLoadError
from specdecode.spec.drafters.checkpoint import read_checkpoint, save_checkpoint
from specdecode.spec.proposer import Draft, ProposerBase, ProposerContext, register, resolve_drafter_dir
from specdecode.spec.tree import StaticTree


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # residual blocks start as the identity
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., d] -> per-head states [.., K, d] (feed to the target's LM head)."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks], dim=-2)


def save_heads(heads: MedusaHeads, out: Path, target_dir: Path, report: dict | None = None) -> None:
    config = {"architectures": ["SpecdecodeMedusaHeads"], "medusa_num_heads": heads.num_heads,
              "hidden_size": heads.blocks[0].in_features}
    save_checkpoint(heads.state_dict(), config, out, target_dir, report)


def load_heads(path: Path, dtype, device) -> MedusaHeads:
    config, state = read_checkpoint(path, "Medusa")
    try:
        heads = MedusaHeads(config["hidden_size"], config["medusa_num_heads"])
        heads.load_state_dict(state)
    except (KeyError, RuntimeError) as e:
        raise ModelLoadError(f"{path} is not a Medusa checkpoint: {e}") from None
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


@register("medusa")
class MedusaProposer(ProposerBase):
    draft_cost_prior = 0.1  # K small heads on the target's last hidden state
    supports_tree = True

    def __init__(self, ctx: ProposerContext):
        path = resolve_drafter_dir(ctx, f"{DEFAULT_MODEL_NAME}-medusa")
        self.heads = load_heads(path, ctx.dtype, ctx.device)
        depth = ctx.config.num_speculative_tokens
        if depth > self.heads.num_heads:
            raise ConfigError(f"speculative_config.num_speculative_tokens ({depth}) exceeds this Medusa "
                              f"checkpoint's {self.heads.num_heads} heads")
        if self.heads.blocks[0].in_features != ctx.target.config.hidden_size:
            raise ConfigError("speculative_config.model: the Medusa heads' hidden size does not match the target's")
        self.target = ctx.target
        self.device = ctx.device
        self.tree = StaticTree(depth, ctx.config.tree_topk, ctx.config.tree_num_nodes, ctx.device)
        self.max_tree_depth = self.tree.max_depth
        self.is_chain = ctx.config.tree_topk == 1
        self.p_min = ctx.config.draft_p_min

    def on_prefill(self, seqs, result) -> None:
        for b, seq in enumerate(seqs):
            seq.drafter_state["hidden"] = result.hidden[b, len(seq.prompt_token_ids) - 1]

    def on_commit(self, seqs, draft, verified, result) -> None:
        accepted = verified.num_accepted.tolist()
        path = verified.path.tolist() if verified.path is not None else None
        for b, seq in enumerate(seqs):
            row = accepted[b] if path is None else (0 if accepted[b] == 0 else 1 + path[b][accepted[b] - 1])
            seq.drafter_state["hidden"] = result.hidden[b, row]  # the last committed position's state

    def release(self, seq) -> None:
        seq.drafter_state.pop("hidden", None)

    @torch.inference_mode()
    def propose(self, seqs, max_tokens, sampling) -> Draft:
        hidden = torch.stack([s.drafter_state["hidden"] for s in seqs])  # [B, d]
        logits = self.target.compute_logits(self.heads(hidden))  # [B, K, V]
        tokens = self.tree.tokens(logits)  # [B, nodes]; a chain: every head's top token
        if not self.is_chain:
            return self.tree.draft(tokens, [m > 0 for m in max_tokens])
        n = tokens.shape[1]
        num = torch.tensor([min(m, n) for m in max_tokens], device=self.device)
        if self.p_min > 0:  # llama.cpp p_min: stop at the first head that is unsure of its top token
            sure = logits.softmax(dim=-1).amax(dim=-1)[:, :n] >= self.p_min  # [B, n]
            num = torch.minimum(num, sure.long().cumprod(dim=1).sum(dim=1))
        cols = torch.arange(n, device=self.device)[None, :]
        return Draft(torch.where(cols < num[:, None], tokens, -1), num)
