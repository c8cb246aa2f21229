"""The EAGLE, EAGLE-3 and MTP proposers (one class, a variant each): catch up on the target's
features of newly committed positions, then draft a chain or an EAGLE-2 dynamic tree."""

from __future__ import annotations

import logging

import torch

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.compiled import CompiledForward
from specdecode.engine.ragged import ForwardEntry, build_attention, merge_rows
from specdecode.errors import ConfigError
from specdecode.models.inference import prepare_for_inference
from specdecode.models.llama import KVCache, row_linear
from specdecode.models.native_stack import current_or_rebuilt
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.chain import ChainDraft
from specdecode.speculative.propose.drafters.eagle.checkpoint import load_drafter
from specdecode.speculative.propose.drafters.eagle.model import BuiltinMtpDrafter
from specdecode.speculative.propose.draft_vocab import draft_heads
from specdecode.speculative.propose.dynamic_tree import propose_dynamic_tree
from specdecode.speculative.propose.features import TargetFeatureBuffer
from specdecode.speculative.propose.native_step import NativeDraftStep, native_batch_served, native_temperature
from specdecode.speculative.propose.proposer import Draft, ProposerContext
from specdecode.speculative.propose.registry import register
from specdecode.speculative.propose.resolve import check_fits_target, drafter_quantization, resolve_drafter_dir

log = logging.getLogger(__name__)


