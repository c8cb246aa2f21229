"""draft_model: a 2-layer Llama with the target's width, distilled from the target's logits
(forward KL = soft cross-entropy against the target distribution). It starts from the
target itself: the embedding / LM head (tied, frozen: drafts must live in the target's
vocabulary anyway), the final norm, the attention of the target's first and last layers,
and the `intermediate_size` MLP neurons of those layers with the largest output norm.
Distillation then teaches two layers to imitate six.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specdecode.models.checkpoint import save_checkpoint
from specdecode.models.llama import LlamaForCausalLM
from specdecode.train.recipes.base import DrafterRecipe, distill_loss, target_logits

if TYPE_CHECKING:
    from specdecode.train.drafter import DrafterTrainConfig


def build_draft_model(target: LlamaForCausalLM, cfg: DrafterTrainConfig, train_tokens=None) -> LlamaForCausalLM:
    tc = target.config
    dc = dataclasses.replace(tc, num_hidden_layers=cfg.num_layers, intermediate_size=cfg.intermediate_size,
                             tie_word_embeddings=True)
    drafter = LlamaForCausalLM(dc)
    with torch.no_grad():
        drafter.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        drafter.model.norm.weight.copy_(target.model.norm.weight)
        # The first layers and the last one: the last layer shapes the output distribution most.
        sources = list(range(cfg.num_layers - 1)) + [tc.num_hidden_layers - 1]
        for layer, source in zip(drafter.model.layers, sources):
            src = target.model.layers[source]
            layer.self_attn.load_state_dict(src.self_attn.state_dict())
            layer.input_layernorm.load_state_dict(src.input_layernorm.state_dict())
            layer.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
            keep = src.mlp.down_proj.weight.norm(dim=0).topk(cfg.intermediate_size).indices  # strongest neurons
            layer.mlp.gate_proj.weight.copy_(src.mlp.gate_proj.weight[keep])
            layer.mlp.up_proj.weight.copy_(src.mlp.up_proj.weight[keep])
            layer.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight[:, keep])
    drafter.model.embed_tokens.weight.requires_grad_(False)  # tied with the LM head: the target's vocabulary
    return drafter


def draft_model_predict(drafter: LlamaForCausalLM, target: LlamaForCausalLM, window: torch.Tensor):
    B, T = window.shape
    out = drafter(window, torch.arange(T, device=window.device).expand(B, T))
    return drafter.compute_logits(out.hidden), target_logits(target, window)


def draft_model_loss(drafter, target, window) -> torch.Tensor:
    return distill_loss(*draft_model_predict(drafter, target, window))


def export_draft_model(drafter: LlamaForCausalLM, target: LlamaForCausalLM, cfg: DrafterTrainConfig, report: dict) -> None:
    state = {k: v for k, v in drafter.state_dict().items() if k != "lm_head.weight"}  # tied
    save_checkpoint(state, drafter.config.to_hf_dict(), cfg.out_dir, cfg.target, report)


DRAFT_MODEL = DrafterRecipe(build_draft_model, draft_model_loss, draft_model_predict, export_draft_model)
