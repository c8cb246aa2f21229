"""Feature-level drafters that read the target's own hidden states: EAGLE, EAGLE-3 and MTP.

One module, three variants (METHODS.md 2.5, 2.6), built from the project's DecoderLayer:

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
features of newly committed positions wait in `seq.drafter_state["features"]` and are
consumed ("caught up") at the start of the next proposal, then drafting continues from the
drafter's own output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.runner import ForwardEntry, build_attention, forward_overhead_tokens, length_groups, merge_rows
from specdecode.errors import ConfigError, ModelLoadError
from specdecode.models.config import ModelConfig
from specdecode.models.llama import (DecoderLayer, KVCache, LlamaForCausalLM, RMSNorm, RotaryEmbedding, fuse_projections,
                                     row_linear)
from specdecode.sampling import SamplingBatch
from specdecode.spec.drafters.chain import ChainDraft
from specdecode.spec.drafters.checkpoint import read_checkpoint, save_checkpoint
from specdecode.spec.drafters.features import TargetFeatureBuffer
from specdecode.spec.proposer import Draft, ProposerContext, register, resolve_drafter_dir

VARIANTS = ("eagle", "eagle3", "mtp")


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
    def __init__(self, cfg: EagleConfig):
        super().__init__()
        if cfg.variant not in VARIANTS:
            raise ConfigError(f"unknown EAGLE variant {cfg.variant!r}; accepted: {', '.join(VARIANTS)}")
        self.cfg = cfg
        d, eps = cfg.layer.hidden_size, cfg.layer.rms_norm_eps
        self.rotary = RotaryEmbedding(cfg.layer)
        if cfg.variant == "mtp":
            self.embed_norm, self.feature_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        if cfg.variant == "eagle3":
            self.fc = nn.Linear(len(cfg.aux_layers) * d, d, bias=False)  # fuses the low/mid/high taps
            self.hidden_norm = RMSNorm(d, eps)
            self.layer = DecoderLayer(cfg.layer, attn_input_size=2 * d)
            self.norm = RMSNorm(d, eps)
            self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # draft id -> target id offset
        else:
            self.fc = nn.Linear(2 * d, d, bias=cfg.variant == "eagle")  # [embedding ; feature] -> d
            self.layer = DecoderLayer(cfg.layer)

    def features(self, raw: torch.Tensor) -> torch.Tensor:
        """The target's raw feature (see `raw_features`) -> f_t [.., d]."""
        return self.fc(raw) if self.cfg.variant == "eagle3" else raw

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, batch=None,
                cache_k=None, cache_v=None) -> torch.Tensor:
        """embeds, features [B, T, d] -> o [B, T, d]."""
        cos, sin = self.rotary(positions, features.dtype)
        if self.cfg.variant == "eagle3":
            attn_input = torch.cat([self.layer.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
            return self.layer(features, cos, sin, batch, cache_k, cache_v, attn_input=attn_input)
        if self.cfg.variant == "mtp":
            embeds, features = self.embed_norm(embeds), self.feature_norm(features)
        return self.layer(self.fc(torch.cat([embeds, features], dim=-1)), cos, sin, batch, cache_k, cache_v)

    def logits(self, out: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        """o [.., d] -> logits over the drafter's vocabulary (eagle3: the draft vocabulary)."""
        if self.cfg.variant == "eagle":
            return target.compute_logits(out)
        if self.cfg.variant == "mtp":
            return target.compute_logits(target.model.norm(out))
        return row_linear(self.lm_head, self.norm(out)).float()

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """[draft_vocab] target token id of each draft id (eagle3), else None."""
        if self.cfg.variant != "eagle3":
            return None
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t


def feature_taps(variant: str, target_config: ModelConfig, aux_layers: tuple[int, ...]) -> tuple[int, ...]:
    if variant == "eagle3":
        return aux_layers
    if variant == "mtp":
        return (target_config.num_hidden_layers,)
    return ()  # eagle reads the final-normed hidden state every forward returns


def raw_features(variant: str, hidden: torch.Tensor, taps: dict[int, torch.Tensor], aux_layers) -> torch.Tensor:
    """What the target gives the drafter per position: [B, T, d] (eagle3: [B, T, 3d])."""
    if variant == "eagle3":
        return torch.cat([taps[i] for i in aux_layers], dim=-1)
    if variant == "mtp":
        return next(iter(taps.values()))
    return hidden


def save_drafter(drafter: EagleDrafter, out: Path, target_dir: Path, report: dict | None = None) -> None:
    save_checkpoint(drafter.state_dict(), drafter.cfg.to_json(), out, target_dir, report)


# ---- the speculators / vLLM EAGLE-3 layout (METHODS.md 2.5) ------------------------------------

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
    if drafter.cfg.variant != "eagle3":
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


def _from_speculators(data: dict, state: dict) -> tuple[EagleConfig, dict]:
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


def load_drafter(path: Path, dtype: torch.dtype, device) -> EagleDrafter:
    """Our checkpoint layout, or an EAGLE-3 checkpoint in the speculators layout."""
    data, state = read_checkpoint(path, "EAGLE/MTP drafter")
    try:
        if data.get("speculators_model_type") == "eagle3":
            cfg, state = _from_speculators(data, state)
        else:
            cfg = EagleConfig.from_json(data)
    except KeyError as e:
        raise ModelLoadError(f"{path} is not an EAGLE/MTP drafter checkpoint: missing {e}") from None
    drafter = EagleDrafter(cfg)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary")]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: weights do not fit the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    drafter.rotary = RotaryEmbedding(cfg.layer)
    return fuse_projections(drafter.to(device=device).to(dtype).eval().requires_grad_(False))


class EagleProposer(TargetFeatureBuffer):
    draft_cost_prior = 0.3  # one decoder layer + an LM head per step
    variant = "eagle"
    supports_tree = True  # EAGLE-2 dynamic trees when tree_topk > 1

    def __init__(self, ctx: ProposerContext):
        path = resolve_drafter_dir(ctx, f"{DEFAULT_MODEL_NAME}-{self.variant}")
        self.drafter = load_drafter(path, ctx.dtype, ctx.device)
        if self.drafter.cfg.variant != self.variant:
            raise ConfigError(f"speculative_config.model {str(path)!r} is a {self.drafter.cfg.variant!r} drafter, "
                              f"not {self.variant!r}")
        if self.drafter.cfg.layer.hidden_size != ctx.target.config.hidden_size:
            raise ConfigError("speculative_config.model: the drafter's hidden size does not match the target's")
        self.target = ctx.target
        self.device = ctx.device
        self.forward_overhead_tokens = forward_overhead_tokens(ctx.device)  # see `length_groups`
        self.vocab_size = ctx.target.config.vocab_size
        self.hidden_taps = feature_taps(self.variant, ctx.target.config, self.drafter.cfg.aux_layers)
        self.topk, self.num_nodes = ctx.config.tree_topk, ctx.config.tree_num_nodes
        self.p_min = ctx.config.draft_p_min
        self.depth = ctx.config.num_speculative_tokens
        self.max_tree_depth = self.depth if self.topk > 1 else 0
        # Drafting writes past the committed columns: k chain steps, or topk nodes per tree level.
        extra = self.depth * max(1, self.topk) + 2
        self.kv_cache = KVCache(self.drafter.cfg.layer, ctx.num_slots, ctx.max_len + extra, ctx.dtype, ctx.device)

    def target_features(self, result) -> torch.Tensor:
        return raw_features(self.variant, result.hidden, result.taps, self.drafter.cfg.aux_layers)

    # ---- drafting -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        """Drafter forward over ragged entries; features[b] [T_b, d]. Returns o [B, T, d] (padded).
        A catch-up next to one-token steps runs as its own forward (see `length_groups`)."""
        groups = length_groups([len(e.token_ids) for e in entries], self.forward_overhead_tokens)
        if len(groups) == 1:
            return self._forward_padded(entries, features)
        return merge_rows([self._forward_padded([entries[i] for i in group], [features[i] for i in group])
                           for group in groups], groups)

    def _forward_padded(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        input_ids, positions, batch = build_attention(entries, self.kv_cache.scratch_index, None, self.device)
        B, T = input_ids.shape
        feats = torch.zeros(B, T, features[0].shape[-1], dtype=features[0].dtype, device=self.device)
        for b, f in enumerate(features):
            feats[b, : f.shape[0]] = f
        return self.drafter(self.target.model.embed_tokens(input_ids), feats, positions, batch,
                            self.kv_cache.k[0], self.kv_cache.v[0])

    def _forward_last(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        """o at each entry's last token [B, d]."""
        out = self._forward(entries, features)
        last = torch.tensor([len(e.token_ids) - 1 for e in entries], device=self.device)
        return out[torch.arange(len(entries), device=self.device), last]

    def _catch_up(self, seqs, active: list[int]) -> dict[int, tuple[ForwardEntry, torch.Tensor]]:
        """Entries feeding every committed position the drafter has not consumed yet.
        Position t takes (token t+1, feature t); afterwards positions .. N-2 are cached."""
        first = {}
        for b in active:
            seq = seqs[b]
            cached, pending = self.take_pending(seq)  # positions cached .. N-2
            first[b] = (ForwardEntry(seq.slot, seq.token_ids[cached + 1:], start=cached), self.drafter.features(pending))
        return first

    def _full_vocab_logits(self, out: torch.Tensor) -> torch.Tensor:
        """o [.., d] -> logits over the target vocabulary (eagle3: -inf outside the draft vocabulary)."""
        logits = self.drafter.logits(out, self.target)
        d2t = self.drafter.draft_to_target
        if d2t is not None:
            full = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), device=logits.device)
            logits = full.index_copy(logits.dim() - 1, d2t, logits)
        return logits

    @torch.inference_mode()
    def propose(self, seqs, max_tokens, sampling: SamplingBatch) -> Draft:
        if self.topk > 1:
            return self._propose_tree(seqs, max_tokens)
        B, k = len(seqs), max(max_tokens)
        chain = ChainDraft(B, k, self.vocab_size, self.device, self.p_min, self.draft_stop)
        active = [b for b in range(B) if max_tokens[b] > 0]
        first = self._catch_up(seqs, active)
        entries = {b: e for b, (e, _) in first.items()}
        feats = {b: f for b, (_, f) in first.items()}
        for step in range(k):
            if not active:
                break
            out = self._forward_last([entries[b] for b in active], [feats[b] for b in active])  # [A, d]
            chosen = chain.add_step(active, step, self._full_vocab_logits(out), sampling)
            row = {b: i for i, b in enumerate(active)}
            active = chain.continuing(step, active, chosen, max_tokens)
            for b in active:
                seq, i = seqs[b], row[b]
                # Next drafter position N-1+step takes (the token just drafted, the drafter's own output).
                entries[b] = ForwardEntry(seq.slot, [chosen[i]], start=seq.num_tokens - 1 + step)
                feats[b] = out[i: i + 1]
        return chain.result()

    def _propose_tree(self, seqs, max_tokens) -> Draft:
        """EAGLE-2 dynamic tree: expand the global top-k frontier (by cumulative log-probability)
        for `depth` levels, then keep the best `tree_num_nodes` nodes. Scores never increase
        along a path, so the kept set is a tree. Children are the drafter's top-k tokens, chosen
        deterministically: the verifier treats them as point masses (exact under sampling)."""
        B, K, D = len(seqs), self.topk, self.depth
        active = [b for b in range(B) if max_tokens[b] > 0]
        if not active:
            return Draft.empty(B, self.device)
        first = self._catch_up(seqs, active)
        o_root = self._forward_last([first[b][0] for b in active], [first[b][1] for b in active])  # [A, d]
        A = len(active)
        scores, tokens = torch.log_softmax(self._full_vocab_logits(o_root), dim=-1).topk(K)  # [A, K]
        all_tokens, all_scores, all_parents, all_depths = [tokens], [scores], [torch.full((A, K), -1)], [1] * K
        frontier_index = torch.arange(K).expand(A, K)  # node indices of the frontier
        frontier_feat = o_root[:, None, :].expand(A, K, o_root.shape[-1])
        ancestors = torch.zeros(A, K, 0, dtype=torch.bool)  # [A, K, written] drafter columns each frontier node sees
        written, num_made = 0, K
        base = [seqs[b].num_tokens - 1 for b in active]  # first drafter column past the committed ones
        for d in range(1, D):
            token_host = tokens.tolist()
            entries = [ForwardEntry(seqs[b].slot, token_host[a], start=base[a] + written,
                                    positions=[base[a] - 1 + d] * K,
                                    tree_mask=torch.cat([ancestors[a], torch.eye(K, dtype=torch.bool)], dim=1))
                       for a, b in enumerate(active)]
            o = self._forward(entries, [frontier_feat[a] for a in range(A)])[:, :K]  # [A, K, d]
            child_scores, child_tokens = torch.log_softmax(self._full_vocab_logits(o), dim=-1).topk(K)  # [A, K, K]
            cumulative = (scores[:, :, None] + child_scores).reshape(A, K * K)
            all_tokens.append(child_tokens.reshape(A, K * K))
            all_scores.append(cumulative)
            all_parents.append(frontier_index.cpu()[:, :, None].expand(A, K, K).reshape(A, K * K))
            all_depths += [d + 1] * (K * K)
            scores, pick = cumulative.topk(K)  # the next frontier: global top-k of this level
            parent_slot = (pick // K).cpu()
            tokens = child_tokens.reshape(A, K * K).gather(1, pick)
            frontier_index = num_made + pick.cpu()
            frontier_feat = o.gather(1, (pick // K)[:, :, None].expand(-1, -1, o.shape[-1]))
            own_column = torch.nn.functional.one_hot(parent_slot, K).bool()  # the parent's column in this level
            ancestors = torch.cat([ancestors.gather(1, parent_slot[:, :, None].expand(-1, -1, written)), own_column], dim=2)
            written += K
            num_made += K * K
        return self._select_tree(torch.cat(all_tokens, 1), torch.cat(all_scores, 1), torch.cat(all_parents, 1),
                                 torch.tensor(all_depths), active, B)

    def _select_tree(self, tokens, scores, parents, depths, active: list[int], B: int) -> Draft:
        """Best `tree_num_nodes` nodes by score (ties: shallower first), ordered by depth."""
        A, M = tokens.shape
        n = min(self.num_nodes, M)
        keep = (scores.cpu() - 1e-6 * depths[None, :]).topk(n).indices  # [A, n]
        order = torch.argsort(depths[keep] * M + keep, dim=1)  # by depth, so parents precede children
        keep = keep.gather(1, order)
        new_position = torch.full((A, M), -2, dtype=torch.long)
        new_position.scatter_(1, keep, torch.arange(n).expand(A, n))
        kept_parents = parents.gather(1, keep)
        remapped = torch.where(kept_parents >= 0, new_position.gather(1, kept_parents.clamp(min=0)), kept_parents)
        out_tokens = torch.full((B, n), -1, dtype=torch.long)
        out_parents = torch.full((B, n), -2, dtype=torch.long)
        num = torch.zeros(B, dtype=torch.long)
        rows = torch.tensor(active)
        out_tokens[rows] = tokens.cpu().gather(1, keep)
        out_parents[rows] = remapped
        num[rows] = n
        return Draft(out_tokens.to(self.device), num.to(self.device), parents=out_parents.to(self.device))


@register("eagle")
class EagleOneProposer(EagleProposer):
    variant = "eagle"


@register("eagle3")
class EagleThreeProposer(EagleProposer):
    variant = "eagle3"


@register("mtp")
class MtpProposer(EagleProposer):
    variant = "mtp"
