"""Log probabilities of committed tokens, and of prompt tokens.

An output token's logprob is taken from the distribution it was sampled from: the target's
adjusted logits (penalties, bias, bad words, grammar) after temperature, min_p, top-k and
top-p (`processed_logits`), at the token's position, with the same context a plain decoding
step has there. Plain decoding, a verified draft token, a recovered token and a bonus token
all go through `token_logprobs`, with the target's logits at that position and the draft
tokens committed before it as context, so the values agree whichever path produced the token.
Greedy rows use temperature 1 and no filters (vLLM's processed logprobs).

Prompt logprobs are of the model's raw distribution (nothing was sampled there).

Only rows that ask are computed, and each call makes one device-to-host copy.
"""

from __future__ import annotations

import dataclasses

import torch

from specdecode.sampling import SamplingBatch, adjust_logits, processed_logits


@dataclasses.dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # the most likely tokens, best first: (token id, logprob)


def _gather(logprobs: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logprobs [R, V] -> each row's token's logprob, rank and its num_top[r] best tokens."""
    device = logprobs.device
    token = torch.tensor(tokens, device=device)
    chosen = logprobs.gather(1, token[:, None])  # [R, 1]
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    n = max(num_top, default=0)
    parts = [chosen, rank.to(chosen.dtype)]
    if n:
        top = logprobs.topk(n, dim=-1)
        parts += [top.values, top.indices.to(chosen.dtype)]
    host = torch.cat(parts, dim=1).tolist()  # one copy for everything
    out = []
    for r, row in enumerate(host):
        top = list(zip((int(t) for t in row[2 + n: 2 + n + num_top[r]]), row[2: 2 + num_top[r]])) if n else []
        out.append(TokenLogprob(tokens[r], row[0], int(row[1]), top))
    return out


def token_logprobs(logits: torch.Tensor, batch: SamplingBatch, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Raw logits [R, V] at R committed positions, the batch of those rows (their draft context
    and grammar masks included) and the tokens committed there -> one TokenLogprob per row."""
    processed = processed_logits(adjust_logits(logits, batch), batch)
    return _gather(torch.log_softmax(processed, dim=-1), tokens, num_top)


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], num_top: int) -> list[TokenLogprob | None]:
    """logits [T, V] at every prompt position -> [None (the first token has no context), then
    each later prompt token's logprob under the raw distribution after its prefix]."""
    if len(prompt_token_ids) < 2:
        return [None] * len(prompt_token_ids)
    logprobs = torch.log_softmax(logits[: len(prompt_token_ids) - 1].float(), dim=-1)
    return [None] + _gather(logprobs, prompt_token_ids[1:], [num_top] * (len(prompt_token_ids) - 1))
