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
from specdecode.logit_adjust import path_tokens
from specdecode.logprobs import token_logprobs
from specdecode.sampling import RowMasks, SamplingBatch, sample_host
from specdecode.speculative.config import SpeculativeConfig
from specdecode.speculative.policy.controller import DepthController, StepPlan
from specdecode.speculative.policy.cost_model import load_or_profile
from specdecode.speculative.propose.proposer import Draft, Proposer, ProposerContext
from specdecode.speculative.propose.registry import PROPOSERS
from specdecode.speculative.verify.chain import Verified, skip_uniform_draws, verify
from specdecode.speculative.verify.kv import compact_accepted
from specdecode.speculative.verify.tree import node_depths, tree_attention_mask, verify_tree
from specdecode.structured import constrain_chain, constrain_tree
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
        self.vocab_size = runner.model.config.vocab_size
        # Per batch size, the empty draft of a step nobody drafts in, made once: nothing writes into
        # a Draft's tensors, and its allocations were a quarter of what such a step cost beyond plain
        # decoding (n-gram, batch 1).
        self._empty_drafts: dict[int, Draft] = {}

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
        if self.proposer.max_tree_depth == 0 and self.depth.declines(seqs, self.proposer.pending_tokens):
            return self._step_without_draft(seqs, sampling, None)
        plan = self.depth.plan(seqs, [self.proposer.pending_tokens(s) for s in seqs])
        if not plan.drafts and self.proposer.max_tree_depth == 0:
            return self._step_without_draft(seqs, sampling, plan)
        grammar = None  # chains: grammar masks at every verification position of the constrained rows

        t0 = time.perf_counter()
        if plan.drafts:
            draft = self.proposer.propose(seqs, plan.max_tokens, sampling, stop=self.depth.draft_stop(plan))
            num_tokens = draft.host()[1]
            num_draft_steps = max(num_tokens)
            if draft.parents is None:  # n_min and D-Cut shape chains; trees come shaped by their drafter
                limits = self.depth.verify_lengths(seqs, num_tokens, draft.confidence_host(), plan)
                if any(limit < n for limit, n in zip(limits, num_tokens)):  # else it keeps every draft
                    draft = draft.truncate(limits, num_tokens)
                if sampling.constrained:  # a draft ends before the first token its grammar forbids
                    kept, grammar = constrain_chain(sampling.grammars, *draft.host(), self.k + 1, self.vocab_size)
                    draft = draft.truncate(kept)
        else:
            # A tree engine verifies through the tree walk even when nobody drafted: each seeded row's
            # random draws per step are then the same whatever the rest of the batch drafted.
            draft = Draft.empty(len(seqs), self.target.device, tree=self.proposer.max_tree_depth > 0)
            num_draft_steps = 0
        num_draft = draft.host()[1]  # entry lengths are host-side
        t1 = time.perf_counter()

        if draft.parents is not None:
            # For metrics a tree offers as many draft tokens as its deepest path.
            result, verified, num_draft, logits, rows = self._verify_tree(seqs, draft, num_draft, plan.max_tokens,
                                                                          sampling)
        else:
            result, verified, logits, rows = self._verify_chain(seqs, draft, num_draft, sampling, grammar)
        tokens, num_accepted = verified.host()
        logprobs = self._committed_logprobs(seqs, sampling, logits, rows, tokens, num_accepted, verified.path)
        t2 = time.perf_counter()

        confidence_host = None
        if self.depth.tracks_confidence and max(num_draft) > 0:
            confidence_host = draft.confidence_host()
        self.depth.update(plan, seqs, num_draft, num_accepted, t1 - t0, num_draft_steps, confidence_host,
                          time.perf_counter() - t0)
        self.proposer.on_commit(seqs, draft, verified, result)  # last: the drafter commits once nothing can fail
        return StepOutput(seqs, [row[: a + 1] for row, a in zip(tokens, num_accepted)], [1 + a for a in num_accepted],
                          num_draft=num_draft, num_accepted=num_accepted, draft_seconds=t1 - t0, verify_seconds=t2 - t1,
                          logprobs=logprobs)

    def _step_without_draft(self, seqs: list[Sequence], sampling: SamplingBatch, plan: StepPlan | None) -> StepOutput:
        """A chain step in which nobody drafts: plain decoding's forward and sampling, without the
        proposal and verification bookkeeping (its host work was most of what a speculative engine
        whose policy stopped drafting cost over a plain engine). plan None: the depth policy
        declined before planning (`DepthController.declines`)."""
        t0 = time.perf_counter()
        entries = [ForwardEntry(s.slot, [s.last_token_id], start=s.num_cached) for s in seqs]
        result = self.target.runner.forward(entries, hidden_taps=self.hidden_taps, argmax=sampling.raw_argmax)
        verified = self._sample_without_draft(result, sampling)
        tokens, num_accepted = verified.host()
        logprobs = self._committed_logprobs(seqs, sampling, result.logits, sampling, tokens, num_accepted, None)
        seconds = time.perf_counter() - t0
        num_draft = [0] * len(seqs)
        if plan is None:
            self.depth.observe_declined(len(seqs), seconds)
        else:
            self.depth.update(plan, seqs, num_draft, num_accepted, 0.0, 0, None, seconds)
        self.proposer.on_commit(seqs, self._empty_draft(len(seqs)), verified, result)
        return StepOutput(seqs, [list(row) for row in tokens], [1] * len(seqs), num_draft=num_draft,
                          num_accepted=list(num_accepted), draft_seconds=0.0, verify_seconds=seconds, logprobs=logprobs)

    def _sample_without_draft(self, result: ForwardResult, sampling: SamplingBatch) -> Verified:
        """Sample as plain decoding does from the logits at each entry's first row, without the
        verifier's [B, k+1, V] work. The seeded rows still draw their k uniforms, so their random
        streams stay batch-independent."""
        skip_uniform_draws(self.k, sampling.generators, self.target.device)
        # The token as plain decoding samples it (`sample_host`: greedy argmaxes straight to the host).
        rows = [[token] for token in sample_host(result.logits, sampling, result.first_choices())]
        return Verified.from_host(rows, [0] * len(rows), result.logits.device)

    def _empty_draft(self, batch_size: int) -> Draft:
        draft = self._empty_drafts.get(batch_size)
        if draft is None:
            draft = self._empty_drafts[batch_size] = Draft.empty(batch_size, self.target.device)
        return draft

    def _position_rows(self, sampling: SamplingBatch, draft: Draft, grammar: RowMasks | None) -> SamplingBatch | None:
        """One sampling row per verification position [root, drafts...] of every sequence, with the
        draft tokens before it as context and its grammar mask; None when no row is adjusted or
        constrained (the verifier then repeats rows itself where it samples)."""
        if sampling.adjust is None and grammar is None:
            return None
        token_ids = draft.token_ids
        B, width = token_ids.shape[0], token_ids.shape[1] + 1
        context = (path_tokens(token_ids, draft.parents).view(B * width, width - 1) if sampling.adjust is not None
                   else None)
        return sampling.repeat_rows([width] * B).with_context(context, grammar)

    def _committed_logprobs(self, seqs, sampling: SamplingBatch, logits: torch.Tensor, rows: SamplingBatch | None,
                            tokens: list[list[int]], num_accepted: list[int], path: torch.Tensor | None) -> list | None:
        """Logprobs of each committed token, for the sequences that asked: the target's logits at
        the token's verification row (chain: position j; tree: the accepted node's row), processed
        with that row's context, as plain decoding would process them."""
        asked = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        if not asked:
            return None
        B, width, V = logits.shape
        path_host = path.tolist() if path is not None else None
        flat, committed, tops = [], [], []
        for b in asked:
            for j in range(num_accepted[b] + 1):
                flat.append(b * width + (j if path_host is None or j == 0 else path_host[b][j - 1] + 1))
                committed.append(tokens[b][j])
                tops.append(seqs[b].params.logprobs)
        index = torch.tensor(flat, device=logits.device)
        if rows is not None:
            picked = rows.select(flat)
        else:  # no context to carry: the asking rows' parameters, one row per committed position
            owner = {b: i for i, b in enumerate(asked)}
            picked = sampling.select(asked).repeat_rows([width] * len(asked)).select(
                [owner[f // width] * width + f % width for f in flat])
        values = iter(token_logprobs(logits.reshape(B * width, V)[index], picked, committed, tops))
        out: list = [None] * len(seqs)
        for b in asked:
            out[b] = [next(values) for _ in range(num_accepted[b] + 1)]
        return out

    def _verify_chain(self, seqs, draft: Draft, num_draft: list[int], sampling: SamplingBatch,
                      grammar: RowMasks | None):
        """(forward result, Verified, logits [B, W, V] at the verification positions, their rows)."""
        drafts_host = draft.host()[0]
        entries = [ForwardEntry(s.slot, [s.last_token_id] + drafts_host[b][: num_draft[b]], start=s.num_cached,
                                num_logits=1 + num_draft[b]) for b, s in enumerate(seqs)]
        result = self.target.runner.forward(entries, hidden_taps=self.hidden_taps, argmax=sampling.raw_argmax)
        if max(num_draft) == 0:  # nothing to verify (the drafter proposed nothing)
            return result, self._sample_without_draft(result, sampling), result.logits[:, :1], sampling
        draft = draft.pad_to(self.k)  # fixed width k: per-request random draws never depend on the batch
        rows = self._position_rows(sampling, draft, grammar)
        # An all-greedy batch without adjustments compares argmaxes over the drafted positions only
        # (padding the logits to k + 1 cost 6-11 us a step, and the argmax read the padding too).
        logits = result.logits if rows is None and sampling.all_greedy else _pad_logits(result.logits, self.k + 1)
        return result, verify(draft, logits, sampling, rows, result.argmax), logits, rows

    def _verify_tree(self, seqs, draft: Draft, num_nodes: list[int], limits: list[int], sampling: SamplingBatch):
        draft = draft.truncate(num_nodes)  # nodes past a row's count must never match in the walk
        tokens, parents = draft.host()[0], draft.parents.tolist()
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
        token_ids, grammar = draft.token_ids, None
        if sampling.constrained:  # nodes the grammar forbids (and their subtrees) match no draw
            dropped = set(too_big)
            walked, grammar = constrain_tree(
                sampling.grammars, [[-1] * width if b in dropped else t for b, t in enumerate(tokens)],
                [[-2] * width if b in dropped else p for b, p in enumerate(parents)], width + 1, self.vocab_size)
            token_ids = torch.tensor(walked, dtype=torch.long, device=token_ids.device).view(len(seqs), width)
        logits = _pad_logits(result.logits, width + 1)
        rows = self._position_rows(sampling, draft, grammar)
        verified, path = verify_tree(token_ids, draft.parents, logits, sampling, self.proposer.max_tree_depth, rows)
        device = self.target.device
        compact_accepted(self.target.runner.kv_cache, torch.tensor([s.slot for s in seqs], device=device),
                         torch.tensor([s.num_cached for s in seqs], device=device), path, verified.num_accepted)
        verified.path = path
        return result, verified, tree_depths, logits, rows


def _pad_logits(logits: torch.Tensor, width: int) -> torch.Tensor:
    if logits.shape[1] == width:
        return logits
    return torch.nn.functional.pad(logits, (0, 0, 0, width - logits.shape[1]))


def build_speculator(config: SpeculativeConfig | dict | str | None, target: TargetHandle) -> Speculator | None:
    parsed = SpeculativeConfig.parse(config)
    return None if parsed is None else Speculator(parsed, target)
