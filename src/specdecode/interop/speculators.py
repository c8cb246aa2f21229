"""The speculators / vLLM EAGLE-3 checkpoint layout (METHODS.md 2.5): export ours, read theirs."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import ConfigError
from specdecode.models.checkpoint import save_checkpoint
from specdecode.models.config import ModelConfig
from specdecode.speculative.propose.drafters.eagle.model import EagleConfig, Eagle3Drafter, EagleDrafter


def is_speculators(config: dict) -> bool:
    return config.get("speculators_model_type") == "eagle3"


def _speculators_names(name: str) -> str:
    """Our EAGLE-3 parameter name -> the speculators layout's."""
    if name.startswith("layer."):
        return "layers.0." + name[len("layer."):]
    if name.startswith("hidden_norm."):
        return "layers.0.hidden_norm." + name[len("hidden_norm."):]
    return name


def export_speculators(drafter: EagleDrafter, target_dir: Path, out: Path) -> None:
    """Write an EAGLE-3 drafter as a speculators checkpoint: a Llama config with
    architectures ["LlamaForCausalLMEagle3"], one layer, draft and target vocabulary sizes,
    the auxiliary layer ids (ids of the layers whose *outputs* are tapped), and weights
    fc / layers.0.* / norm / lm_head plus the d2t offsets and the t2d mask."""
    if not isinstance(drafter, Eagle3Drafter):
        raise ConfigError(f"--format speculators exports EAGLE-3 drafters; this one is {drafter.cfg.variant!r}")
    state = {_speculators_names(k): v for k, v in drafter.state_dict().items()}
    target_config = ModelConfig.from_dir(target_dir)
    t2d = torch.zeros(target_config.vocab_size, dtype=torch.bool)
    t2d[drafter.draft_to_target] = True
    state["t2d"] = t2d
    layer = drafter.cfg.layer.to_hf_dict()
    aux_outputs = [i - 1 for i in drafter.cfg.aux_layers]  # HF hidden_states index i = output of layer i-1
    config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
              "draft_vocab_size": drafter.cfg.draft_vocab_size, "vocab_size": target_config.vocab_size,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_outputs},
              "speculators_model_type": "eagle3",
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                  {"proposal_type": "greedy", "speculative_tokens": 5}], "default_proposal_method": "greedy",
                  "verifier": {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}}}
    save_checkpoint(state, config, out, target_dir)


def from_speculators(data: dict, state: dict) -> tuple[EagleConfig, dict]:
    """A speculators EAGLE-3 checkpoint's (config, tensors) in our layout."""
    layer = ModelConfig.from_hf_dict({**data, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    aux = tuple(i + 1 for i in data["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    cfg = EagleConfig("eagle3", layer, aux, data["draft_vocab_size"])
    ours = {}
    for k, v in state.items():
        if k == "t2d":
            continue
        if k.startswith("layers.0.hidden_norm."):
            k = "hidden_norm." + k[len("layers.0.hidden_norm."):]
        elif k.startswith("layers.0."):
            k = "layer." + k[len("layers.0."):]
        ours[k] = v
    return cfg, ours
