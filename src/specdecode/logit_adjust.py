"""Context-dependent logit adjustments: bad words, logit_bias, penalties, grammar masks.

vLLM's semantics and order: bad words (-inf), logit_bias (+b), repetition penalty (tokens seen
in the prompt or output: positive logits / r, negative x r), frequency penalty (- f x count in
the output), presence penalty (- p once in the output), then the grammar's mask (-inf).

The hard part under speculation is *where* a row's context ends. A plain decoding row's
context is its committed output; a verification row at draft position j also holds the
draft tokens before j (a tree node: the tokens on its path), and so does a drafter's row at
its step j. Every processed row therefore carries `extra_tokens` [N, D], the tokens beyond
the committed ones on its path (-1 padded), and the adjustments count them in vectorised:
penalties scatter-add them onto the committed counts, bad words compare the last tokens of
(committed tail + extras) with each word's prefix. No Python loop over tokens or positions.

`LogitAdjust` holds the per-sequence part (counts of the committed output, the prompt's
tokens, biases, words) for the rows that use an adjustment only, so rows that do not ask
pay nothing.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(slots=True)
class RowHistory:
    """What an adjustment needs of one sequence (built by the engine)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    bad_word_ids: list[list[int]]  # each bad word's token ids (with and without a leading space)


@dataclasses.dataclass(slots=True)
class _BadWords:
    """Bad words of the adjusted rows, grouped by prefix length (host-built, small)."""

    groups: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]  # (m, owner [W], prefix [W, m], last [W])
    history_tail: torch.Tensor  # [A, M] last M committed output tokens, -1 left-padded
    max_prefix: int  # M

    @classmethod
    def build(cls, word_lists: list[list[list[int]]], outputs: list[list[int]], device) -> "_BadWords | None":
        by_length: dict[int, list[tuple[int, list[int]]]] = {}
        for a, words in enumerate(word_lists):
            for ids in words:
                by_length.setdefault(len(ids) - 1, []).append((a, ids))
        if not by_length:
            return None
        M = max(by_length)
        groups = []
        for m, items in sorted(by_length.items()):
            owner = torch.tensor([a for a, _ in items], device=device)
            prefix = torch.tensor([ids[:-1] for _, ids in items], dtype=torch.long, device=device).view(len(items), m)
            last = torch.tensor([ids[-1] for _, ids in items], dtype=torch.long, device=device)
            groups.append((m, owner, prefix, last))
        tail = torch.tensor([[-1] * (M - len(out[-M:] if M else [])) + (out[-M:] if M else []) for out in outputs],
                            dtype=torch.long, device=device).view(len(outputs), M)
        return cls(groups, tail, M)

    def banned(self, a: torch.Tensor, extra: torch.Tensor | None, vocab: int) -> torch.Tensor:
        """[R, V] bool: tokens each row may not produce next (a: [R] adjusted-row index)."""
        M = self.max_prefix
        tail = self.history_tail[a]  # [R, M]
        if M and extra is not None and extra.shape[1]:
            context = torch.cat([tail, extra], dim=1)  # [R, M + D], extras left-aligned
            depth = (extra >= 0).sum(dim=1)  # [R]
            tail = context.gather(1, depth[:, None] + torch.arange(M, device=a.device)[None, :])  # last M tokens
        ban = torch.zeros(len(a), vocab, device=a.device)
        for m, owner, prefix, last in self.groups:
            match = a[:, None] == owner[None, :]  # [R, W]: the row has this word
            if m:
                match = match & (tail[:, None, M - m:] == prefix[None, :, :]).all(dim=-1)
            ban.scatter_add_(1, last[None, :].expand(len(a), -1), match.float())
        return ban > 0


