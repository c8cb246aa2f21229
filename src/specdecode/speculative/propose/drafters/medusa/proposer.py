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

import dataclasses

import torch

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.errors import ConfigError
from specdecode.models.inference import prepare_for_inference
from specdecode.models.llama import row_linear
from specdecode.speculative.propose.chain import ChainDraft
from specdecode.speculative.propose.draft_vocab import draft_heads
from specdecode.speculative.propose.drafters.medusa.model import load_heads
from specdecode.speculative.propose.proposer import Draft, ProposerBase, ProposerContext
from specdecode.speculative.propose.registry import register
from specdecode.speculative.propose.resolve import check_fits_target, drafter_quantization, resolve_drafter_dir
from specdecode.speculative.propose.static_tree import StaticTree


@dataclasses.dataclass(slots=True)
class MedusaState:
    hidden: torch.Tensor | None = None  # [d] final-normed hidden state at the last committed position


@register("medusa")
class MedusaProposer(ProposerBase[MedusaState]):
    draft_cost_prior = 0.1  # K small heads on the target's last hidden state
    supports_tree = True
    scores_vocabulary = True
    state_type = MedusaState

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        path = resolve_drafter_dir(ctx, f"{DEFAULT_MODEL_NAME}-medusa")
        self.heads = prepare_for_inference(load_heads(path, ctx.dtype, ctx.device), path, ctx.dtype, ctx.device,
                                           drafter_quantization(ctx, path))
        depth = ctx.config.num_speculative_tokens
        if depth > self.heads.num_heads:
            raise ConfigError(f"speculative_config.num_speculative_tokens ({depth}) exceeds this Medusa "
                              f"checkpoint's {self.heads.num_heads} heads")
        # The heads share the target's LM head: its vocabulary, so only the token map is checked.
        check_fits_target(ctx, path, hidden_size=self.heads.blocks[0].in_features)
        self.target = ctx.target
        self.draft_heads = draft_heads(ctx, ctx.target.lm_head)  # the target's LM head (FR-Spec: its frequent rows)
        self.tree = StaticTree(depth, ctx.config.tree_topk, ctx.config.tree_num_nodes, ctx.device)
        self.is_chain = ctx.config.tree_topk == 1
        self.max_tree_depth = 0 if self.is_chain else self.tree.max_depth
        self.p_min = ctx.config.draft_p_min

    def on_prefill(self, seqs, result) -> None:
        for b, seq in enumerate(seqs):
            self._states[seq.request_id] = MedusaState(result.hidden[b, len(seq.prompt_token_ids) - 1])

    def on_commit(self, seqs, draft, verified, result) -> None:
        accepted = verified.host()[1]
        path = verified.path.tolist() if verified.path is not None else None
        for b, seq in enumerate(seqs):
            row = accepted[b] if path is None else (0 if accepted[b] == 0 else 1 + path[b][accepted[b] - 1])
            self.state(seq).hidden = result.hidden[b, row]  # the last committed position's state

    @torch.inference_mode()
    def propose(self, seqs, max_tokens, sampling, stop=None) -> Draft:
        hidden = torch.stack([self.state(s).hidden for s in seqs])  # [B, d]
        head = self.draft_heads.pick(ChainDraft.one_hot(sampling))
        logits = row_linear(head, self.heads(hidden)).float()  # [B, K, V]
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
