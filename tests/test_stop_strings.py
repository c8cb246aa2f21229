"""Stop strings are exact: the scheduler stops at the first token after which the decoded
output holds a stop string, and cuts the text where the first one starts, whatever length of
text a token adds and however multi-byte characters are split across tokens. Checked against
a brute-force reference that decodes every prefix, on the default model's vocabulary."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import SamplingParams
from specdecode.defaults import default_model_dir
from specdecode.engine.scheduler import Scheduler
from specdecode.engine.sequence import Sequence
from specdecode.tokenizer import Tokenizer


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer(default_model_dir())


@functools.cache
def interesting_ids() -> list[int]:
    """Tokens of a newline and more than 16 spaces, tokens that are part of a multi-byte
    character (alone they decode to U+FFFD), the pieces of some non-ASCII text, and the specials."""
    tok = tokenizer()
    vocab = tok._tok.get_vocab()
    whitespace = [i for t, i in vocab.items() if t[0] == "Ċ" and len(t) > 17 and set(t[1:]) == {"Ġ"}]
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    pieces = tok.encode("é→ü 中文 😀 ∑x²")
    assert whitespace and partial
    return sorted(set(whitespace + partial + pieces + [0, 1, 2]))


def scheduler_decision(token_ids: list[int], chunks: list[int], stops: list[str]) -> tuple[int | None, str]:
    """(how many tokens were kept when a stop string stopped the sequence, else None; its text),
    feeding the tokens in chunks as speculative steps commit them."""
    tok = tokenizer()
    scheduler = Scheduler(1, tok)
    params = SamplingParams(max_tokens=len(token_ids) + 1, ignore_eos=True, stop=stops)
    seq = Sequence("r", None, [5], params, eos_token_ids=(), max_len=10_000)
    at = 0
    for size in chunks + [len(token_ids)]:
        scheduler.append_tokens(seq, token_ids[at: at + size])
        at += size
        if seq.is_finished or at >= len(token_ids):
            break
    text = tok.decode(seq.output_token_ids)
    if seq.finish_reason == "stop":
        return len(seq.output_token_ids), text[: seq.stop_text_len]
    return None, text


def reference(token_ids: list[int], stops: list[str]) -> tuple[int | None, str]:
    tok = tokenizer()
    for n in range(1, len(token_ids) + 1):
        text = tok.decode(token_ids[:n])
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            return n, text[: min(starts)]
    return None, tok.decode(token_ids)


@st.composite
def cases(draw):
    vocab_size = tokenizer().vocab_size
    token = st.one_of(st.sampled_from(interesting_ids()), st.integers(0, vocab_size - 1))
    token_ids = draw(st.lists(token, min_size=1, max_size=40))
    text = tokenizer().decode(token_ids)
    stops = []
    for _ in range(draw(st.integers(0, 3))):  # pieces of the text itself, some spanning tokens
        if text:
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start: start + draw(st.integers(1, 30))])
    stops += draw(st.lists(st.one_of(
        st.sampled_from(["\n", "\n\n", "  ", "\n    ", "):", "\ufffd", "é", "😀", " the", "def "]),
        st.text(min_size=1, max_size=5)), max_size=4))
    if not stops:
        stops = ["\n"]
    chunks = draw(st.lists(st.integers(1, 5), max_size=20))
    return token_ids, chunks, list(dict.fromkeys(stops))


@settings(max_examples=200, deadline=None)
@given(cases())
def test_the_scheduler_stops_where_decoding_every_prefix_does(case):
    token_ids, chunks, stops = case
    assert scheduler_decision(token_ids, chunks, stops) == reference(token_ids, stops)


def test_a_token_of_many_spaces_does_not_hide_a_newline():
    tok = tokenizer()
    newline_and_spaces = tok._tok.token_to_id("Ċ" + "Ġ" * 20)  # "\n" + 20 spaces: one token
    assert tok.decode([newline_and_spaces]) == "\n" + " " * 20
    head = tok.encode("x = 1")
    token_ids = head + [newline_and_spaces] + tok.encode("y = 2")
    assert scheduler_decision(token_ids, [len(token_ids)], ["\n"]) == (len(head) + 1, "x = 1")
    assert scheduler_decision(token_ids, [1] * len(token_ids), ["\n"]) == (len(head) + 1, "x = 1")


def test_the_earliest_stop_string_cuts_the_text():
    tok = tokenizer()
    token_ids = tok.encode("xab")
    # Both complete with the last token: the cut is at the first in the text, not in the list.
    assert scheduler_decision(token_ids, [len(token_ids)], ["b", "ab"]) == (len(token_ids), "x")
