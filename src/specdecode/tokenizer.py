"""HF tokenizer (tokenizer.json via `tokenizers`) + chat template (tokenizer_config.json via jinja2)."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.errors import ModelLoadError, TokenizerMismatchError


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF_CHAR = _byte_level_alphabet()


def _token_content(value) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{tok_file} not found: specdecode reads HF fast tokenizers (tokenizer.json)")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on a corrupt file
            raise ModelLoadError(f"{tok_file} could not be read: {e}") from None
        cfg_file = path / "tokenizer_config.json"
        self.config: dict = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        pad = _token_content(self.config.get("pad_token"))
        self.pad_token_id = self._tok.token_to_id(pad) if pad else None
        mask = _token_content(self.config.get("mask_token"))
        self.mask_token_id = self._tok.token_to_id(mask) if mask else None
        self._template = None  # the compiled chat template
        self._bytes_per_token: int | None | bool = False  # False: not computed yet
        decoder = self._tok.decoder
        self.decodes_locally = _decodes_locally(None if decoder is None else json.loads(decoder.__getstate__()))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def check_fits(self, model_vocab_size: int) -> None:
        """Every token id must have a row in the model's embedding (models may pad the vocab)."""
        if self.vocab_size > model_vocab_size:
            raise TokenizerMismatchError(
                f"tokenizer has {self.vocab_size} tokens but the model's vocab_size is {model_vocab_size}; "
                "use the tokenizer that was trained with this model"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text (special tokens included), as logprobs show it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """One token's UTF-8 bytes (a byte-level token may hold part of a character), as OpenAI's logprobs
        `bytes`; from the byte-level alphabet where the tokenizer has one."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and all(ch in _BYTE_OF_CHAR for ch in piece) and not self._is_special(token_id):
            return [_BYTE_OF_CHAR[ch] for ch in piece]
        return list(self.token_text(token_id).encode("utf-8"))

    def _is_special(self, token_id: int) -> bool:
        added = self._tok.get_added_tokens_decoder()
        return token_id in added and added[token_id].special

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (for the grammar engine)."""
        return self._tok.to_str()

    def max_text_bytes(self, num_tokens: int) -> int | None:
        """A bound for a cheap length check before tokenising: a text of more UTF-8 bytes than
        this encodes to more than `num_tokens` tokens. None when this tokenizer has no such bound
        (a normalizer or pre-tokenizer that may drop text, truncation, or a model that maps a run
        of unknown text to one token): then only tokenising tells."""
        if self._bytes_per_token is False:
            self._bytes_per_token = _bytes_per_token(self._tok)
        return None if self._bytes_per_token is None else num_tokens * self._bytes_per_token

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's own jinja2 chat template (compiled once)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise ModelLoadError("this model's tokenizer_config.json has no chat_template; send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        template = self._template
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


# Normalizers that never shrink a text's UTF-8 length by more than this factor (Unicode
# normalization and lowercasing can turn a 4-byte character into a 1-byte one: NFKC of U+1D400).
_SHRINK = {"Prepend": 1, "NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4}
# Pre-tokenizers that keep every character (Split and Punctuation unless they remove matches).
_KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _shrink(normalizer: dict | None) -> float | None:
    """How many times shorter (UTF-8 bytes) normalization can make a text; None: unbounded."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace" and "String" in (normalizer.get("pattern") or {}):
        pattern, content = normalizer["pattern"]["String"].encode(), normalizer.get("content", "").encode()
        return max(1, len(pattern) / len(content)) if content else None
    return _SHRINK.get(kind)


def _keeps_text(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    return kind in _KEEPS_TEXT and pre_tokenizer.get("behavior") != "Removed"


def _bytes_per_token(tok) -> int | None:
    """The most UTF-8 bytes of input one token can stand for, or None if unbounded (see
    Tokenizer.max_text_bytes). A token's own string is at least as long as the input it covers:
    byte-level alphabets spend 1-2 bytes per input byte, Metaspace's U+2581 3 for a space."""
    spec = json.loads(tok.to_str())
    model = spec.get("model", {})
    shrink = _shrink(spec.get("normalizer"))
    if spec.get("truncation") is not None or shrink is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tok.get_vocab(with_added_tokens=True)), default=1)
    if model.get("type") != "BPE":  # WordPiece / WordLevel / Unigram map a run of unknown text to one token
        return None
    if model.get("unk_token") is not None and not model.get("byte_fallback"):
        if model.get("fuse_unk"):
            return None
        longest = max(longest, 4)  # one unknown character
    return int(longest * shrink + 0.999)


