"""`draft_model`: a separate small LM with the target's tokenizer and its own KV cache.

Its cache follows the committed tokens lazily. At propose time it is fed every committed
token it has not seen yet (the whole prompt the first time), then drafts autoregressively.
After verification it keeps the drafts that were accepted and that it had been fed; the
last draft of an all-accepted step was never fed, so the next step feeds it. Rejected
columns are simply overwritten (rollback = a length), as in the target's cache.
"""

from __future__ import annotations

import dataclasses

import torch

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.lean_width import widen_lean_path
from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model
from specdecode.models.native_stack import current_or_rebuilt
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.chain import ChainDraft
from specdecode.speculative.propose.draft_vocab import draft_heads
from specdecode.speculative.propose.native_step import NativeDraftStep, native_batch_served, native_temperature
from specdecode.speculative.propose.proposer import Draft, ProposerBase, ProposerContext
from specdecode.speculative.propose.registry import register
from specdecode.speculative.propose.resolve import check_fits_target, drafter_quantization, resolve_drafter_dir


@dataclasses.dataclass(slots=True)
class DraftModelState:
    # Tokens 0 .. num_cached-1 of the sequence are in the draft model's cache (it feeds tokens,
    # so the last committed token is pending too, unlike the feature drafters).
    num_cached: int = 0
    proposal_base: int | None = None  # num_tokens when the current proposal started (None: no proposal open)
    num_fed: int = 0  # drafts of the current proposal fed back into the draft model


@register("draft_model")
class DraftModelProposer(ProposerBase[DraftModelState]):
    default_checkpoint = f"{DEFAULT_MODEL_NAME}-draft"
    state_type = DraftModelState
    scores_vocabulary = True

    def __init__(self, ctx: ProposerContext):
        super().__init__(ctx)
        path = resolve_drafter_dir(ctx, self.default_checkpoint)
        quantization = drafter_quantization(ctx, path)
        self.model = load_model(path, ctx.dtype, ctx.device, quantization)
        check_fits_target(ctx, path, vocab_size=self.model.config.vocab_size)  # a separate model: any width
        # FR-Spec: only its frequent rows. The model's lm_head is set to the proposal's head by `propose`.
        self.draft_heads = draft_heads(ctx, self.model.lm_head)
        self.model.lm_head = self.draft_heads.sampled
        if self.model.config.max_position_embeddings < ctx.max_len:
            raise ConfigError(f"speculative_config.model: the drafter's context ({self.model.config.max_position_embeddings}) "
                              f"is shorter than the target's max_model_len ({ctx.max_len})")
        self.runner = Runner(self.model, ctx.num_slots, ctx.max_len, ctx.dtype, ctx.device, quantization,
                             compile=ctx.compile)
        widen_lean_path(self.runner)  # its catch-up forwards (accepted drafts + 1 tokens) are verification-wide
        self.p_min = ctx.config.draft_p_min
        self.compiled = ctx.compile
        # Greedy proposal or not -> (what its C++ drafting step was built from, the step or None): native_step.py
        self._native: dict[bool, tuple] = {}
        self.native_drafting = True  # False: always the Python step (A/B measurements)

    @torch.inference_mode()  # the C++ steps serve no autograd
    def propose(self, seqs, max_tokens, sampling: SamplingBatch, stop=None) -> Draft:
        k = max(max_tokens)
        chain = ChainDraft(max_tokens, self.model.config.vocab_size, self.device, self.p_min, stop)
        greedy = ChainDraft.one_hot(sampling)
        head = self.draft_heads.pick(greedy)
        if self.model.lm_head is not head:  # the runner's forwards and the C++ step score with the model's
            self.model.lm_head = head
        active = [b for b in range(len(seqs)) if max_tokens[b] > 0]
        # First forward: catch up on committed tokens the drafter has not seen.
        entries = {}
        for b in active:
            seq, state = seqs[b], self.state(seqs[b])
            state.proposal_base, state.num_fed = seq.num_tokens, 0
            entries[b] = ForwardEntry(seq.slot, seq.token_ids[state.num_cached:], start=state.num_cached)
        if self._draft_natively(seqs, active, entries, chain, max_tokens, sampling, greedy):
            return chain.result()
        batch_step = self._batch_step(sampling, greedy)
        for step in range(k):
            if not active:
                break
            step_entries = [entries[b] for b in active]
            drafted = batch_step(step_entries, None) if batch_step is not None else None
            if drafted is None:  # the Python step
                chosen = chain.add_step(active, step, self.runner.forward(step_entries).logits[:, 0], sampling)
            else:
                chosen = chain.record(active, step, drafted[1], drafted[2])
            token = dict(zip(active, chosen))
            active = chain.continuing(step, active, chosen, max_tokens)
            for b in active:
                seq = seqs[b]
                entries[b] = ForwardEntry(seq.slot, [token[b]], start=seq.num_tokens + step)
                self.state(seq).num_fed = step + 1
        return chain.result()

    def _native_step(self, greedy: bool) -> NativeDraftStep | None:
        """The draft model's step over this proposal's head as one C++ call (None: not served), rebuilt
        when its modules changed."""
        self._native[greedy] = current_or_rebuilt(self._native.get(greedy),
                                                  lambda watch: NativeDraftStep.for_draft_model(self.model, watch))
        return self._native[greedy][1]

    def _batch_step(self, sampling: SamplingBatch, greedy: bool):
        """A greedy batch's drafting step of several sequences as one C++ call (native_step.py
        `draft_batch`: entries -> (o, tokens, probabilities) or None), where served: the runner's
        batched forward does not serve a reduced draft head, and picks the tokens in Python."""
        if not native_batch_served(sampling, self.device, self.compiled, self.native_drafting):
            return None
        native = self._native_step(greedy)
        return None if native is None else native.batch_drafter(self.runner.kv_cache.k, self.runner.kv_cache.v)

    @torch.inference_mode()
    def _draft_natively(self, seqs, active: list[int], entries: dict[int, ForwardEntry], chain: ChainDraft,
                        max_tokens: list[int], sampling: SamplingBatch, greedy: bool) -> bool:
        """One sequence: draft its chain in C++ (native_step.py), where served (a step per head)."""
        temperature = native_temperature(active, sampling, chain, self.device, self.compiled, self.native_drafting)
        if temperature is None:
            return False
        native, (b,) = self._native_step(greedy), active
        layers = native.layers_serving() if native is not None and entries[b].token_ids else None
        if layers is None:
            return False
        seq, cache = seqs[b], self.runner.kv_cache
        steps = native.draft(layers, chain, b, max_tokens, entries[b].token_ids, None, seq.slot, entries[b].start,
                             seq.num_tokens, cache.k, cache.v, temperature, sampling.generators[b])
        self.state(seq).num_fed = steps - 1  # every drafted token but the last was fed back
        return True

    def pending_tokens(self, seq) -> int:
        state = self._states.get(seq.request_id)
        return seq.num_tokens - (state.num_cached if state is not None else 0)

    def on_commit(self, seqs, draft, verified, result) -> None:
        for seq, a in zip(seqs, verified.host()[1]):
            state = self._states.get(seq.request_id)
            if state is not None and state.proposal_base is not None:
                # Cached now: everything up to the last committed token, plus the accepted drafts it was fed.
                state.num_cached = state.proposal_base + min(a, state.num_fed)
                state.proposal_base = None

    def rollback(self, seqs) -> None:
        # The proposal's forwards wrote only columns from num_cached on: rewritten by the next one.
        for seq in seqs:
            state = self._states.get(seq.request_id)
            if state is not None:
                state.proposal_base = None
