"""Lossless verification of a chain draft: a pure function, no model code.

Vocabulary (used throughout specdecode):
- **target**: the model whose distribution p must be reproduced exactly.
- **draft tokens** x_1..x_k: the drafter's guesses for one step, with draft distribution q.
- **accepted**: draft tokens the verifier keeps. Greedy: x_i is accepted while it equals the
  target's argmax. Sampling: x_i is accepted with probability min(1, p(x_i) / q(x_i)).
- **recovered**: at the first rejected position, a token sampled from
  norm(max(0, p - q)); the step ends there.
- **bonus**: when all k drafts are accepted, one more token sampled from the target's
  distribution after the last draft.
A step therefore commits num_accepted + 1 tokens. This is the rule of Leviathan et al.,
"Fast Inference from Transformers via Speculative Decoding" (ICML 2023) and Chen et al.,
"Accelerating LLM Decoding with Speculative Sampling" (2023); its output distribution
equals the target's. When a drafter chose its tokens deterministically (n-gram, argmax),
q is one-hot: acceptance probability is p(x) and the residual is p with x removed.

**Keyed** rows (exact mode, seeded) use the greedy rule instead: the target's token at each
position is the race argmax(p / E) with noise E a pure function of (seed, position, token),
exactly what plain decoding draws there, and x_i is accepted while it equals that token.
Lossless by construction, and the output is plain decoding's, token for token.

p and q are the *processed* distributions (adjustments, then temperature, min_p, top-k,
top-p), computed by the same `adjust_logits` and `process_logits` that non-speculative
sampling uses. Verification row j of a sequence (the target's logits after x_1..x_j) is
adjusted with x_1..x_j as context and under the grammar's mask after them (`rows`, built by
the speculator), exactly what plain decoding would use had it produced x_1..x_j.

Shapes are fixed and padded with -1 so the batch stays ragged without Python loops over
tokens: every row b has its own num_draft[b] <= k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdecode.sampling import (SamplingBatch, adjust_logits, argmax, argmax_host, inverse_cdf, native_sampling,
                                 process_logits, race_noise, uniform_draws)

if TYPE_CHECKING:
    from specdecode.speculative.propose.proposer import Draft


class Verified:
    """One step's verification result. The greedy rule and the step without a draft make it on the
    host (`from_host`); its tensors are then built only if something asks for them (nothing on the
    engine's path does: building them was ~3.5 us a tensor, 7 us of every greedy step at batch 1)."""

    __slots__ = ("_token_ids", "_num_accepted", "path", "_host", "_device")

    def __init__(self, token_ids: torch.Tensor, num_accepted: torch.Tensor, path: torch.Tensor | None = None):
        self._token_ids = token_ids  # [B, k + 1] committed tokens per row, padded with -1
        self._num_accepted = num_accepted  # [B] accepted draft tokens; row b commits num_accepted[b] + 1 tokens
        self.path = path  # [B, depth] trees: accepted node indices along the path, -1 padded
        self._host: tuple[list[list[int]], list[int]] | None = None  # (token_ids, num_accepted) as lists
        self._device = token_ids.device

    @classmethod
    def from_host(cls, token_ids: list[list[int]], num_accepted: list[int], device) -> "Verified":
        """From host lists (rows padded with -1 to one width)."""
        verified = cls.__new__(cls)
        verified._token_ids = verified._num_accepted = verified.path = None
        verified._host, verified._device = (token_ids, num_accepted), device
        return verified

    @property
    def token_ids(self) -> torch.Tensor:
        if self._token_ids is None:
            self._token_ids = torch.tensor(self._host[0], dtype=torch.long, device=self._device)
        return self._token_ids

    @property
    def num_accepted(self) -> torch.Tensor:
        if self._num_accepted is None:
            self._num_accepted = torch.tensor(self._host[1], dtype=torch.long, device=self._device)
        return self._num_accepted

    def host(self) -> tuple[list[list[int]], list[int]]:
        """(token_ids, num_accepted) as host lists: the speculator and every proposer's commit read
        them, so they are read back once (the greedy rule makes them on the host to begin with)."""
        if self._host is None:
            self._host = (self._token_ids.tolist(), self._num_accepted.tolist())
        return self._host


def skip_uniform_draws(cols: int, generators: list[torch.Generator | None], device) -> None:
    """Advance each seeded row's generator as `verify`'s acceptance draws would (`cols` float32
    uniforms), without drawing for the other rows: a step with nothing to verify then samples its
    token as plain decoding does, drawing what `verify`'s final token would, so seeded streams stay
    batch-independent."""
    for gen in generators:
        if gen is not None:
            torch.rand(cols, device=device, generator=gen)


def verify(
    draft: Draft,  # token_ids [B, k] int64 (-1 padded), num_tokens [B], probs [B, k, V] processed q or None (one-hot)
    # [B, k + 1, V] float32 at [last token, x_1 .. x_k]; an all-greedy batch without `rows` may pass fewer
    # positions, at least 1 + max(num_draft) (the positions past a row's drafts are never read there)
    target_logits: torch.Tensor,
    sampling: SamplingBatch,  # one row per sequence
    rows: SamplingBatch | None = None,  # B * (k + 1) rows, one per position, with draft context; None = repeats
    choices: list[list[int]] | None = None,  # [B][n] the raw logits' argmaxes, where the forward took them
) -> Verified:
    B, k = draft.shape
    device = target_logits.device
    V = target_logits.shape[-1]
    if rows is not None and rows.adjusts:
        target_logits = adjust_logits(target_logits.reshape(B * (k + 1), V), rows).view(B, k + 1, V)
    if sampling.all_deterministic and not sampling.keyed_rows:  # on the host lists (a chain drafter's own)
        adjusted = rows is not None and rows.adjusts
        return _greedy(*draft.host(), choices if choices is not None and not adjusted else argmax_host(target_logits),
                       device)
    if B == 1 and not sampling.keyed_rows and not sampling.greedy[0]:  # one sampled row
        tokens, num = draft.host()
        return _one_sampled_row(tokens[0], num[0], draft.probs, target_logits, sampling, rows)
    draft_token_ids, num_draft, draft_probs = draft.token_ids, draft.num_tokens, draft.probs
    positions = torch.arange(k, device=device)[None, :]  # [1, k]
    in_draft = positions < num_draft[:, None]  # [B, k]
    safe_drafts = draft_token_ids.clamp(min=0)
    if rows is None:
        rows = sampling.repeat_rows([k + 1] * B)

    # Deterministic rule (greedy and keyed rows): accept while the draft equals the target's own
    # choice; the token at the first mismatch (or after the last draft) is its choice there.
    p = exact = None
    if sampling.keyed_rows or any(sampling.greedy):
        choice = argmax(target_logits)  # [B, k + 1]
        if sampling.keyed_rows:
            keyed = torch.tensor(sampling.keyed_rows, device=device)
            p = process_logits(target_logits.reshape(B * (k + 1), V), rows).view(B, k + 1, V)
            noise = race_noise(rows.select([r * (k + 1) + j for r in sampling.keyed_rows for j in range(k + 1)]), V)
            race = p[keyed] / noise.view(len(sampling.keyed_rows), k + 1, V)  # plain decoding's draw at each position
            choice = choice.index_copy(0, keyed, race.argmax(dim=-1))
        exact_ok = (draft_token_ids == choice[:, :k]) & in_draft
        exact_accepted = exact_ok.long().cumprod(dim=1).sum(dim=1)  # [B]
        exact = (exact_accepted, choice.gather(1, exact_accepted[:, None])[:, 0])
        if sampling.all_deterministic:
            return _assemble(draft_token_ids, *exact)

    # Sampling rule (rows with temperature > 0 that are not keyed).
    if p is None:
        p = process_logits(target_logits.reshape(B * (k + 1), V), rows).view(B, k + 1, V)
    p_draft = p[:, :k].gather(2, safe_drafts[:, :, None])[:, :, 0]  # [B, k] p(x_i)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, safe_drafts[:, :, None])[:, :, 0]  # [B, k] q(x_i)
    u = uniform_draws(B, k, sampling.generators, device)
    accept = (u * q_draft < p_draft) & in_draft  # u < p/q without dividing by q
    sampled_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    # The final token's distribution, at the position after the accepted drafts only: the residual
    # max(0, p - q) at a rejection, else p (the bonus); `inverse_cdf` normalises it.
    batch = torch.arange(B, device=device)
    p_at = p[batch, sampled_accepted]  # [B, V]
    rejected_at = sampled_accepted.clamp(max=k - 1)  # the rejected position, where there is one
    if draft_probs is None:  # q one-hot at the draft: the residual is p without the drafted token
        residual_at = p_at.scatter(1, safe_drafts[batch, rejected_at][:, None], 0.0)
    else:
        residual_at = (p_at - draft_probs[batch, rejected_at]).clamp_(min=0)
    # p == q exactly makes rejection impossible in theory; guard the float-rounding case.
    use_residual = (sampled_accepted < num_draft) & (residual_at.sum(dim=-1) > 0)
    final_dist = torch.where(use_residual[:, None], residual_at, p_at)
    final_token = inverse_cdf(final_dist, uniform_draws(B, 1, sampling.generators, device, torch.float64)[:, 0])
    if exact is None:
        return _assemble(draft_token_ids, sampled_accepted, final_token)

    deterministic = sampling.temperature == 0
    if sampling.keyed_rows:
        deterministic = deterministic.index_fill(0, keyed, True)
    num_accepted = torch.where(deterministic, exact[0], sampled_accepted)
    return _assemble(draft_token_ids, num_accepted, torch.where(deterministic, exact[1], final_token))


def _one_sampled_row(drafts: list[int], num_draft: int, draft_probs: torch.Tensor | None,
                     target_logits: torch.Tensor, sampling: SamplingBatch, rows: SamplingBatch | None) -> Verified:
    """The sampling rule for a batch of one sampled, unkeyed row, as `verify` computes it (the same
    ops on the same values, the same draws in the same order, so the same tokens) with the
    acceptance walk on the host: about half the tensor ops (~10 us each after a forward), with p
    at the drafted tokens gathered once and only the final position's residual built. On a CPU the
    walk and the final draw after p are one C++ call (`verify_sampled_row`, kernels/decode_stack_cpu.cpp:
    MTP k=4 at T=1, batch 1, 236 -> 98 us a verification with the C++ inverse CDF)."""
    k, V = len(drafts), target_logits.shape[-1]
    device = target_logits.device
    logits = target_logits.reshape(k + 1, V)
    if rows is None and not sampling.needs_filter and sampling.min_p is None:  # a temperature alone
        p = torch.softmax(logits / sampling.temperature[:, None], dim=-1)  # processed_logits' division, row for row
    else:
        p = process_logits(logits, sampling.repeat_rows([k + 1]) if rows is None else rows)  # [k + 1, V]
    u = uniform_draws(1, k, sampling.generators, device)  # [1, k]
    native = native_sampling() if device.type == "cpu" and p.dtype == torch.float32 else None
    if native is not None and (draft_probs is None or draft_probs.dtype == torch.float32):
        # The rule below in one C++ call (the same float32 compares, the same float64 sums: the same tokens).
        u_final = float(uniform_draws(1, 1, sampling.generators, device, torch.float64)[0, 0])
        q = None if draft_probs is None else draft_probs[0].contiguous()
        accepted, token = native.verify_sampled_row(p.contiguous(), q, drafts, num_draft, u[0], u_final)
        return _one_row_verified(drafts, accepted, token, device)
    at_drafts = torch.tensor([j * V + drafts[j] for j in range(num_draft)], dtype=torch.long, device=device)
    p_draft = p.view(-1)[at_drafts]  # [n] p(x_j)
    if draft_probs is None:  # one-hot q: accepted with probability p(x_j)
        accept = (u[0, :num_draft] < p_draft).tolist()
    else:
        q = draft_probs[0]  # [k, V]
        accept = (u[0, :num_draft] * q.reshape(-1)[at_drafts] < p_draft).tolist()
    accepted = accept.index(False) if False in accept else num_draft
    # The final token: from the residual max(0, p - q) at a rejection (q one-hot: p without the
    # drafted token), else from p (the bonus); a residual of no mass (p == q up to rounding) takes p.
    final_dist = p[accepted]  # [V]
    if accepted < num_draft:
        if draft_probs is None:
            residual = final_dist.clone()
            residual[drafts[accepted]] = 0.0
        else:
            residual = (final_dist - q[accepted]).clamp_(min=0)
        if bool(residual.sum() > 0):
            final_dist = residual
    token = int(inverse_cdf(final_dist[None], uniform_draws(1, 1, sampling.generators, device, torch.float64)[:, 0]))
    return _one_row_verified(drafts, accepted, token, device)


def _one_row_verified(drafts: list[int], accepted: int, token: int, device) -> Verified:
    """One row's Verified: its accepted drafts, then the final token, -1 padded to k + 1."""
    k = len(drafts)
    tokens = drafts[:accepted] + [token] + [-1] * (k - accepted)
    return Verified.from_host([tokens], [accepted], device)


def _greedy(drafts: list[list[int]], num_draft: list[int], choice: list[list[int]], device) -> Verified:
    """The deterministic rule on the host, from the target's choices [B][k + 1]: a row commits its
    choices up to and including the first one its draft does not match (or the one after its last
    draft). The tensor ops this replaces cost ~10 us each after a forward (their code and data
    evicted by the weights); the choices are read back once, and the comparisons are a few
    integer compares a row."""
    k = len(drafts[0]) if drafts else 0
    tokens, accepted = [], []
    for draft, limit, row in zip(drafts, num_draft, choice):
        n = 0
        while n < limit and draft[n] == row[n]:
            n += 1
        accepted.append(n)
        tokens.append(row[: n + 1] + [-1] * (k - n))
    return Verified.from_host(tokens, accepted, device)


def _assemble(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> Verified:
    """[accepted drafts..., final token, -1 ...] per row."""
    B, k = draft_token_ids.shape
    cols = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    padded = torch.cat([draft_token_ids, torch.full_like(draft_token_ids[:, :1], -1)], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded, torch.full_like(padded, -1))
    out = torch.where(cols == num_accepted[:, None], final_token[:, None], out)
    return Verified(out, num_accepted)
