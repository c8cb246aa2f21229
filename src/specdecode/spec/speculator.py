"""One speculative step for a batch: propose, verify in one target forward, commit.

    draft    = proposer.propose(seqs)                  # [B, k] tokens, maybe probs
    logits   = target([last token, drafts...])          # one ragged forward, 1 + n_b tokens each
    verified = verify(draft, logits, sampling)          # accepted + recovered/bonus per row
    commit: each sequence's cache length becomes num_cached + 1 + accepted; rejected
            columns are simply overwritten later (rollback = a length).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from specdecode.config import SpeculativeConfig
from specdecode.errors import ConfigError
from specdecode.engine.runner import ForwardEntry, ForwardResult
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingBatch, sample
from specdecode.spec.cost_model import load_or_profile
from specdecode.spec.depth import DepthController
from specdecode.spec.proposer import PROPOSERS, Draft, ProposerContext
from specdecode.spec.tree import compact_accepted, node_depths, tree_attention_mask, verify_tree
from specdecode.spec.verify import Verified, skip_uniform_draws, verify

if TYPE_CHECKING:
    from specdecode.engine.engine import LLM

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, config: SpeculativeConfig, llm: "LLM"):
        import specdecode.spec.drafters  # noqa: F401  (registers the built-in proposers)

        self.config = config
        self.llm = llm
        ctx = ProposerContext(config=config, target=llm.model, target_dir=llm.config.model, tokenizer=llm.tokenizer,
                              num_slots=llm.config.max_num_seqs, max_len=llm.max_model_len, dtype=llm.dtype, device=llm.device)
        self.proposer = PROPOSERS[config.method](ctx)
        if config.tree_topk > 1 and not getattr(self.proposer, "supports_tree", False):
            tree_methods = sorted(m for m, cls in PROPOSERS.items() if getattr(cls, "supports_tree", False))
            raise ConfigError(f"speculative_config.tree_topk > 1 (tree drafting) is not supported for method "
                              f"{config.method!r}; methods with trees: {', '.join(tree_methods)}")
        self.depth = DepthController(config, cost_model_loader=lambda: load_or_profile(
            llm.runner, llm.config.model, max_batch=llm.config.max_num_seqs, max_width=config.num_speculative_tokens + 1),
            draft_cost_prior=self.proposer.draft_cost_prior, pending_tokens=self.proposer.pending_tokens)
        if self.depth.needs_cost_model:
            self.depth.cost  # profile now, before any request owns a KV slot
        if config.verify_pruning == "dcut":
            self.proposer.draft_stop = self.depth.keep_drafting
        self.k = config.num_speculative_tokens

    @property
    def hidden_taps(self) -> tuple[int, ...]:
        return self.proposer.hidden_taps

    def on_prefill(self, seqs: list[Sequence], result: ForwardResult) -> None:
        self.proposer.on_prefill(seqs, result)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def step(self, seqs: list[Sequence]) -> list[list[int]]:
        device = self.llm.device
        sampling = SamplingBatch.build([s.params for s in seqs], [s.generator for s in seqs], device)
        limits = self.depth.limits(seqs)

        t0 = time.perf_counter()
        if max(limits) > 0:
            draft = self.proposer.propose(seqs, limits, sampling)
            num_tokens = draft.num_tokens.tolist()
            num_draft_steps = max(num_tokens)
            if draft.parents is None:  # n_min and D-Cut shape chains; trees come shaped by their drafter
                confidence = draft.confidence.tolist() if draft.confidence is not None else None
                draft = draft.truncate(self.depth.verify_lengths(seqs, num_tokens, confidence))
        else:
            draft = Draft.empty(len(seqs), device)
            num_draft_steps = 0
        num_draft = draft.num_tokens.tolist()  # one host sync: entry lengths are host-side
        t1 = time.perf_counter()

        if draft.parents is not None:
            # For metrics a tree offers as many draft tokens as its deepest path.
            result, verified, num_draft = self._verify_tree(seqs, draft, num_draft, limits, sampling)
        else:
            result, verified = self._verify_chain(seqs, draft, num_draft, sampling)
        num_accepted = verified.num_accepted.tolist()
        tokens = verified.token_ids.tolist()
        t2 = time.perf_counter()

        self.proposer.on_commit(seqs, draft, verified, result)
        confidence_host = None
        if self.depth.tracks_confidence and draft.confidence is not None and max(num_draft) > 0:
            confidence_host = draft.confidence.tolist()
        self.depth.update(seqs, num_draft, num_accepted, t1 - t0, num_draft_steps, confidence_host,
                          time.perf_counter() - t0)
        out = []
        for b, seq in enumerate(seqs):
            seq.num_cached += 1 + num_accepted[b]
            seq.stats.observe(num_draft[b], num_accepted[b])
            seq.stats.draft_time += (t1 - t0) / len(seqs)
            seq.stats.verify_time += (t2 - t1) / len(seqs)
            out.append(tokens[b][: num_accepted[b] + 1])
        return out

    def _verify_chain(self, seqs, draft: Draft, num_draft: list[int], sampling: SamplingBatch):
        drafts_host = draft.token_ids.tolist()
        entries = [ForwardEntry(s.slot, [s.last_token_id] + drafts_host[b][: num_draft[b]], start=s.num_cached,
                                num_logits=1 + num_draft[b]) for b, s in enumerate(seqs)]
        result = self.llm.runner.forward(entries, hidden_taps=self.hidden_taps)
        if max(num_draft) == 0:
            # Nothing to verify: sample as plain decoding does, without the verifier's [B, k+1, V] work.
            # The seeded rows still draw their k uniforms, so their random streams stay batch-independent.
            skip_uniform_draws(self.k, sampling.generators, self.llm.device)
            final = sample(result.logits[:, 0], sampling)
            return result, Verified(final[:, None], torch.zeros_like(final))
        draft = _pad_draft(draft, self.k)  # fixed width k: per-request random draws never depend on the batch
        logits = _pad_logits(result.logits, self.k + 1)
        return result, verify(draft.token_ids, draft.num_tokens, draft.probs, logits, sampling)

    def _verify_tree(self, seqs, draft: Draft, num_nodes: list[int], limits: list[int], sampling: SamplingBatch):
        draft = draft.truncate(num_nodes)  # nodes past a row's count must never match in the walk
        tokens, parents = draft.token_ids.tolist(), draft.parents.tolist()
        entries, too_big, tree_depths = [], [], []
        for b, s in enumerate(seqs):
            nodes = parents[b][: num_nodes[b]]
            depths = node_depths(nodes)
            # A tree must fit the sequence's room and its KV slot; otherwise it decodes normally.
            if nodes and (max(depths) > limits[b] or s.num_cached + len(nodes) >= self.llm.max_model_len):
                too_big.append(b)
                nodes, depths = [], []
            tree_depths.append(max(depths, default=0))
            entries.append(ForwardEntry(
                s.slot, [s.last_token_id] + tokens[b][: len(nodes)], start=s.num_cached, num_logits=1 + len(nodes),
                positions=[s.num_cached + d for d in [0] + depths], tree_mask=tree_attention_mask(nodes)))
        draft = draft.drop_rows(too_big)
        result = self.llm.runner.forward(entries, hidden_taps=self.hidden_taps)
        width = draft.token_ids.shape[1]
        verified, path = verify_tree(draft.token_ids, draft.parents, _pad_logits(result.logits, width + 1), sampling,
                                     self.proposer.max_tree_depth)
        device = self.llm.device
        compact_accepted(self.llm.runner.kv_cache, torch.tensor([s.slot for s in seqs], device=device),
                         torch.tensor([s.num_cached for s in seqs], device=device), path, verified.num_accepted)
        verified.path = path
        return result, verified, tree_depths


def _pad_draft(draft: Draft, k: int) -> Draft:
    B, width = draft.token_ids.shape
    if width == k:
        return draft
    pad = k - width
    token_ids = torch.nn.functional.pad(draft.token_ids, (0, pad), value=-1)
    probs = None
    if draft.probs is not None:
        probs = torch.nn.functional.pad(draft.probs, (0, 0, 0, pad))
    confidence = None if draft.confidence is None else torch.nn.functional.pad(draft.confidence, (0, pad))
    return Draft(token_ids, draft.num_tokens, probs, confidence)


def _pad_logits(logits: torch.Tensor, width: int) -> torch.Tensor:
    if logits.shape[1] == width:
        return logits
    return torch.nn.functional.pad(logits, (0, 0, 0, width - logits.shape[1]))


def build_speculator(config: SpeculativeConfig | dict | str | None, llm: "LLM") -> Speculator | None:
    parsed = SpeculativeConfig.parse(config)
    return None if parsed is None else Speculator(parsed, llm)
