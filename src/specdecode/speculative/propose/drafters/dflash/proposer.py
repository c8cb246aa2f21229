"""The DFlash proposer: consume pending context, one block pass, then a chain or a static tree
over the block positions (see `model.py` for the network)."""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.ragged import ForwardEntry, build_attention
from specdecode.errors import ConfigError
from specdecode.models.inference import prepare_for_inference
from specdecode.models.llama import KVCache, row_linear
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.chain import ChainDraft
from specdecode.speculative.propose.draft_vocab import draft_heads
from specdecode.speculative.propose.drafters.dflash.model import DFlashDrafter, load_dflash
from specdecode.speculative.propose.features import TargetFeatureBuffer
from specdecode.speculative.propose.proposer import Draft, ProposerContext
from specdecode.speculative.propose.registry import register
from specdecode.speculative.propose.resolve import check_fits_target, drafter_quantization, resolve_drafter_dir
from specdecode.speculative.propose.static_tree import StaticTree


@register("dflash")
class DFlashProposer(TargetFeatureBuffer):
    draft_cost_prior = 0.2  # one block pass shared by all k positions
    # Block positions are drafted independently given the context, so a static tree over their
    # top-k tokens (as Medusa's over its heads) is exact; DSpark's Markov head chains them.
    supports_tree = True
    scores_vocabulary = True
    default_checkpoint = f"{DEFAULT_MODEL_NAME}-dflash"

    def _load(self, ctx: ProposerContext, path: Path) -> DFlashDrafter:
        return load_dflash(path, ctx.dtype, ctx.device)

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        path = resolve_drafter_dir(ctx, self.default_checkpoint)
        self.drafter = prepare_for_inference(self._load(ctx, path), path, ctx.dtype, ctx.device,
                                             drafter_quantization(ctx, path))
        cfg = self.drafter.cfg
        if ctx.config.num_speculative_tokens > cfg.block_size - 1:
            raise ConfigError(f"speculative_config.num_speculative_tokens ({ctx.config.num_speculative_tokens}) exceeds "
                              f"this DFlash drafter's block_size - 1 ({cfg.block_size - 1})")
        check_fits_target(ctx, path, hidden_size=cfg.layers.hidden_size, vocab_size=cfg.layers.vocab_size,
                          taps={"target_layer_ids": cfg.target_layer_ids}, token_ids={"mask_token_id": [cfg.mask_token_id]})
        self.target = ctx.target
        self.draft_heads = draft_heads(ctx, ctx.target.lm_head)  # the target's LM head (FR-Spec: its frequent rows)
        self.grouping = ctx.grouping
        self.vocab_size = ctx.target.config.vocab_size
        self.hidden_taps = cfg.target_layer_ids
        self.p_min = ctx.config.draft_p_min
        self.kv_cache = KVCache(cfg.layers, ctx.num_slots, ctx.max_len + cfg.block_size + 2, ctx.dtype, ctx.device)
        self.tree = None
        if ctx.config.tree_topk > 1 and self.supports_tree:
            self.tree = StaticTree(ctx.config.num_speculative_tokens, ctx.config.tree_topk, ctx.config.tree_num_nodes,
                                   ctx.device)
            self.max_tree_depth = self.tree.max_depth

    def block_pass(self, seqs, active: list[int]) -> torch.Tensor:
        """Consume pending context, then one bidirectional pass over [x_{N-1}, MASK x (B-1)] at
        positions N-1 ... Returns the normed block states [A, B, d]; state j >= 1 gives token N-1+j."""
        block = self.drafter.cfg.block_size
        mask_id = self.drafter.cfg.mask_token_id
        # 1. Context K/V of the committed positions not consumed yet (positions cached .. N-2).
        context_entries, contexts = [], []
        for b in active:
            cached, raw = self.take_pending(seqs[b])
            if raw.shape[0]:
                context_entries.append(ForwardEntry(seqs[b].slot, [0] * raw.shape[0], start=cached))
                contexts.append(self.drafter.context(raw))
        # A new request's whole prompt next to one-step contexts is written by its own pass (see `LengthGrouping`).
        if contexts:
            self.grouping.run(context_entries, lambda group: self._write_context(
                [context_entries[i] for i in group], [contexts[i] for i in group]))
        # 2. The block pass (its columns are overwritten by the next proposal's context).
        entries = [ForwardEntry(seqs[b].slot, [seqs[b].last_token_id] + [mask_id] * (block - 1),
                                start=seqs[b].num_tokens - 1, tree_mask=torch.ones(block, block, dtype=torch.bool))
                   for b in active]
        input_ids, positions, batch = build_attention(entries, self.kv_cache.scratch_index, None, self.device)
        return self.drafter(self.target.model.embed_tokens(input_ids), positions, batch, self.kv_cache)

    def _write_context(self, entries: list[ForwardEntry], contexts: list[torch.Tensor]) -> None:
        """Context vectors contexts[i] [T_i, d] into the cache columns of entries[i], as one padded pass."""
        _, positions, batch = build_attention(entries, self.kv_cache.scratch_index, None, self.device)
        padded = torch.zeros(len(entries), positions.shape[1], contexts[0].shape[-1], dtype=contexts[0].dtype,
                             device=self.device)
        for row, context in enumerate(contexts):
            padded[row, : context.shape[0]] = context
        self.drafter.write_context(padded, positions, batch, self.kv_cache)

    @torch.inference_mode()
    def propose(self, seqs, max_tokens, sampling: SamplingBatch, stop=None) -> Draft:
        B, k = len(seqs), max(max_tokens)
        chain = ChainDraft(max_tokens, self.vocab_size, self.device, self.p_min)
        active = [b for b in range(B) if max_tokens[b] > 0]
        if not active:
            return chain.result()
        hidden = self.block_pass(seqs, active)  # [A, block, d]
        head = self.draft_heads.pick(ChainDraft.one_hot(sampling))
        base = row_linear(head, hidden[:, 1:]).float()  # [A, block-1, V]: tokens N .. N+B-2
        if self.tree is not None:
            tokens = torch.zeros(B, len(self.tree.paths), dtype=torch.long, device=self.device)
            tokens[torch.tensor(active, device=self.device)] = self.tree.tokens(base)
            return self.tree.draft(tokens, [m > 0 for m in max_tokens])
        state = self.start_block(seqs, active)
        # Position by position; p_min stops a row at its first unsure position.
        for step in range(k):
            rows = [b for b in active if step < max_tokens[b] and chain.num[b] == step]
            if not rows:
                break
            index = torch.tensor([active.index(b) for b in rows], device=self.device)
            self.draw_step(chain, rows, index, step, hidden, base, state, sampling)
        return chain.result()

    def start_block(self, seqs, active: list[int]):
        """Per-block drafting state (DFlash: none, its positions are independent)."""
        return None

    def draw_step(self, chain: ChainDraft, rows: list[int], index: torch.Tensor, step: int, hidden: torch.Tensor,
                  base: torch.Tensor, state, sampling: SamplingBatch) -> None:
        """Draw position `step` of the given rows (DFlash: from its own q_j)."""
        chain.add_step(rows, step, base[index, step], sampling)
