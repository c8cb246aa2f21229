"""Byte-level BPE tokenizer for the default code model, trained with `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdecode.train.corpus import SourceFile

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"  # reserved for block drafters (DFlash / DSpark); never in the corpus
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, MASK_TOKEN]

# A base code model has no chat training: the template renders a conversation as Python
# comments followed by the assistant's turn, which is what the model can continue.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}\n"
    "{% else %}# {{ message['role'] }}: {{ message['content'] | replace('\n', '\n# ') }}\n{% endif %}"
    "{% endfor %}"
)


def train_tokenizer(files: list[SourceFile], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((f.text for f in files), trainer=trainer, length=len(files))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
