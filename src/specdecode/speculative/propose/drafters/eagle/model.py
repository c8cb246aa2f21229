"""Feature-level drafters that read the target's own hidden states: EAGLE, EAGLE-3 and MTP.

One base network, three variant subclasses (METHODS.md 2.5, 2.6), built from the project's DecoderLayer:

    eagle, mtp:  x_t = fc([e(tok_{t+1}) ; f_t])       2d -> d (mtp RMS-normalises both halves)
                 o_t = DecoderLayer(x_t)
    eagle3:      o_t = DecoderLayer(residual f_t, attention input [norm(e(tok_{t+1})) ; norm(f_t)])
                 (the reference EAGLE-3 "midlayer": q/k/v read 2d, the feature is the residual)
    every layer attends to earlier drafter positions through the drafter's own KV cache;
    tokens from o_t:  eagle: target LM head;  mtp: target final norm + LM head;
                      eagle3: own norm + own LM head over a reduced draft vocabulary (d2t map)

f_t is the target's feature at position t: eagle: the final-normed last hidden state; mtp: the
last layer's output before the final norm; eagle3: Linear(3d -> d) over the concatenated
hidden states of a low, a middle and a high layer. Drafting further, o_t is fed back as the
next feature (EAGLE's feature prediction, MTP's chaining, EAGLE-3's self-feeding).

Engine contract: drafter position t takes (token t+1, feature t). Between steps the
drafter's cache holds exactly the committed positions it has consumed; the target's
features of newly committed positions wait in the request's `FeatureState` and are
consumed ("caught up") at the start of the next proposal, then drafting continues from the
drafter's own output.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from specdecode.errors import ConfigError
from specdecode.models.config import ModelConfig
from specdecode.models.dsa import SparseContext
from specdecode.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm, RotaryEmbedding, row_linear


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high taps (inputs of layers 2, L/2, L-3, HF hidden_states
    numbering); small targets, where those collide, take evenly spread distinct layers."""
    for taps in ((2, num_layers // 2, num_layers - 3), (1, num_layers // 2, num_layers - 1)):
        if len(set(taps)) == 3 and min(taps) >= 1:
            return taps
    return tuple(range(min(3, num_layers + 1)))  # tiny targets: embedding output and the first layers


@dataclasses.dataclass(slots=True)
class EagleConfig:
    variant: str
    layer: ModelConfig  # the one decoder layer (target's width, heads, RoPE)
    aux_layers: tuple[int, ...] = ()  # eagle3 taps
    draft_vocab_size: int = 0  # eagle3 reduced vocabulary (0 = the target's)

    def to_json(self) -> dict:
        return {"architectures": ["SpecdecodeEagleDrafter"], "variant": self.variant,
                "aux_hidden_state_layer_ids": list(self.aux_layers), "draft_vocab_size": self.draft_vocab_size,
                "layer": self.layer.to_hf_dict()}

    @classmethod
    def from_json(cls, data: dict) -> "EagleConfig":
        return cls(data["variant"], ModelConfig.from_hf_dict(data["layer"]), tuple(data["aux_hidden_state_layer_ids"]),
                   data["draft_vocab_size"])


class EagleDrafter(nn.Module):
    """What the three variants share: one decoder layer over [token embedding ; feature] with
    RoPE and the drafter's own KV cache. A variant says where its feature comes from, how the
    two inputs enter the layer and which head turns outputs into tokens."""

    variant: ClassVar[str]
    train_unroll_steps: ClassVar[int] = 3  # training unrolls the drafter on its own outputs this deep
    regress_features: ClassVar[bool] = False  # EAGLE-1's SmoothL1 feature loss on the first unrolled step

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        self.cfg = cfg
        self.rotary = RotaryEmbedding(cfg.layer)

    @staticmethod
    def feature_taps(target_config: ModelConfig, aux_layers: tuple[int, ...]) -> tuple[int, ...]:
        """Target layers (HF hidden_states numbering) the feature is read from; () = the final-normed hidden state."""
        return ()

    @staticmethod
    def raw_features(hidden: torch.Tensor, taps: dict[int, torch.Tensor], aux_layers: tuple[int, ...]) -> torch.Tensor:
        """What the target gives the drafter per position: [B, T, d] (eagle3: [B, T, 3d])."""
        return hidden

    def features(self, raw: torch.Tensor) -> torch.Tensor:
        """The target's raw feature -> f_t [.., d]."""
        return raw

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, batch=None,
                cache_k=None, cache_v=None) -> torch.Tensor:
        """embeds, features [B, T, d] -> o [B, T, d]."""
        cos, sin = self.rotary(positions, features.dtype)
        return self.layer(self.fc(torch.cat(self.inputs(embeds, features), dim=-1)), cos, sin, batch, cache_k, cache_v)

    def inputs(self, embeds: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return embeds, features

    def cache_arguments(self, cache, step: int) -> dict:
        """How `forward` reads the proposer's KVCache at drafting step `step`: its one layer's K and V."""
        return {"cache_k": cache.k[0], "cache_v": cache.v[0]}

    def logits(self, out: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        """o [.., d] -> logits over the drafter's vocabulary (eagle3: the draft vocabulary), float32."""
        return row_linear(self.head(target), self.head_input(out, target)).float()

    def head(self, target: LlamaForCausalLM) -> nn.Module:
        """The LM head that scores the drafter's vocabulary (eagle, mtp: the target's)."""
        return target.lm_head

    def head_input(self, out: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        """o [.., d] -> what the LM head reads [.., d]."""
        return out

    def heads(self, target: LlamaForCausalLM) -> list[nn.Module]:
        """Every head `head` can return (built-in MTP: one per layer)."""
        return [self.head(target)]

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[draft_vocab] target token id of each draft id (eagle3), else None (the target's vocabulary)."""
        return None


class Eagle1Drafter(EagleDrafter):
    """EAGLE-1: fc([e ; f]) with bias, the target's final-normed hidden state as feature, the target's LM head."""

    variant = "eagle"
    regress_features = True

    def __init__(self, cfg: EagleConfig):
        super().__init__(cfg)
        d = cfg.layer.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=True)  # [embedding ; feature] -> d
        self.layer = DecoderLayer(cfg.layer)


class MtpDrafter(EagleDrafter):
    """DeepSeek-style MTP block: both inputs RMS-normed, the last layer's output before the
    final norm as feature, tokens through the target's final norm and LM head."""

    variant = "mtp"

    def __init__(self, cfg: EagleConfig):
        super().__init__(cfg)
        d, eps = cfg.layer.hidden_size, cfg.layer.rms_norm_eps
        self.embed_norm, self.feature_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(cfg.layer)

    @staticmethod
    def feature_taps(target_config, aux_layers):
        return (target_config.num_hidden_layers,)

    @staticmethod
    def raw_features(hidden, taps, aux_layers):
        return next(iter(taps.values()))

    def inputs(self, embeds, features):
        return self.embed_norm(embeds), self.feature_norm(features)

    def head_input(self, out, target):
        return target.model.norm(out)


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3: fused low/mid/high target layers as feature (the residual), attention input
    [norm(e) ; norm(f)] (q/k/v read 2d), its own norm and LM head over a reduced vocabulary."""

    variant = "eagle3"
    train_unroll_steps = 5

    def __init__(self, cfg: EagleConfig):
        super().__init__(cfg)
        d, eps = cfg.layer.hidden_size, cfg.layer.rms_norm_eps
        self.fc = nn.Linear(len(cfg.aux_layers) * d, d, bias=False)  # fuses the low/mid/high taps
        self.hidden_norm = RMSNorm(d, eps)
        self.layer = DecoderLayer(cfg.layer, attn_input_size=2 * d)
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # draft id -> target id offset

    @staticmethod
    def feature_taps(target_config, aux_layers):
        return aux_layers

    @staticmethod
    def raw_features(hidden, taps, aux_layers):
        return torch.cat([taps[i] for i in aux_layers], dim=-1)

    def features(self, raw):
        return self.fc(raw)

    def forward(self, embeds, features, positions, batch=None, cache_k=None, cache_v=None):
        cos, sin = self.rotary(positions, features.dtype)
        attn_input = torch.cat([self.layer.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        return self.layer(features, cos, sin, batch, cache_k, cache_v, attn_input=attn_input)

    def head(self, target):
        return self.lm_head

    def head_input(self, out, target):
        return self.norm(out)

    @property
    def draft_to_target(self):
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t


class BuiltinMtpDrafter(EagleDrafter):
    """The target's own MTP layers (DeepSeek-V3's `num_nextn_predict_layers`, model.layers[L:]),
    as an MTP drafter: the feature is the target's final-normed hidden state, each layer's
    enorm / hnorm / eh_proj / block / shared_head as the checkpoint defines them (`MTPLayer`),
    the target's embedding. Drafting step s uses layer s mod n (n > 1: cycling; n = 1: the layer
    chains on its own output); every layer consumes every position, so each layer's cache
    (DSA: and its indexer-key cache, its own top-k at every step) is complete."""

    variant = "mtp"

    def __init__(self, target: LlamaForCausalLM):
        config = target.config
        super().__init__(EagleConfig("mtp", config))
        self.rotary = target.model.rotary_emb
        self.mtp_layers = list(target.model.layers[config.num_hidden_layers:])  # a list: the target owns them
        self.layer_ids = range(config.num_hidden_layers, config.num_hidden_layers + len(self.mtp_layers))

    def cache_arguments(self, cache, step: int) -> dict:
        return {"cache": cache, "step": step}  # every MTP layer's cache; the step picks the drafting layer

    def forward(self, embeds, features, positions, batch=None, cache=None, step: int = 0):
        """embeds, features [B, T, d] -> the output of layer step mod n [B, T, d]."""
        cos, sin = self.rotary(positions, features.dtype)
        outputs = []
        for j, layer in enumerate(self.mtp_layers):
            dsa = SparseContext(index_cache=cache.index_k[j]) if self.cfg.layer.has_dsa else None
            outputs.append(layer(layer.block_input(embeds, features), cos, sin, batch, cache.k[j], cache.v[j], dsa=dsa))
        self.current = step % len(outputs)  # whose shared head `logits` applies to this output
        return outputs[self.current]

    def head(self, target):
        return self.mtp_layers[self.current].shared_head.head

    def heads(self, target):
        return [layer.shared_head.head for layer in self.mtp_layers]

    def head_input(self, out, target):
        return self.mtp_layers[self.current].shared_head.norm(out)

    current = 0


VARIANTS: dict[str, type[EagleDrafter]] = {cls.variant: cls for cls in (Eagle1Drafter, Eagle3Drafter, MtpDrafter)}


def build_drafter(cfg: EagleConfig) -> EagleDrafter:
    if cfg.variant not in VARIANTS:
        raise ConfigError(f"unknown EAGLE variant {cfg.variant!r}; accepted: {', '.join(VARIANTS)}")
    return VARIANTS[cfg.variant](cfg)