# Decoders whose text for a token depends on the tokens before it only as far as OutputText's
# context reaches: per-token maps (ByteLevel, Replace, Strip, WordPiece's "##" joins and cleanup,
# CTC's pad removal), what happens at the text's start or end (Metaspace's first space, a Strip
# after Fuse, BPEDecoder's suffix: a space but after the last token), bytes that make one character
# across tokens (ByteLevel, ByteFallback), CTC's merged repeats. An unknown one: decoded in full.
_LOCAL_DECODERS = {"ByteLevel", "Metaspace", "WordPiece", "Replace", "ByteFallback", "Fuse", "Strip", "BPEDecoder", "CTC"}


def _decodes_locally(decoder: dict | None) -> bool:
    if decoder is None:  # tokens joined by spaces
        return True
    if decoder.get("type") == "Sequence":
        return all(_decodes_locally(d) for d in decoder.get("decoders", []))
    return decoder.get("type") in _LOCAL_DECODERS


def _raise_template_error(message: str):
    from specdecode.errors import InvalidRequestError

    raise InvalidRequestError(f"chat template rejected the conversation: {message}")


class IncrementalDetokenizer:
    """Turns a request's growing output text into deltas for streaming.

    Holds back a trailing U+FFFD (a multi-byte character still incomplete) and, when the
    request has stop strings, the last `hold_back` characters, which could still turn out to
    be the start of a stop string that the final text will not contain.
    """

    def __init__(self, hold_back: int = 0):
        self.hold_back = hold_back
        self.emitted = ""

    def delta(self, text: str, final: bool = False) -> str:
        if not final:
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self.hold_back)]
        if not text.startswith(self.emitted):
            return ""  # a merge rewrote earlier text; wait for it to settle
        new, self.emitted = text[len(self.emitted):], text
        return new


class OutputText:
    """`tokenizer.decode(ids)` of a growing token list (a request's output), in O(new tokens) a call
    instead of O(all of them): a 4,000-token text decodes in ~0.4 ms on a 2-core EPYC, about what
    a decode step costs, and the server and stop strings need the text after every step / token.

    The text of a settled prefix (one whose text ends in a whole character: no later token changes
    it) is kept; a call decodes only the tokens after it, behind a few tokens of context whose own
    text is then cut off. The context holds what a decoder does at a text's start (Metaspace's first
    space, a Strip after Fuse: both apply to the context, whose text is kept non-empty) and the
    bytes of a character split over tokens. Exact for tokenizers whose decoder works that locally
    (`Tokenizer.decodes_locally`); for any other every call decodes the whole list. `ids` only grows
    between calls (the sequence's output).
    """

    CONTEXT = 4  # tokens of context decoded before the new ones

    __slots__ = ("_settled_tokens", "_settled_text", "_context_start", "_context_text", "_num_tokens", "_text")

    def __init__(self):
        self._settled_tokens = 0  # ids[:_settled_tokens] decode to _settled_text, and no later token changes it
        self._settled_text = ""
        self._context_start = 0  # ids[_context_start:_settled_tokens] decode to _context_text
        self._context_text = ""
        self._num_tokens = 0  # ids[:_num_tokens] decode to _text (the last call's answer)
        self._text = ""

    def of(self, tokenizer: Tokenizer, ids: list[int]) -> str:
        n = len(ids)
        if n == self._num_tokens:
            return self._text
        if not tokenizer.decodes_locally or n < self._settled_tokens:
            text = tokenizer.decode(ids)
        else:
            window = tokenizer.decode(ids[self._context_start:])
            if window.startswith(self._context_text):
                text = self._settled_text + window[len(self._context_text):]
            else:  # not seen with the decoders above; exact all the same
                text = tokenizer.decode(ids)
            if not text.endswith("\ufffd"):  # a whole last character: later tokens leave this text as it is
                self._settle(tokenizer, ids, text)
        self._num_tokens, self._text = n, text
        return text

    def _settle(self, tokenizer: Tokenizer, ids: list[int], text: str) -> None:
        """ids (whose text is `text`) settled; the context: the last CONTEXT tokens, more where those
        decode to nothing (special tokens, a stripped first space), up to the whole list."""
        n, size = len(ids), self.CONTEXT
        while True:
            start = max(0, n - size)
            context = tokenizer.decode(ids[start:])
            if context or start == 0:
                break
            size *= 4
        self._settled_tokens, self._settled_text = n, text
        self._context_start, self._context_text = start, context
