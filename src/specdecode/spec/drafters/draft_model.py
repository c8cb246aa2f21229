"""`draft_model`: a separate small LM with the target's tokenizer and its own KV cache.

Its cache follows the committed tokens lazily. At propose time it is fed every committed
token it has not seen yet (the whole prompt the first time), then drafts autoregressively.
After verification it keeps the drafts that were accepted and that it had been fed; the
last draft of an all-accepted step was never fed, so the next step feeds it. Rejected
columns are simply overwritten (rollback = a length), as in the target's cache.
"""

from __future__ import annotations

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.runner import ForwardEntry, Runner
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model
from specdecode.sampling import SamplingBatch
from specdecode.spec.drafters.chain import ChainDraft
from specdecode.spec.proposer import (Draft, ProposerBase, ProposerContext, check_same_vocabulary, register,
                                      resolve_drafter_dir)


@register("draft_model")
class DraftModelProposer(ProposerBase):
    default_checkpoint = f"{DEFAULT_MODEL_NAME}-draft"

    def __init__(self, ctx: ProposerContext):
        path = resolve_drafter_dir(ctx, self.default_checkpoint)
        self.model = load_model(path, ctx.dtype, ctx.device)
        check_same_vocabulary(path, self.model.config.vocab_size, ctx)
        if self.model.config.max_position_embeddings < ctx.max_len:
            raise ConfigError(f"speculative_config.model: the drafter's context ({self.model.config.max_position_embeddings}) "
                              f"is shorter than the target's max_model_len ({ctx.max_len})")
        self.runner = Runner(self.model, ctx.num_slots, ctx.max_len, ctx.dtype, ctx.device)
        self.p_min = ctx.config.draft_p_min
        self.device = ctx.device

    def propose(self, seqs, max_tokens, sampling: SamplingBatch) -> Draft:
        k = max(max_tokens)
        chain = ChainDraft(len(seqs), k, self.model.config.vocab_size, self.device, self.p_min, self.draft_stop)
        active = [b for b in range(len(seqs)) if max_tokens[b] > 0]
        # First forward: catch up on committed tokens the drafter has not seen.
        entries = {}
        for b in active:
            seq = seqs[b]
            cached = seq.drafter_state.get("draft_cached", 0)
            seq.drafter_state["draft_base"] = seq.num_tokens
            seq.drafter_state["draft_fed"] = 0
            entries[b] = ForwardEntry(seq.slot, seq.token_ids[cached:], start=cached)
        for step in range(k):
            if not active:
                break
            result = self.runner.forward([entries[b] for b in active])
            chosen = chain.add_step(active, step, result.logits[:, 0], sampling)
            token = dict(zip(active, chosen))
            active = chain.continuing(step, active, chosen, max_tokens)
            for b in active:
                seq = seqs[b]
                entries[b] = ForwardEntry(seq.slot, [token[b]], start=seq.num_tokens + step)
                seq.drafter_state["draft_fed"] = step + 1
        return chain.result()

    def pending_tokens(self, seq) -> int:
        return seq.num_tokens - seq.drafter_state.get("draft_cached", 0)

    def on_commit(self, seqs, draft, verified, result) -> None:
        accepted = verified.num_accepted.tolist()
        for seq, a in zip(seqs, accepted):
            state = seq.drafter_state
            if "draft_base" in state:
                # Cached now: everything up to the last committed token, plus the accepted drafts it was fed.
                state["draft_cached"] = state.pop("draft_base") + min(a, state.pop("draft_fed"))
