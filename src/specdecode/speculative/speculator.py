"""One speculative step for a batch: plan, propose, verify in one target forward, commit.

    plan     = depth.plan(seqs, pending)                 # per-row draft limits (StepPlan)
    draft    = proposer.propose(seqs, plan.max_tokens, sampling, stop)   # [B, k] tokens, maybe probs
    logits   = target([last token, drafts...])           # one ragged forward, 1 + n_b tokens each
    verified = verify(draft, logits, sampling)           # accepted + recovered/bonus per row
    -> StepOutput: each sequence commits accepted + 1 tokens and its cache grows by as many;
       rejected columns are simply overwritten later (rollback = a length).

The speculator sees the target only through a `TargetHandle` and changes no sequence
state itself: the scheduler applies the returned `StepOutput`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import ForwardResult, Runner
from specdecode.engine.sequence import Sequence
from specdecode.engine.step_output import StepOutput
from specdecode.errors import ConfigError
from specdecode.sampling import SamplingBatch, sample
from specdecode.speculative.config import SpeculativeConfig
from specdecode.speculative.policy.controller import DepthController
from specdecode.speculative.policy.cost_model import load_or_profile
from specdecode.speculative.propose.proposer import Draft, Proposer, ProposerContext
from specdecode.speculative.propose.registry import PROPOSERS
from specdecode.speculative.verify.chain import Verified, skip_uniform_draws, verify
from specdecode.speculative.verify.kv import compact_accepted
from specdecode.speculative.verify.tree import node_depths, tree_attention_mask, verify_tree
from specdecode.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class TargetHandle:
    """What speculation may use of the target engine."""

    runner: Runner  # the target's model, KV cache and ragged forward
    model_dir: Path  # where the target's checkpoint lives (drafter lookup, cost-profile cache key)
    tokenizer: Tokenizer
    max_num_seqs: int
    max_model_len: int

    @property
    def device(self) -> torch.device:
        return self.runner.device


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: TargetHandle):
        self.config = config
        self.target = target
        runner = target.runner
        ctx = ProposerContext(config=config, target=runner.model, target_dir=target.model_dir, tokenizer=target.tokenizer,
                              num_slots=target.max_num_seqs, max_len=target.max_model_len, dtype=runner.dtype,
                              device=runner.device, grouping=runner.grouping, quantization=runner.quantization,
                              compile=runner.model_forward.enabled)
        proposer_class = PROPOSERS[config.method]
        if config.tree_topk > 1 and not proposer_class.supports_tree:  # refused before any checkpoint is read
            tree_methods = sorted(m for m, cls in PROPOSERS.items() if cls.supports_tree)
            raise ConfigError(f"speculative_config.tree_topk > 1 (tree drafting) is not supported for method "
                              f"{config.method!r}; methods with trees: {', '.join(tree_methods)}")
        self.proposer: Proposer = proposer_class(ctx)
        self.depth = DepthController(config, cost_model_loader=lambda: load_or_profile(
            runner, target.model_dir, max_batch=target.max_num_seqs, max_width=config.num_speculative_tokens + 1),
            draft_cost_prior=self.proposer.draft_cost_prior)
        if self.depth.needs_cost_model:
            self.depth.cost  # profile now, before any request owns a KV slot
        self.k = config.num_speculative_tokens

    @property
    def hidden_taps(self) -> tuple[int, ...]:
        return self.proposer.hidden_taps

    def on_prefill(self, seqs: list[Sequence], result: ForwardResult) -> None:
        self.proposer.on_prefill(seqs, result)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
        self.depth.release(seq)

    def step(self, seqs: list[Sequence], sampling: SamplingBatch) -> StepOutput:
        """One speculative step. A step that raises leaves the drafter as it was (what the
        proposal recorded is rolled back; its cache columns past the committed ones are
        rewritten next time), so the engine can retry it on part of the batch."""
        try:
            return self._step(seqs, sampling)
        except Exception:
            self.proposer.rollback(seqs)
            raise

    def _step(self, seqs: list[Sequence], sampling: SamplingBatch) -> StepOutput:
        plan = self.depth.plan(seqs, [self.proposer.pending_tokens(s) for s in seqs])

        t0 = time.perf_counter()
        if plan.drafts:
            draft = self.proposer.propose(seqs, plan.max_tokens, sampling, stop=self.depth.draft_stop(plan))
            num_tokens = draft.num_tokens.tolist()
            num_draft_steps = max(num_tokens)
            if draft.parents is None:  # n_min and D-Cut shape chains; trees come shaped by their drafter
                confidence = draft.confidence.tolist() if draft.confidence is not None else None
                draft = draft.truncate(self.depth.verify_lengths(seqs, num_tokens, confidence))
        else:
            # A tree engine verifies through the tree walk even when nobody drafted: each seeded row's
            # random draws per step are then the same whatever the rest of the batch drafted.
            draft = Draft.empty(len(seqs), self.target.device, tree=self.proposer.max_tree_depth > 0)
            num_draft_steps = 0
        num_draft = draft.num_tokens.tolist()  # one host sync: entry lengths are host-side
        t1 = time.perf_counter()

        if draft.parents is not None:
            # For metrics a tree offers as many draft tokens as its deepest path.
            result, verified, num_draft = self._verify_tree(seqs, draft, num_draft, plan.max_tokens, sampling)
        else:
            result, verified = self._verify_chain(seqs, draft, num_draft, sampling)
        num_accepted = verified.num_accepted.tolist()
        tokens = verified.token_ids.tolist()
        t2 = time.perf_counter()

        confidence_host = None
        if self.depth.tracks_confidence and draft.confidence is not None and max(num_draft) > 0:
            confidence_host = draft.confidence.tolist()
        self.depth.update(plan, seqs, num_draft, num_accepted, t1 - t0, num_draft_steps, confidence_host,
                          time.perf_counter() - t0)
        self.proposer.on_commit(seqs, draft, verified, result)  # last: the drafter commits once nothing can fail
        return StepOutput(seqs, [row[: a + 1] for row, a in zip(tokens, num_accepted)], [1 + a for a in num_accepted],
                          num_draft=num_draft, num_accepted=num_accepted, draft_seconds=t1 - t0, verify_seconds=t2 - t1)

    def _verify_chain(self, seqs, draft: Draft, num_draft: list[int], sampling: SamplingBatch):
        drafts_host = draft.token_ids.tolist()
        entries = [ForwardEntry(s.slot, [s.last_token_id] + drafts_host[b][: num_draft[b]], start=s.num_cached,
                                num_logits=1 + num_draft[b]) for b, s in enumerate(seqs)]
        result = self.target.runner.forward(entries, hidden_taps=self.hidden_taps)
        if max(num_draft) == 0:
            # Nothing to verify: sample as plain decoding does, without the verifier's [B, k+1, V] work.
            # The seeded rows still draw their k uniforms, so their random streams stay batch-independent.
            skip_uniform_draws(self.k, sampling.generators, self.target.device)
            final = sample(result.logits[:, 0], sampling)
            return result, Verified(final[:, None], torch.zeros_like(final))
        draft = draft.pad_to(self.k)  # fixed width k: per-request random draws never depend on the batch
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
            if nodes and (max(depths) > limits[b] or s.num_cached + len(nodes) >= self.target.max_model_len):
                too_big.append(b)
                nodes, depths = [], []
            tree_depths.append(max(depths, default=0))
            entries.append(ForwardEntry(
                s.slot, [s.last_token_id] + tokens[b][: len(nodes)], start=s.num_cached, num_logits=1 + len(nodes),
                positions=[s.num_cached + d for d in [0] + depths], tree_mask=tree_attention_mask(nodes)))
        draft = draft.drop_rows(too_big)
        result = self.target.runner.forward(entries, hidden_taps=self.hidden_taps)
        width = draft.token_ids.shape[1]
        verified, path = verify_tree(draft.token_ids, draft.parents, _pad_logits(result.logits, width + 1), sampling,
                                     self.proposer.max_tree_depth)
        device = self.target.device
        compact_accepted(self.target.runner.kv_cache, torch.tensor([s.slot for s in seqs], device=device),
                         torch.tensor([s.num_cached for s in seqs], device=device), path, verified.num_accepted)
        verified.path = path
        return result, verified, tree_depths


def _pad_logits(logits: torch.Tensor, width: int) -> torch.Tensor:
    if logits.shape[1] == width:
        return logits
    return torch.nn.functional.pad(logits, (0, 0, 0, width - logits.shape[1]))


def build_speculator(config: SpeculativeConfig | dict | str | None, target: TargetHandle) -> Speculator | None:
    parsed = SpeculativeConfig.parse(config)
    return None if parsed is None else Speculator(parsed, target)
