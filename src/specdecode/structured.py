"""Structured outputs (JSON schema, JSON object, regex, choice, grammar) through llguidance.

Engine choice, measured on this CPU with the default model's tokenizer
(`benchmarks/grammar_engines.py`, README "Structured outputs"): mask + consume per token 14-16 us
(JSON schema) / 32-36 us (regex) for llguidance, 3.9 / 20 us for xgrammar, 5.6 / 5.3 us for
outlines-core. xgrammar's lead (10-15 us a token, 2-4% of a speculative step for a constrained
request) does not pay for the triton (about 1 GB) it installs on x86, and outlines-core compiles
regular languages only (no `grammar`), so llguidance, with no dependencies and full context-free
grammars, is the one specdecode uses.

Each constrained sequence owns a `GrammarState`: its matcher after the committed tokens, which
only the scheduler advances (`consume`), one token at a time as tokens are committed.
Speculation never touches it: drafters and the verifier walk `fork()`s along their drafts
(a chain: one fork; a tree: a fork per node), so nothing needs rolling back after a step, a
retried step starts from the same state, and EOS inside a rejected draft is harmless.
"""

from __future__ import annotations

import functools
import json

import torch

from specdecode.config import StructuredOutputsParams
from specdecode.errors import InvalidRequestError
from specdecode.sampling import RowMasks, bitmask_words


# JSON is laid out as json.dumps writes it (", " and ": ", no other whitespace): free whitespace lets a
# model pad forever between tokens, and one layout keeps outputs comparable.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarState:
    """A matcher at some point of an output (llguidance's LLMatcher)."""

    __slots__ = ("matcher", "eos_token_id")

    def __init__(self, matcher, eos_token_id: int):
        self.matcher = matcher
        self.eos_token_id = eos_token_id

    def fork(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), self.eos_token_id)

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into row [W] int32 (CPU, contiguous). A matcher with no
        token left (stopped, or in error) allows EOS only, so no row's logits are all -inf."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.matcher.is_stopped() or self.matcher.is_error():
            row.zero_()
            row[self.eos_token_id // 32] = 1 << (self.eos_token_id % 32) if self.eos_token_id % 32 < 31 else -(1 << 31)

    def accept(self, token: int) -> bool:
        """Advance over `token` if the grammar allows it; False (state unchanged) if not."""
        return token >= 0 and self.matcher.try_consume_tokens([token]) == 1

    def consume(self, token: int) -> None:
        """Commit `token`; a token the grammar forbids is a bug upstream (every path masks)."""
        if not self.accept(token):
            raise RuntimeError(f"token {token} is not allowed by the request's grammar here "
                               f"({self.matcher.get_error() or 'not in the mask'})")

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (EOS was consumed, or it is final)."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Turns `StructuredOutputsParams` into matchers for one tokenizer (compiled grammars cached)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int):
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        self._grammar = functools.lru_cache(maxsize=256)(self._grammar_uncached)

    def grammar_text(self, spec: StructuredOutputsParams) -> str:
        ll = self._ll.LLMatcher
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            try:
                json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None
            return ll.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if spec.json_object:
            return ll.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        if spec.regex is not None:
            return ll.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return ll.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

        grammar = spec.grammar
        if not is_lark_syntax(grammar):  # GBNF (llama.cpp's, vLLM's EBNF) -> Lark
            try:
                grammar = any_to_lark(grammar)
            except Exception as e:  # noqa: BLE001 - the converter raises its own and plain errors on bad input
                raise InvalidRequestError(f"the grammar could not be read as GBNF: {e}") from None
        return ll.grammar_from_lark(grammar)

    def _grammar_uncached(self, key: str) -> str:
        spec = StructuredOutputsParams(**json.loads(key))
        try:
            text = self.grammar_text(spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - llguidance raises ValueError/RuntimeError on bad grammars
            raise InvalidRequestError(f"the structured output's {_kind(spec)} could not be compiled: {e}") from None
        error = self._ll.LLMatcher.validate_grammar(text, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(f"the structured output's {_kind(spec)} is not valid: {error}")
        return text

    def state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for a new request (InvalidRequestError for a bad grammar)."""
        key = json.dumps({"json": spec.json, "json_object": spec.json_object, "regex": spec.regex,
                          "choice": spec.choice, "grammar": spec.grammar}, sort_keys=True)
        matcher = self._ll.LLMatcher(self.tokenizer, self._grammar(key), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"the structured output's {_kind(spec)} is not valid: {matcher.get_error()}")
        return GrammarState(matcher, self.eos_token_id)


def _kind(spec: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(spec, name) not in (None, False)) + (" schema" if spec.json is not None else "")


def committed_masks(grammars: list, vocab_size: int) -> RowMasks | None:
    """The masks of the next token of every constrained row (plain decoding, the first draft step)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), bitmask_words(vocab_size), dtype=torch.int32)
    for g, row in enumerate(rows):
        grammars[row].fill_mask(bitmask[g])
    return RowMasks(rows, bitmask)


def constrain_chain(grammars: list, tokens: list[list[int]], num_tokens: list[int], width: int,
                    vocab_size: int) -> tuple[list[int], RowMasks | None]:
    """Walk each constrained row's draft on a fork of its committed state: the draft ends before
    the first token the grammar forbids. Returns the kept lengths and the masks at every
    verification position [root, x_1 .. x_k] (row b * width + j; positions past the kept draft
    allow everything: their tokens are never committed)."""
    kept = list(num_tokens)
    rows = [b for b, g in enumerate(grammars) if g is not None]
    if not rows:
        return kept, None
    bitmask = torch.full((len(rows) * width, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for g, b in enumerate(rows):
        state = grammars[b].fork()
        n = 0
        for n in range(num_tokens[b] + 1):
            state.fill_mask(bitmask[g * width + n])
            if n == num_tokens[b] or not state.accept(tokens[b][n]):
                break
        kept[b] = n
    return kept, RowMasks([b * width + j for b in rows for j in range(width)], bitmask)


def constrain_tree(grammars: list, tokens: list[list[int]], parents: list[list[int]], width: int,
                   vocab_size: int) -> tuple[list[list[int]], RowMasks | None]:
    """Trees: each node's state is a fork of its parent's advanced by its token; a node the
    grammar forbids (and so its subtree) gets token -1, which no verification draw matches.
    Returns the tokens and the masks at every verification row [root, node 0, ...]."""
    rows = [b for b, g in enumerate(grammars) if g is not None]
    if not rows:
        return tokens, None
    tokens = [list(t) for t in tokens]
    bitmask = torch.full((len(rows) * width, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for g, b in enumerate(rows):
        states = {-1: grammars[b].fork()}  # node -> its state after its token (-1: the root)
        states[-1].fill_mask(bitmask[g * width])
        for i, (token, parent) in enumerate(zip(tokens[b], parents[b])):
            if parent < -1 or parent not in states or token < 0:
                tokens[b][i] = -1
                continue
            state = states[parent].fork()
            if not state.accept(token):
                tokens[b][i] = -1
                continue
            states[i] = state
            state.fill_mask(bitmask[g * width + i + 1])
    return tokens, RowMasks([b * width + j for b in rows for j in range(width)], bitmask)