@dataclasses.dataclass(slots=True)
class LogitAdjust:
    """The adjustments of one step's batch: per adjusted sequence, shared by every view of it
    (drafting rows, verification positions, logprob rows)."""

    local: list[int]  # base row -> index among the adjusted rows, -1 = not adjusted (host)
    vocab: int
    bias: torch.Tensor | None  # [A, V] float32 logit_bias
    output_counts: torch.Tensor | None  # [A, V] float32 counts of committed output tokens (penalties)
    prompt_seen: torch.Tensor | None  # [A, V] bool prompt tokens (repetition penalty)
    repetition: torch.Tensor  # [A] (1 = off)
    frequency: torch.Tensor  # [A]
    presence: torch.Tensor  # [A]
    bad_words: _BadWords | None

    @classmethod
    def build(cls, params: list, histories: list[RowHistory | None], vocab: int, device) -> "LogitAdjust | None":
        """params: SamplingParams per base row; histories: per base row (None for rows that adjust nothing)."""
        rows = [b for b, p in enumerate(params) if p.adjusts_logits]
        if not rows:
            return None
        local = [-1] * len(params)
        for a, b in enumerate(rows):
            local[b] = a
        ps = [params[b] for b in rows]
        hs = [histories[b] for b in rows]
        A = len(rows)
        bias = None
        if any(p.logit_bias for p in ps):
            bias = torch.zeros(A, vocab, device=device)
            for a, p in enumerate(ps):
                if p.logit_bias:
                    bias[a, torch.tensor(list(p.logit_bias), device=device)] = torch.tensor(
                        list(p.logit_bias.values()), device=device)
        output_counts = prompt_seen = None
        if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in ps):
            output_counts = torch.zeros(A, vocab, device=device)
            prompt_seen = torch.zeros(A, vocab, dtype=torch.bool, device=device)
            for a, (p, h) in enumerate(zip(ps, hs)):
                if h.output_token_ids:
                    out = torch.tensor(h.output_token_ids, device=device)
                    output_counts[a].scatter_add_(0, out, torch.ones_like(out, dtype=torch.float32))
                if p.repetition_penalty != 1.0:
                    prompt_seen[a, torch.tensor(h.prompt_token_ids, device=device)] = True

        def column(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(p, name)) for p in ps], device=device)

        bad = None
        if any(p.bad_words for p in ps):
            bad = _BadWords.build([h.bad_word_ids for h in hs], [h.output_token_ids for h in hs], device)
        return cls(local, vocab, bias, output_counts, prompt_seen, column("repetition_penalty"),
                   column("frequency_penalty"), column("presence_penalty"), bad)

    def apply(self, logits: torch.Tensor, base_rows: list[int], extra: torch.Tensor | None) -> torch.Tensor:
        """logits [N, V] of rows whose sequences are base_rows[i] (host), extra [N, D] tokens
        beyond the committed ones on each row's path (-1 padded) -> adjusted logits (a new tensor
        where any row changes)."""
        sel = [i for i, b in enumerate(base_rows) if self.local[b] >= 0]
        if not sel:
            return logits
        device = logits.device
        r = torch.tensor(sel, device=device)
        a = torch.tensor([self.local[base_rows[i]] for i in sel], device=device)
        x = logits[r]  # [R, V]
        ext = None if extra is None or extra.shape[1] == 0 else extra[r]
        if self.bad_words is not None:
            x = x.masked_fill(self.bad_words.banned(a, ext, x.shape[1]), float("-inf"))
        if self.bias is not None:
            x = x + self.bias[a]
        if self.output_counts is not None:
            counts = self.output_counts[a]  # [R, V]
            if ext is not None:
                counts = counts.scatter_add(1, ext.clamp(min=0), (ext >= 0).float())
            in_output = counts > 0
            rep = self.repetition[a][:, None]
            seen = self.prompt_seen[a] | in_output
            x = torch.where(seen & (rep != 1.0), torch.where(x > 0, x / rep, x * rep), x)
            x = x - self.frequency[a][:, None] * counts - self.presence[a][:, None] * in_output.float()
        return logits.index_copy(0, r, x)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_grammar_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V]; bitmask [G, ceil(V / 32)] int32 (bit t of word t // 32 set = token t allowed)
    for rows[g] -> logits with every disallowed token of those rows at -inf."""
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    V = logits.shape[1]
    allowed = ((bitmask.to(device)[:, :, None] >> shifts) & 1).view(len(rows), -1)[:, :V].bool()  # [G, V]
    r = torch.tensor(rows, device=device)
    return logits.index_copy(0, r, logits[r].masked_fill(~allowed, float("-inf")))


def path_tokens(token_ids: torch.Tensor, parents: torch.Tensor | None = None) -> torch.Tensor:
    """The draft tokens before each verification row: [B, n] draft (chain, or tree nodes with
    parents [B, n], -1 = root, padding -2) -> [B, n + 1, n] where row 0 is the root (nothing
    drafted before it) and row i + 1 holds node i's path (its ancestors and itself, root side
    first), -1 padded. A chain is the tree whose node i has parent i - 1."""
    B, n = token_ids.shape
    device = token_ids.device
    if parents is None:
        cols = torch.arange(n, device=device)
        ancestor = cols[None, :] <= cols[:, None]  # [n, n] node j on node i's path: j <= i
        on_path = ancestor[None].expand(B, n, n)
    else:
        # on_path[b, i, j]: node j is node i or one of its ancestors (a loop over depth levels, not tokens).
        on_path = torch.eye(n, dtype=torch.bool, device=device)[None].expand(B, n, n).clone()
        current = parents.clone()
        batch = torch.arange(B, device=device)[:, None].expand(B, n)
        node = torch.arange(n, device=device)[None, :].expand(B, n)
        while True:
            has = current >= 0
            if not bool(has.any()):
                break
            on_path[batch[has], node[has], current[has]] = True
            current = torch.where(has, parents.gather(1, current.clamp(min=0)), torch.full_like(current, -1))
    # Left-align each row's path tokens in node order (parents precede children: root side first).
    order = torch.where(on_path, torch.arange(n, device=device)[None, None, :], n + torch.arange(n, device=device))
    index = order.argsort(dim=-1)  # [B, n, n]
    tokens = token_ids[:, None, :].expand(B, n, n).gather(2, index)
    keep = on_path.gather(2, index)
    rows = torch.where(keep, tokens, torch.full_like(tokens, -1))
    return torch.cat([torch.full_like(rows[:, :1], -1), rows], dim=1)
