"""OutputText keeps a growing output's text equal to decoding all of it, for every decoder family it
serves incrementally (byte-level BPE as the default model's, Metaspace, Llama's byte fallback with
Fuse and Strip, WordPiece with cleanup, no decoder), with special tokens, characters split over
tokens and tokens arriving one to several at a time; decoders it cannot serve that way decode in
full, and decode only the new tokens' neighbourhood otherwise."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.defaults import default_model_dir
from specdecode.tokenizer import OutputText, Tokenizer, _decodes_locally

TEXTS = ["def foo(x):\n    return x + 1  # é→ü", "  leading spaces and 中文 😀 mixed", "naïve café, don't stop .",
         "∑x² = 3 ; a , b ! c ? 'quoted' words", "\n\n\t tabs\tand\nnewlines  "]


def _save(hf, tmp_dir) -> Tokenizer:
    hf.save(str(tmp_dir / "tokenizer.json"))
    return Tokenizer(tmp_dir)


def _build(kind: str, tmp_dir) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<s>", "</s>", "<unk>"]
    if kind == "metaspace":
        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Metaspace()
        hf.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials)
    elif kind == "byte_fallback":  # Llama / Mistral's
        hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        hf.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
        bytes_ = [f"<0x{b:02X}>" for b in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials + bytes_)
    elif kind == "wordpiece":
        hf = HFTokenizer(models.WordPiece(unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece(cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=150, special_tokens=specials)
    elif kind in ("none", "bpe_suffix"):
        suffix = {"end_of_word_suffix": "</w>"} if kind == "bpe_suffix" else {}
        hf = HFTokenizer(models.BPE(unk_token="<unk>", **suffix))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        if kind == "bpe_suffix":
            hf.decoder = decoders.BPEDecoder(suffix="</w>")
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials, **suffix)
    elif kind == "ctc":  # wav2vec2's: characters, repeats merged, a pad token, "|" between words
        chars = sorted({c for text in TEXTS for c in text.replace(" ", "|")})
        vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + chars)}
        hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
        hf.decoder = decoders.CTC(pad_token="<pad>", word_delimiter_token="|", cleanup=True)
        hf.add_special_tokens(["<s>", "</s>"])
        return _save(hf, tmp_dir)
    else:
        raise ValueError(kind)
    hf.train_from_iterator(TEXTS * 3, trainer)
    return _save(hf, tmp_dir)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    out = {"byte_level": Tokenizer(default_model_dir())}
    for kind in ("metaspace", "byte_fallback", "wordpiece", "none", "bpe_suffix", "ctc"):
        out[kind] = _build(kind, tmp_path_factory.mktemp(kind))
    return out


def _interesting(tok: Tokenizer) -> list[int]:
    """Specials, pieces of the texts, and tokens that alone decode to U+FFFD or to nothing."""
    ids = {i for text in TEXTS for i in tok.encode(text)} | set(range(min(tok.vocab_size, 8)))
    ids |= {i for i in range(min(tok.vocab_size, 2000)) if tok.decode([i]) in ("", " ") or "\ufffd" in tok.decode([i])}
    return sorted(ids)


def _feed(tok: Tokenizer, ids: list[int], chunks: list[int], out: OutputText) -> list[tuple[str, str]]:
    """(OutputText's text, the full decode) after each chunk, as the scheduler commits them."""
    seen, at = [], 0
    for size in chunks + [len(ids)]:
        at = min(len(ids), at + size)
        seen.append((out.of(tok, ids[:at]), tok.decode(ids[:at])))
        if at == len(ids):
            break
    return seen


KINDS = ["byte_level", "metaspace", "byte_fallback", "wordpiece", "none", "bpe_suffix", "ctc"]


def test_every_decoder_family_is_served_incrementally_and_an_unknown_one_is_not(tokenizers):
    assert all(tok.decodes_locally for tok in tokenizers.values())
    assert not _decodes_locally({"type": "Sequence", "decoders": [{"type": "ByteLevel"}, {"type": "Future"}]})


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_text_equals_the_full_decode_after_every_step(tokenizers, kind, data):
    tok = tokenizers[kind]
    token = st.one_of(st.sampled_from(_interesting(tok)), st.integers(0, tok.vocab_size - 1))
    ids = data.draw(st.lists(token, min_size=1, max_size=60))
    chunks = data.draw(st.lists(st.integers(1, 6), max_size=40))
    for incremental, full in _feed(tok, ids, chunks, OutputText()):
        assert incremental == full


@pytest.mark.parametrize("kind", KINDS)
def test_real_text_token_by_token(tokenizers, kind):
    tok = tokenizers[kind]
    for text in TEXTS:
        ids = tok.encode(text) * 3
        for incremental, full in _feed(tok, ids, [1] * len(ids), OutputText()):
            assert incremental == full


class _NoContext(OutputText):
    """A negative control: new tokens decoded without the tokens before them."""

    def _settle(self, tokenizer, ids, text):
        self._settled_tokens, self._settled_text, self._context_start, self._context_text = len(ids), text, len(ids), ""


@pytest.mark.parametrize("kind", ["metaspace", "byte_fallback", "wordpiece"])
def test_without_context_the_text_differs(tokenizers, kind):
    """Spaces a decoder drops at a text's start (Metaspace, Strip) or adds between tokens
    (WordPiece) need the tokens before the new ones."""
    tok = tokenizers[kind]
    ids = [i for text in TEXTS for i in tok.encode(text)]
    assert any(a != b for a, b in _feed(tok, ids, [1] * len(ids), _NoContext()))


def test_an_unknown_decoder_decodes_the_whole_list(tokenizers):
    tok = tokenizers["metaspace"]
    ids = [i for text in TEXTS for i in tok.encode(text)]
    tok.decodes_locally = False
    try:
        assert all(a == b for a, b in _feed(tok, ids, [1] * len(ids), OutputText()))
    finally:
        tok.decodes_locally = True


def test_each_step_decodes_only_the_new_tokens_and_their_context(tokenizers):
    tok = tokenizers["byte_level"]
    decoded: list[int] = []
    real_decode = tok.decode
    tok.decode = lambda ids, **kw: decoded.append(len(ids)) or real_decode(ids, **kw)
    try:
        text = "".join(TEXTS) * 20
        ids = tok.encode(text)
        out = OutputText()
        for n in range(1, len(ids) + 1):
            out.of(tok, ids[:n])
        assert out.of(tok, ids) == real_decode(ids) and len(ids) > 500
        assert max(decoded) <= 2 * OutputText.CONTEXT + 1  # never the whole list
        assert len(decoded) <= 2 * len(ids)
    finally:
        del tok.decode
