"""The drafter contract: the `Proposer` protocol, the `Draft` it returns, what it may use of
the target (`ProposerContext`), and `ProposerBase`, which keeps each request's typed drafter
state and frees it on release.

A proposer sees the target only through its context: the model (for shared embeddings, LM
head and features), the cache geometry and the ragged-batch grouping. Depth policy reaches
it as plain arguments: how many tokens each row may draft and, for chain drafters, a stop
rule (`stop`) applied after each drafter step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Generic, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from specdecode.engine.ragged import LengthGrouping
    from specdecode.engine.runner import ForwardResult
    from specdecode.engine.sequence import Sequence
    from specdecode.models.llama import LlamaForCausalLM
    from specdecode.models.quant import QuantScheme
    from specdecode.sampling import SamplingBatch
    from specdecode.speculative.config import SpeculativeConfig
    from specdecode.speculative.verify.chain import Verified
    from specdecode.tokenizer import Tokenizer

# After drafter step `step`: (step, confidences of each row's kept drafts so far, rows still
# drafting) -> the rows that draft further. Confidences depend on tokens before `step` only.
DraftStop = Callable[[int, list[list[float]], list[int]], list[int]]


class Draft:
    """A step's draft. Chain drafters (n-gram, `ChainDraft`) make it on the host (`from_host`): its
    tensors are then built only where something asks for them (the greedy rule, entry building and
    the depth policy read the host lists; building the three tensors and reading them back was
    ~40 us of a W4A8 MTP step's host work at batch 1, paid cold after the drafting call)."""

    __slots__ = ("_token_ids", "_num_tokens", "probs", "_confidence", "parents", "_host", "_device")

    def __init__(self, token_ids: torch.Tensor, num_tokens: torch.Tensor, probs: torch.Tensor | None = None,
                 confidence: torch.Tensor | None = None, parents: torch.Tensor | None = None):
        self._token_ids = token_ids  # [B, k] int64, padded with -1
        self._num_tokens = num_tokens  # [B] int64 drafts per sequence (0 = decode normally this step)
        self.probs = probs  # [B, k, V] processed draft distribution q; None = one-hot drafts
        self._confidence = confidence  # [B, k] drafter's estimate that each token is accepted
        self.parents = parents  # [B, k] tree drafts: parent node (-1 root, -2 padding); None = chain
        # (token_ids, num_tokens, confidence or None) as host lists, once read or as made
        self._host: tuple[list[list[int]], list[int], list[list[float]] | None] | None = None
        self._device = num_tokens.device

    @classmethod
    def from_host(cls, token_ids: list[list[int]], num_tokens: list[int], device, probs: torch.Tensor | None = None,
                  confidence: list[list[float]] | None = None) -> "Draft":
        """A chain draft from host lists: token_ids [B][k] (-1 padded), confidence [B][k] or None."""
        draft = cls.__new__(cls)
        draft._token_ids = draft._num_tokens = draft._confidence = draft.parents = None
        draft.probs, draft._host, draft._device = probs, (token_ids, num_tokens, confidence), device
        return draft

    @property
    def token_ids(self) -> torch.Tensor:
        if self._token_ids is None:
            tokens = self._host[0]
            self._token_ids = torch.tensor(tokens, dtype=torch.long, device=self._device).view(
                len(tokens), len(tokens[0]) if tokens else 0)
        return self._token_ids

    @property
    def num_tokens(self) -> torch.Tensor:
        if self._num_tokens is None:
            self._num_tokens = torch.tensor(self._host[1], dtype=torch.long, device=self._device)
        return self._num_tokens

    @property
    def confidence(self) -> torch.Tensor | None:
        if self._confidence is None and self._host is not None and self._host[2] is not None:
            self._confidence = torch.tensor(self._host[2], device=self._device).view(self.shape)
        return self._confidence

    @property
    def shape(self) -> tuple[int, int]:
        """(B, k): sequences, draft width."""
        if self._token_ids is not None:
            return self._token_ids.shape[0], self._token_ids.shape[1]
        tokens = self._host[0]
        return len(tokens), len(tokens[0]) if tokens else 0

    def host(self) -> tuple[list[list[int]], list[int]]:
        """(token_ids, num_tokens) as host lists (read back once where the draft was made as tensors)."""
        if self._host is None:
            confidence = self._confidence.tolist() if self._confidence is not None else None
            self._host = (self._token_ids.tolist(), self._num_tokens.tolist(), confidence)
        return self._host[0], self._host[1]

    def confidence_host(self) -> list[list[float]] | None:
        self.host()
        return self._host[2]

    @classmethod
    def empty(cls, batch_size: int, device, tree: bool = False) -> "Draft":
        """No draft tokens for any row (tree=True: an empty tree, so the step is verified by the
        tree walk and a seeded row draws the same random numbers as in a step that drafted)."""
        none = torch.full((batch_size, 0), -1, dtype=torch.long, device=device)
        return cls(none, torch.zeros(batch_size, dtype=torch.long, device=device),
                   parents=torch.full_like(none, -2) if tree else None)

    def truncate(self, limits: list[int], num_tokens: list[int] | None = None) -> "Draft":
        """Keep at most limits[b] tokens (tree: nodes) of sequence b; what is kept is unchanged.
        A chain made on the host is cut on the host; `num_tokens`: the rows' lengths on the host,
        where at hand. A one-row chain is then cut by views, with nothing to mask (the masked cut's
        ~7 tensor ops were ~30 us of a W4A8 step at batch 1; one row's columns stay contiguous)."""
        if self._token_ids is None:  # made on the host
            tokens, num, confidence = self._host
            kept = [min(n, limit) for n, limit in zip(num, limits)]
            k = min(max(limits, default=0), len(tokens[0]) if tokens else 0)  # as the tensor cut below
            return Draft.from_host([row[:n] + [-1] * (k - n) for row, n in zip(tokens, kept)], kept, self._device,
                                   self.probs[:, :k] if self.probs is not None else None,
                                   None if confidence is None else [row[:k] for row in confidence])
        if num_tokens is not None and self.parents is None and len(limits) == 1:
            k = min(num_tokens[0], limits[0])
            return Draft(self.token_ids[:, :k], torch.full_like(self.num_tokens, k),
                         self.probs[:, :k] if self.probs is not None else None,
                         self.confidence[:, :k] if self.confidence is not None else None)
        limit = torch.tensor(limits, dtype=torch.long, device=self.num_tokens.device)
        num = torch.minimum(self.num_tokens, limit)
        k = int(max(limits)) if limits else 0
        k = min(k, self.token_ids.shape[1])
        cols = torch.arange(k, device=self.token_ids.device)[None, :]
        token_ids = torch.where(cols < num[:, None], self.token_ids[:, :k], torch.full_like(self.token_ids[:, :k], -1))
        probs = self.probs[:, :k] if self.probs is not None else None
        confidence = self.confidence[:, :k] if self.confidence is not None else None
        # A prefix of a tree's node list is a tree (parents precede children).
        parents = None
        if self.parents is not None:
            parents = torch.where(cols < num[:, None], self.parents[:, :k], torch.full_like(self.parents[:, :k], -2))
        return Draft(token_ids, num, probs, confidence, parents)

    def pad_to(self, k: int) -> "Draft":
        """The same draft at width k (padding: -1 tokens, zero probabilities and confidences)."""
        if self._token_ids is None:  # made on the host
            tokens, num, confidence = self._host
            pad = k - (len(tokens[0]) if tokens else 0)
            if pad == 0:
                return self
            probs = None if self.probs is None else torch.nn.functional.pad(self.probs, (0, 0, 0, pad))
            return Draft.from_host([row + [-1] * pad for row in tokens], num, self._device, probs,
                                   None if confidence is None else [row + [0.0] * pad for row in confidence])
        pad = k - self.token_ids.shape[1]
        if pad == 0:
            return self

        def widen(x: torch.Tensor | None, value: float = 0.0) -> torch.Tensor | None:  # [B, width] -> [B, k]
            return None if x is None else torch.nn.functional.pad(x, (0, pad), value=value)

        probs = None if self.probs is None else torch.nn.functional.pad(self.probs, (0, 0, 0, pad))
        return Draft(widen(self.token_ids, -1), self.num_tokens, probs, widen(self.confidence), widen(self.parents, -2))

    def drop_rows(self, rows: list[int]) -> "Draft":
        """The same draft with no tokens for the given sequences (they decode normally)."""
        if not rows:
            return self
        index = torch.tensor(rows, device=self.num_tokens.device)
        num = self.num_tokens.clone()
        num[index] = 0
        token_ids = self.token_ids.clone()
        token_ids[index] = -1
        parents = None
        if self.parents is not None:
            parents = self.parents.clone()
            parents[index] = -2
        return Draft(token_ids, num, self.probs, self.confidence, parents)


@dataclasses.dataclass(slots=True)
class ProposerContext:
    """What a proposer may use of the target engine."""

    config: "SpeculativeConfig"
    target: "LlamaForCausalLM"
    target_dir: Path
    tokenizer: "Tokenizer"
    num_slots: int  # KV slots of the target (a drafter's own cache uses the same slot ids)
    max_len: int  # the target's max_model_len
    dtype: torch.dtype
    device: torch.device
    grouping: "LengthGrouping"  # how ragged forwards are cut into length groups on this device
    quantization: "QuantScheme | None" = None  # the target's weight quantisation (drafters follow it unless told: resolve.py)
    compile: bool = False  # the target's forward is compiled: a draft model's is too


class Proposer(Protocol):
    hidden_taps: tuple[int, ...]  # target layers whose hidden states this drafter reads (HF numbering)
    max_tree_depth: int  # tree drafters: the deepest node they ever propose (0 for chain drafters)
    supports_tree: bool  # can draft trees (tree_topk > 1)
    draft_cost_prior: float  # one drafting step's cost / the target's one-token step, until measured

    def __init__(self, ctx: ProposerContext) -> None: ...

    def propose(self, seqs: list["Sequence"], max_tokens: list[int], sampling: "SamplingBatch",
                stop: DraftStop | None = None) -> Draft:
        """Draft at most max_tokens[b] tokens after each sequence's committed tokens."""

    def on_prefill(self, seqs: list["Sequence"], result: "ForwardResult") -> None:
        """The target just prefilled these sequences (result holds its taps)."""

    def on_commit(self, seqs: list["Sequence"], draft: Draft, verified: "Verified", result: "ForwardResult") -> None:
        """Sync drafter state with what was committed (before the sequences advance). The step's
        commit point: `propose` may record what it consumed, but only this applies it."""

    def rollback(self, seqs: list["Sequence"]) -> None:
        """The step over these sequences failed after `propose`: forget what it recorded, so the
        drafter is as before the step (it may be retried)."""

    def pending_tokens(self, seq: "Sequence") -> int:
        """Committed tokens the drafter must catch up on before its next draft (prices drafting)."""

    def release(self, seq: "Sequence") -> None:
        """The sequence finished or was aborted: drop its drafter state."""

    def num_live_states(self) -> int:
        """Requests whose drafter state is held (0 once every request was released)."""


State = TypeVar("State")


class ProposerBase(Generic[State]):
    """Per-request drafter state (one typed dataclass per request, `state_type`), freed on
    release, and no-op hooks for proposers that keep none."""

    hidden_taps: tuple[int, ...] = ()
    max_tree_depth: int = 0
    supports_tree: bool = False
    # Prior cost of one drafting step as a fraction of the target's one-token step at the same
    # batch size (auto-k and D-Cut use it until drafting has been measured): a small model's share.
    draft_cost_prior: float = 0.5
    state_type: ClassVar[type | None] = None  # the per-request state dataclass; None = stateless
    scores_vocabulary: ClassVar[bool] = False  # drafts through `draft_head` (speculative_config.draft_vocab_size applies)
    method_name: ClassVar[str]  # set by `register`

    def __init__(self, ctx: ProposerContext):
        self.device = ctx.device
        self._states: dict[str, State] = {}

    def state(self, seq: "Sequence") -> State:
        """This request's drafter state (created empty on first use)."""
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = self.state_type()
        return state

    def pending_tokens(self, seq: "Sequence") -> int:
        """Committed tokens the drafter has not consumed yet: its next proposal feeds them all
        first (the whole prompt, the first time). Stateless drafters have none."""
        return 0

    def on_prefill(self, seqs, result) -> None:
        pass

    def on_commit(self, seqs, draft, verified, result) -> None:
        pass

    def rollback(self, seqs) -> None:
        pass

    def release(self, seq) -> None:
        self._states.pop(seq.request_id, None)

    def num_live_states(self) -> int:
        return len(self._states)
