"""Token counts of a corpus, for FR-Spec's reduced draft vocabulary (speculative/propose/draft_vocab.py).

`specdecode token-frequencies` writes {"vocab_size", "num_tokens", "source", "counts": [V ints]}:
by default over the training split of the stdlib corpus the default model and its drafters were
trained on (train/corpus.py), or over the text files given.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from specdecode.defaults import cache_root
from specdecode.train.common import tokenize_corpus


def count_tokens(tokenizer_json: Path, files: list[Path] | None = None) -> tuple[np.ndarray, str]:
    """(counts [vocab] int64, a description of the source): over `files`, else the stdlib training split."""
    tok = Tokenizer.from_file(str(tokenizer_json))
    vocab_size = tok.get_vocab_size()
    if not files:
        train, _ = tokenize_corpus(tokenizer_json, cache_root() / "token_frequencies" / "stdlib-tokens.npz")
        return np.bincount(train.astype(np.int64), minlength=vocab_size), "stdlib corpus, training split"
    counts = np.zeros(vocab_size, dtype=np.int64)
    for path in tqdm(files, desc="counting", unit="file"):
        ids = tok.encode(Path(path).read_text(encoding="utf-8", errors="replace")).ids
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)
    return counts, f"{len(files)} text files"


def write_frequencies(model_dir: Path, out: Path, files: list[Path] | None = None) -> dict:
    counts, source = count_tokens(model_dir / "tokenizer.json", files)
    data = {"vocab_size": len(counts), "num_tokens": int(counts.sum()), "source": source, "counts": counts.tolist()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return data
