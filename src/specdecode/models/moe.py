"""DeepSeek-V3's MoE block: grouped top-k routing over routed experts plus shared experts.

Routing (as the reference and HF compute it, in float32): sigmoid scores, plus a per-expert
score-correction bias for the choice only; experts are split into n_group groups, a group
scores the sum of its top-2, tokens choose among the best topk_group groups; the chosen
experts' un-biased scores are the weights, normalised if norm_topk_prob, times
routed_scaling_factor. Experts run as one batched pass per expert over the tokens routed to it
(no loop over tokens); weights keep the checkpoint's `mlp.experts.N.*` names.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.config import ModelConfig
from specdecode.models.layers import MLP


class TopkRouter(nn.Module):
    """`mlp.gate.weight` [E, d] and `mlp.gate.e_score_correction_bias` [E], kept in float32."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))
        # Training: DeepSeek-V3's auxiliary-loss-free balancing moves the bias by this much per
        # step towards the mean load (0 = frozen, always when serving).
        self.bias_update_rate = 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> weights [N, k] float32, experts [N, k] long, router logits [N, E] float32."""
        logits = x.float() @ self.weight.float().t()
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        N, E, G = x.shape[0], self.num_experts, self.n_group
        group_scores = choice.view(N, G, E // G).topk(min(2, E // G), dim=-1).values.sum(-1)  # [N, G]
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()  # [N, G]
        choice = choice.masked_fill(~group_mask[:, :, None].expand(N, G, E // G).reshape(N, E), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1, sorted=False).indices
        if self.training and self.bias_update_rate:
            with torch.no_grad():
                load = torch.bincount(experts.flatten(), minlength=E).float()
                self.e_score_correction_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts, logits


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.n_routed_experts))
        self.shared_experts = (MLP(config, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]."""
        flat = x.reshape(-1, x.shape[-1])  # [N, d]
        weights, experts, _ = self.gate(flat)  # [N, k]
        out = self.route(flat, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)

    def route(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for every token: assignments sorted by expert, one
        matmul pass per expert that has tokens, summed back per token in expert order."""
        k = experts.shape[1]
        order = experts.flatten().argsort(stable=True)  # [N * k] assignments, grouped by expert
        counts = torch.bincount(experts.flatten(), minlength=len(self.experts)).tolist()  # one host read per layer
        tokens = order // k
        inputs = flat[tokens]  # [N * k, d]
        outputs = [self.experts[e](part) for e, part in enumerate(inputs.split(counts)) if counts[e]]
        routed = torch.cat(outputs) * weights.flatten()[order, None]  # float32, as the reference weighs
        return torch.zeros_like(flat).index_add_(0, tokens, routed.to(flat.dtype))