class EagleProposer(TargetFeatureBuffer):
    """Chains (ChainDraft) or EAGLE-2 dynamic trees (`propose_dynamic_tree`) from a feature drafter."""

    draft_cost_prior = 0.3  # one decoder layer + an LM head per step
    variant: str  # the drafter variant this method serves (EagleDrafter.variant)
    supports_tree = True  # EAGLE-2 dynamic trees when tree_topk > 1
    scores_vocabulary = True

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        self.drafter = self.load_drafter(ctx)
        cfg = self.drafter.cfg
        self.hidden_taps = self.drafter.feature_taps(ctx.target.config, cfg.aux_layers)
        self.target = ctx.target
        self.grouping = ctx.grouping
        self.vocab_size = ctx.target.config.vocab_size
        self.topk, self.num_nodes = ctx.config.tree_topk, ctx.config.tree_num_nodes
        self.p_min = ctx.config.draft_p_min
        self.depth = ctx.config.num_speculative_tokens
        self.max_tree_depth = self.depth if self.topk > 1 else 0
        # Drafting writes past the committed columns: k chain steps, or topk nodes per tree level.
        extra = self.depth * max(1, self.topk) + 2
        self.kv_cache = KVCache(self.drafter.cfg.layer, ctx.num_slots, ctx.max_len + extra, ctx.dtype, ctx.device,
                                layer_ids=getattr(self.drafter, "layer_ids", None))
        self.drafter_forward = CompiledForward(self.drafter.forward, ctx.compile, self.variant)
        # The heads drafting scores with, by the drafter's head they stand for (FR-Spec: fewer rows).
        d2t = self.drafter.draft_to_target
        self.draft_heads = {id(head): draft_heads(ctx, head, d2t) for head in self.drafter.heads(ctx.target)}
        self.greedy_proposal = False  # the proposal being drafted scores with the greedy heads
        self.draft_step = 0  # the drafting step being computed (built-in MTP picks its layer by it)
        self.compiled = ctx.compile
        # Greedy proposal or not -> (what its C++ drafting step was built from, the step or None): native_step.py
        self._native: dict[bool, tuple] = {}
        self.native_drafting = True  # False: always the Python step (A/B measurements)

    def load_drafter(self, ctx: ProposerContext):
        """The drafter checkpoint speculative_config.model names (or the default model's), checked
        against the target and made ready to serve."""
        path = resolve_drafter_dir(ctx, f"{DEFAULT_MODEL_NAME}-{self.variant}")
        drafter = prepare_for_inference(load_drafter(path, ctx.dtype, ctx.device), path, ctx.dtype, ctx.device,
                                        drafter_quantization(ctx, path))
        if drafter.cfg.variant != self.variant:
            raise ConfigError(f"speculative_config.model {str(path)!r} is a {drafter.cfg.variant!r} drafter, "
                              f"not {self.variant!r}")
        cfg = drafter.cfg
        d2t = drafter.draft_to_target  # eagle3: the target id of each draft id
        check_fits_target(ctx, path, hidden_size=cfg.layer.hidden_size, vocab_size=cfg.layer.vocab_size,
                          taps={"aux_hidden_state_layer_ids": drafter.feature_taps(ctx.target.config, cfg.aux_layers)},
                          token_ids=None if d2t is None else {"d2t": [int(d2t.min()), int(d2t.max())]})
        return drafter

    # ---- drafting -------------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        """Drafter forward over ragged entries; features[b] [T_b, d]. Returns o [B, T, d] (padded).
        A catch-up next to one-token steps runs as its own forward (see `LengthGrouping`)."""
        return self.grouping.run(
            entries, lambda group: self._forward_padded([entries[i] for i in group], [features[i] for i in group]),
            merge_rows)

    def _forward_padded(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        input_ids, positions, batch = build_attention(entries, self.kv_cache.scratch_index, None, self.device)
        B, T = input_ids.shape
        if B == 1:  # one entry: its features are the batch, unpadded
            feats = features[0][None]
        else:
            feats = torch.zeros(B, T, features[0].shape[-1], dtype=features[0].dtype, device=self.device)
            for b, f in enumerate(features):
                feats[b, : f.shape[0]] = f
        return self.drafter_forward(T, batch, self.target.model.embed_tokens(input_ids), feats, positions,
                                    **self.drafter.cache_arguments(self.kv_cache, self.draft_step))

    def _forward_last(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        """o at each entry's last token [B, d]."""
        out = self._forward(entries, features)
        lengths = [len(e.token_ids) for e in entries]
        if min(lengths) == out.shape[1]:  # every entry ends at the last column (drafting steps)
            return out[:, -1]
        last = torch.tensor(lengths, device=self.device) - 1
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

    def vocab_logits(self, out: torch.Tensor) -> torch.Tensor:
        """o [.., d] -> float32 logits over the target vocabulary (-inf outside the draft vocabulary)."""
        head = self.draft_heads[id(self.drafter.head(self.target))].pick(self.greedy_proposal)
        return row_linear(head, self.drafter.head_input(out, self.target)).float()

    # ---- EAGLE-2 trees (`propose_dynamic_tree` calls these) --------------------------------------

    def tree_root(self, seqs, active: list[int]) -> torch.Tensor:
        self.draft_step = 0
        first = self._catch_up(seqs, active)
        return self._forward_last([first[b][0] for b in active], [first[b][1] for b in active])  # [A, d]

    def tree_level(self, entries: list[ForwardEntry], features: list[torch.Tensor]) -> torch.Tensor:
        self.draft_step += 1
        return self._forward(entries, features)[:, : features[0].shape[0]]  # [A, K, d]

    def _native_step(self) -> NativeDraftStep | None:
        """The drafter's step over this proposal's heads as one C++ call (None: not served), rebuilt
        when its modules changed."""
        greedy = self.greedy_proposal
        served = {key: heads.pick(greedy) for key, heads in self.draft_heads.items()}
        self._native[greedy] = current_or_rebuilt(
            self._native.get(greedy),
            lambda watch: NativeDraftStep.for_feature_drafter(self.drafter, self.target, served, watch))
        return self._native[greedy][1]

    def _draft_natively(self, seqs, active: list[int], first, chain: ChainDraft, max_tokens: list[int],
                        sampling: SamplingBatch) -> bool:
        """One sequence: draft its chain in C++ (native_step.py), where served."""
        temperature = native_temperature(active, sampling, chain, self.device, self.compiled, self.native_drafting)
        if temperature is None:
            return False
        (entry, feature), native = first[active[0]], self._native_step()
        layers = native.layers_serving(feature) if native is not None and entry.token_ids else None
        if layers is None:
            return False
        seq, cache = seqs[active[0]], self.drafter.cache_arguments(self.kv_cache, 0)
        native.draft(layers, chain, active[0], max_tokens, entry.token_ids, feature[None], seq.slot, entry.start,
                     seq.num_tokens - 1, [cache["cache_k"]], [cache["cache_v"]], temperature,
                     sampling.generators[active[0]])
        return True

    def _batch_step(self, first, sampling: SamplingBatch):
        """A greedy batch's drafting step of several sequences as one C++ call (native_step.py
        `draft_batch`: (entries, features) -> (o [A, d], tokens, probabilities) or None), where served."""
        if not native_batch_served(sampling, self.device, self.compiled, self.native_drafting) or not first:
            return None
        native, cache = self._native_step(), self.drafter.cache_arguments(self.kv_cache, 0)
        return None if native is None else native.batch_drafter([cache["cache_k"]], [cache["cache_v"]],
                                                                next(iter(first.values()))[1])

    @torch.inference_mode()
    def propose(self, seqs, max_tokens, sampling: SamplingBatch, stop=None) -> Draft:
        self.greedy_proposal = ChainDraft.one_hot(sampling)
        if self.topk > 1:
            return propose_dynamic_tree(self, seqs, max_tokens, self.topk, self.depth, self.num_nodes, self.device)
        B, k = len(seqs), max(max_tokens)
        chain = ChainDraft(max_tokens, self.vocab_size, self.device, self.p_min, stop)
        active = [b for b in range(B) if max_tokens[b] > 0]
        first = self._catch_up(seqs, active)
        if self._draft_natively(seqs, active, first, chain, max_tokens, sampling):
            return chain.result()
        batch_step = self._batch_step(first, sampling)
        entries = {b: e for b, (e, _) in first.items()}
        feats = {b: f for b, (_, f) in first.items()}
        for step in range(k):
            if not active:
                break
            self.draft_step = step
            step_entries, step_feats = [entries[b] for b in active], [feats[b] for b in active]
            drafted = batch_step(step_entries, step_feats) if batch_step is not None else None
            if drafted is None:  # the Python step
                out = self._forward_last(step_entries, step_feats)  # [A, d]
                chosen = chain.add_step(active, step, self.vocab_logits(out), sampling)
            else:
                out, tokens, tops = drafted
                chosen = chain.record(active, step, tokens, tops)
            row = {b: i for i, b in enumerate(active)}
            active = chain.continuing(step, active, chosen, max_tokens)
            for b in active:
                seq, i = seqs[b], row[b]
                # Next drafter position N-1+step takes (the token just drafted, the drafter's own output).
                entries[b] = ForwardEntry(seq.slot, [chosen[i]], start=seq.num_tokens - 1 + step)
                feats[b] = out[i: i + 1]
        return chain.result()


@register("eagle")
class EagleOneProposer(EagleProposer):
    variant = "eagle"


@register("eagle3")
class EagleThreeProposer(EagleProposer):
    variant = "eagle3"


@register("mtp")
class MtpProposer(EagleProposer):
    """MTP: with no `model`, a target that has MTP layers of its own (DeepSeek-V3 style) drafts
    with them; otherwise a separately trained MTP drafter (the default model's shipped one)."""

    variant = "mtp"

    def load_drafter(self, ctx: ProposerContext):
        if ctx.config.model is None and ctx.target.config.num_nextn_predict_layers:
            log.info("mtp: drafting with the target's own %d MTP layer(s)", ctx.target.config.num_nextn_predict_layers)
            return BuiltinMtpDrafter(ctx.target)
        if ctx.config.model is None and ctx.target.config.is_mla:
            raise ConfigError("method 'mtp' without a model drafts with the target's own MTP layers, and this "
                              "checkpoint has none (num_nextn_predict_layers is 0, or its model.layers."
                              f"{ctx.target.config.num_hidden_layers}.* weights are absent); name a trained MTP "
                              "drafter in speculative_config.model")
        return super().load_drafter(ctx)
