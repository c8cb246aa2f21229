"""HF tokenizer (tokenizer.json via `tokenizers`) + chat template (tokenizer_config.json via jinja2)."""

from __future__ import annotations

import json
from pathlib import Path

from specdecode.errors import ModelLoadError, TokenizerMismatchError


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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's own jinja2 chat template."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not self.chat_template:
            raise ModelLoadError("this model's tokenizer_config.json has no chat_template; send a plain prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


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
