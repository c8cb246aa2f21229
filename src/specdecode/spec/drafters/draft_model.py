"""`draft_model`: a separate small LM with the target's tokenizer and its own KV cache.

Its cache follows the committed tokens lazily. At propose time it is fed every committed
token it has not seen yet (the whole prompt the first time), then drafts autoregressively.
After verification it keeps the drafts that were accepted and that it had been fed; the
last draft of an all-accepted step was never fed, so the next step feeds it. Rejected
columns are simply overwritten (rollback = a length), as in the target's cache.
"""

from __future__ import annotations

import torch

from specdecode.defaults import DEFAULT_MODEL_NAME
from specdecode.engine.runner import ForwardEntry, Runner
from specdecode.errors import ConfigError
from specdecode.models.loader import load_model
from specdecode.sampling import SamplingBatch, exponential_noise, process_logits
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
        B, k = len(seqs), max(max_tokens)
        V = self.model.config.vocab_size
        token_ids = torch.full((B, k), -1, dtype=torch.long, device=self.device)
        probs = torch.zeros(B, k, V, device=self.device)
        # Confidence of position i = the drafter's top probability there: it depends on the
        # prefix only, not on the token drawn at i, which keeps D-Cut pruning lossless.
        confidence = torch.zeros(B, k, device=self.device)
        num = [0] * B
        active = [b for b in range(B) if max_tokens[b] > 0]
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
            rows = torch.tensor(active, device=self.device)
            sub = SamplingBatch(sampling.temperature[rows], sampling.top_k[rows], sampling.top_p[rows],
                                [sampling.generators[b] for b in active], sampling.all_greedy, sampling.needs_filter)
            logits = result.logits[:, 0]  # [A, V]
            q = process_logits(logits, sub)  # [A, V]
            greedy = logits.argmax(dim=-1)
            if sub.all_greedy:
                chosen = greedy
            else:
                noise = exponential_noise(len(active), V, sub.generators, self.device)
                chosen = torch.where(sub.temperature > 0, (q / noise).argmax(dim=-1), greedy)
            token_ids[rows, step] = chosen
            probs[rows, step] = q
            top_prob = q.max(dim=-1).values
            confidence[rows, step] = top_prob
            chosen_host = chosen.tolist()
            # p_min (llama.cpp): stop at the first token the drafter is unsure of, dropping it.
            confident = (top_prob >= self.p_min).tolist() if self.p_min > 0 else [True] * len(active)
            still = []
            for i, b in enumerate(active):
                if not confident[i]:
                    token_ids[b, step] = -1
                    continue
                num[b] += 1
                if num[b] < max_tokens[b]:
                    seq = seqs[b]
                    start = seq.num_tokens + num[b] - 1
                    entries[b] = ForwardEntry(seq.slot, [chosen_host[i]], start=start)
                    seq.drafter_state["draft_fed"] = num[b]
                    still.append(b)
            active = still
        return Draft(token_ids, torch.tensor(num, device=self.device), probs, confidence)

    def on_commit(self, seqs, draft, verified, result) -> None:
        accepted = verified.num_accepted.tolist()
        for seq, a in zip(seqs, accepted):
            state = seq.drafter_state
            if "draft_base" in state:
                # Cached now: everything up to the last committed token, plus the accepted drafts it was fed.
                state["draft_cached"] = state.pop("draft_base") + min(a, state.pop("draft_fed"))
