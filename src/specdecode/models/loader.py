"""Load an HF checkpoint directory (config.json + safetensors, single or sharded) -> model.

No `transformers` at run time: the config is read by ModelConfig, the weights by
`safetensors`, and the module is built on the meta device and filled with `assign=True`
(no double allocation, no random init of a model about to be overwritten).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from specdecode.errors import ModelLoadError
from specdecode.models.config import ModelConfig
from specdecode.models.inference import prepare_for_inference
from specdecode.models.llama import LlamaForCausalLM
from specdecode.models.quant import QuantScheme, dequantize_stored_state, stored_scheme

logger = logging.getLogger(__name__)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards named by model.safetensors.index.json."""
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(
            f"no weights in {path}: expected model.safetensors or model.safetensors.index.json "
            "(PyTorch .bin checkpoints are not loaded: they need unpickling)"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"weight shard {f} is missing")
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ModelLoadError(f"{f} is corrupt or truncated: {e}") from None
    scheme = stored_scheme(path)
    if scheme is not None:  # layers stored quantised (a QAT draft model): their dense weights for the module
        state = dequantize_stored_state(state, scheme)
    return state


def _is_router(name: str) -> bool:
    return name.endswith(("mlp.gate.weight", "mlp.gate.e_score_correction_bias"))


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               quantization: QuantScheme | None = None, overrides: dict | None = None) -> LlamaForCausalLM:
    """The checkpoint as a frozen inference model (`prepare_for_inference`: projections fused,
    linear layers quantised when `quantization` is set, else packed for bf16/fp16 on CPU).
    `overrides` replace config.json keys (e.g. IndexCache's index_topk_pattern)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    config = ModelConfig.from_dir(path, overrides)
    state = read_safetensors_dir(path)
    if config.num_nextn_predict_layers and not any(
            k.startswith(f"model.layers.{config.num_hidden_layers}.") for k in state):
        # HF's DeepSeek classes drop the MTP layers when they save: the model serves without them.
        logger.info("%s: config.json names %d MTP layer(s) but the weights hold none; loading without them",
                    path, config.num_nextn_predict_layers)
        config.num_nextn_predict_layers = 0
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = set(model.state_dict().keys())
    # Tied heads are not stored: the LM head, and an MTP layer's shared head when it is absent.
    tied = {"lm_head.weight"} | {f"model.layers.{i}.shared_head.head.weight" for i in
                                 range(config.num_hidden_layers, len(model.model.layers))
                                 if f"model.layers.{i}.shared_head.head.weight" not in state}
    if config.tie_word_embeddings:
        for name in tied:
            state.pop(name, None)
            expected.discard(name)
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} weights the config needs, e.g. {missing[:3]}")
    for name, param in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(state[name].shape)}, config implies {tuple(param.shape)}")
    # MoE routers stay float32 (their top-k choice is sensitive), as in the reference.
    state = {k: v.to(device=device, dtype=torch.float32 if _is_router(k) else dtype)
             for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        for i in range(config.num_hidden_layers, len(model.model.layers)):
            if f"model.layers.{i}.shared_head.head.weight" in tied:
                model.model.layers[i].shared_head.head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (RoPE frequencies) are still on meta: rebuild them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    return prepare_for_inference(model, path, dtype, device, quantization)
