"""Pieces every training job shares: config fields, schedule, data windows, corpus tokens, checkpoints."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from specdecode.train import corpus
from specdecode.train.tokenizer_train import EOS_TOKEN


def option(default=dataclasses.MISSING, help: str = "", **extra):
    """A training-config field documented by its metadata: `help` (and `choices` where the
    values are a closed set) become the `--flag`'s help in the CLI (cli.py)."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


@dataclasses.dataclass(slots=True, kw_only=True)
class TrainRunConfig:
    """The optimiser, schedule and run fields of every training config (PretrainConfig,
    DrafterTrainConfig). A subclass redeclares a field only where its default or help differs;
    keyword-only, so the subclasses' own fields (some without a default) may follow these."""

    lr: float = option(1e-3, "peak learning rate")
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = option(30, "linear warm-up steps")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "gradient-norm clipping threshold")
    seed: int = option(0, "seed of the initialisation and of the data order")
    checkpoint_minutes: float = option(5.0, "minutes between checkpoints in WORK_DIR (one more at the end)")
    dtype: str = option("bfloat16", "autocast dtype", choices=("bfloat16", "float32"))
    device: str = option("auto", "auto (CUDA when present), cpu, cuda, cuda:N")


def cosine_lr(step: int, max_steps: int, warmup_steps: int, peak: float, min_ratio: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to `peak * min_ratio` at max_steps."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return peak * (min_ratio + (1 - min_ratio) * cosine)


def sample_windows(tokens: np.ndarray, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] random windows of a token array."""
    starts = torch.randint(0, len(tokens) - length, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s: s + length].astype(np.int64) for s in starts]))


def tokenize_corpus(tokenizer_json: Path, cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token arrays of the stdlib corpus (train/corpus.py), cached as .npz."""
    if cache.is_file():
        data = np.load(cache)
        return data["train"], data["val"]
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id(EOS_TOKEN)
    train_files, val_files = corpus.split_files(corpus.iter_stdlib_files())

    def encode(files):
        ids: list[int] = []
        for enc in tok.encode_batch([f.text for f in files]):
            ids.extend(enc.ids)
            ids.append(eos)  # documents are separated by end-of-text
        return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() < 65536 else np.int32)

    train, val = encode(train_files), encode(val_files)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, train=train, val=val)
    return train, val


class Checkpointer:
    """Atomic save / load of {model, optimizer, data RNG, global torch RNG, step, elapsed} for --resume.

    The global torch RNG is saved too: DFlash / DSpark draw their training anchors from it, so a
    resumed run draws the same anchors as an uninterrupted one. (Checkpoints written before it
    was saved resume without it.) RNG states always load onto the CPU, whatever the device."""

    def __init__(self, path: Path, device: torch.device | None = None):
        self.path = path
        self.device = device  # a CUDA training device also has its CUDA RNG state saved
        self.started = time.time()
        self.last_save = self.started
        self.elapsed_before = 0.0

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.started

    def load(self, model, optimizer, data_gen: torch.Generator, device) -> int:
        if not self.path.is_file():
            return 0
        state = torch.load(self.path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        data_gen.set_state(state["data_rng"].cpu())
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"].cpu())
        if "cuda_rng" in state and torch.device(device).type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)
        self.elapsed_before = float(state["elapsed"])
        return int(state["step"])

    def save(self, model, optimizer, data_gen: torch.Generator, step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        state = {"model": dict(model.state_dict()), "optimizer": optimizer.state_dict(), "data_rng": data_gen.get_state(),
                 "torch_rng": torch.get_rng_state(), "step": step, "elapsed": self.elapsed()}
        if self.device is not None and self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        torch.save(state, tmp)
        tmp.replace(self.path)  # a crash mid-save never leaves a broken checkpoint
        self.last_save = time.time()

    def due(self, minutes: float) -> bool:
        return time.time() - self.last_save > minutes * 60
