"""IndexCache patterns on a loaded DSA model: set one, and search one (arXiv 2603.12201).

A pattern says per main layer whether it runs its indexer ("full") or reuses the nearest
preceding full layer's top-k ("shared"); config.json (`indexer_types`) or vLLM's overrides
(`index_topk_pattern`, `index_topk_freq`) set it at load, `set_pattern` on a loaded model.

The training-free search is the paper's greedy one: start from every layer full, and repeatedly
make shared the layer whose sharing raises the calibration LM loss least, until `num_full`
layers remain (layer 0 always stays full; a layer without indexer weights, as GLM-5's shared
ones, is never made full).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdecode.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def pattern_string(types) -> str:
    return "".join("F" if t == "full" else "S" for t in types)


def get_pattern(model: LlamaForCausalLM) -> tuple[str, ...]:
    return tuple("full" if layer.self_attn.runs_indexer else "shared"
                 for layer in model.model.layers[: model.config.num_hidden_layers])


def set_pattern(model: LlamaForCausalLM, types) -> None:
    """Make each main layer full or shared ("F"/"S" string or "full"/"shared" list)."""
    types = [{"F": "full", "S": "shared"}.get(t, t) for t in types]
    layers = model.model.layers[: model.config.num_hidden_layers]
    if len(types) != len(layers) or types[0] != "full":
        raise ValueError(f"a pattern gives one F/S per layer ({len(layers)}), the first F; got {pattern_string(types)}")
    for layer, kind in zip(layers, types):
        if kind == "full" and layer.self_attn.indexer is None:
            raise ValueError("this checkpoint has no indexer weights in a layer the pattern makes full")
        layer.self_attn.runs_indexer = kind == "full"
    model.config.indexer_types = tuple(types)


@torch.no_grad()
def calibration_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> float:
    """Mean next-token cross-entropy over windows [N, T + 1] (one window per forward)."""
    total = 0.0
    for window in windows:
        inputs, targets = window[None, :-1], window[None, 1:]
        T = inputs.shape[1]
        hidden = model(inputs, torch.arange(T, device=inputs.device)[None]).hidden
        total += float(F.cross_entropy(model.compute_logits(hidden)[0], targets[0]))
    return total / len(windows)


@dataclasses.dataclass(slots=True)
class SearchStep:
    pattern: str
    loss: float


def greedy_search(model: LlamaForCausalLM, windows: torch.Tensor, num_full: int) -> list[SearchStep]:
    """The greedy path from all-full down to `num_full` full layers: one step per layer made shared."""
    if not model.config.has_dsa:
        raise ValueError("IndexCache needs a DSA model (DeepSeek-V3.2, GLM-5)")
    L = model.config.num_hidden_layers
    if not 1 <= num_full <= L:
        raise ValueError(f"num_full must lie in 1 .. {L}, got {num_full}")
    original = get_pattern(model)
    current = ["full" if layer.self_attn.indexer is not None else "shared" for layer in model.model.layers[:L]]
    try:
        set_pattern(model, current)
        steps = [SearchStep(pattern_string(current), calibration_loss(model, windows))]
        bar = tqdm(total=max(0, current.count("full") - num_full), desc="index-cache-search", unit="layer")
        while current.count("full") > num_full:
            trials = []
            for i in range(1, L):
                if current[i] == "full":
                    trial = current[:i] + ["shared"] + current[i + 1:]
                    set_pattern(model, trial)
                    trials.append((calibration_loss(model, windows), i))
            loss, i = min(trials)
            current[i] = "shared"
            steps.append(SearchStep(pattern_string(current), loss))
            log.info("index-cache-search: %s loss %.4f", steps[-1].pattern, loss)
            bar.update(1)
        bar.close()
        return steps
    finally:
        set_pattern(model, original)
