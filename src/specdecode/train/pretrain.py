"""`specdecode train-target`: pre-train the embedded default code model from scratch.

Reads the stdlib corpus (train/corpus.py), trains a byte-level BPE tokenizer, tokenizes
once into a cached uint16 array, then trains a Llama-architecture model on random windows
with AdamW, linear warm-up and a cosine schedule, bf16 autocast. A checkpoint
(model + optimizer + data RNG state) is written every `checkpoint_minutes`; `--resume`
continues from it bit-for-bit in schedule and data order. At the end the model is exported
in HF layout (bf16 safetensors) with validation loss and perplexity.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdecode.models.config import ModelConfig
from specdecode.models.llama import LlamaForCausalLM
from specdecode.train import corpus
from specdecode.train.common import Checkpointer, cosine_lr, sample_windows, tokenize_corpus
from specdecode.train.tokenizer_train import EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class PretrainConfig:
    out_dir: Path
    work_dir: Path  # checkpoints and the token cache (not committed)
    vocab_size: int = 8192  # small vocab: cheap LM head, still ~3.6 bytes per token on code
    hidden_size: int = 512
    intermediate_size: int = 1408  # ~2.75 d, rounded to a multiple of 64 (SwiGLU)
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4  # GQA halves the KV cache at no visible quality cost
    context: int = 1024
    batch_size: int = 8  # windows per step
    max_steps: int = 2000
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_minutes: float = 5.0
    eval_batches: int = 16
    dtype: str = "bfloat16"  # autocast dtype
    device: str = "auto"

    def __post_init__(self) -> None:
        self.out_dir, self.work_dir = Path(self.out_dir), Path(self.work_dir)
        for name in ("vocab_size", "hidden_size", "num_layers", "context", "batch_size", "max_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def model_config(self, eos_id: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.context,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            model_type="llama",
            bos_token_id=None,
            eos_token_id=eos_id,
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def prepare_data(cfg: PretrainConfig):
    """Tokenizer (trained on the train split) + token arrays, cached in work_dir for --resume."""
    from tokenizers import Tokenizer

    tok_dir = cfg.work_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        train_files, val_files = corpus.split_files(corpus.iter_stdlib_files())
        log.info("corpus: %d train files, %d validation files", len(train_files), len(val_files))
        save_tokenizer(train_tokenizer(train_files, cfg.vocab_size), tok_dir, cfg.context)
    train, val = tokenize_corpus(tok_dir / "tokenizer.json", cfg.work_dir / "tokens.npz")
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")), train, val


def lm_loss(model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
    inputs, targets = window[:, :-1], window[:, 1:]
    B, T = inputs.shape
    positions = torch.arange(T, device=inputs.device).expand(B, T)
    out = model(inputs, positions)
    logits = model.compute_logits(out.hidden)  # [B, T, V] float32
    return F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(-1))


@torch.no_grad()
def evaluate(model, val: np.ndarray, cfg: PretrainConfig, device, autocast_dtype) -> float:
    """Mean loss over fixed, evenly spaced validation windows (same windows every call)."""
    model.eval()
    n = min(cfg.eval_batches * cfg.batch_size, max(1, (len(val) - 1) // cfg.context))
    starts = np.linspace(0, len(val) - cfg.context - 1, n).astype(np.int64)
    losses = []
    for i in range(0, n, cfg.batch_size):
        window = torch.from_numpy(np.stack([val[s : s + cfg.context + 1].astype(np.int64) for s in starts[i : i + cfg.batch_size]]))
        with torch.autocast(device.type, dtype=autocast_dtype):
            losses.append(lm_loss(model, window.to(device)).item())
    model.train()
    return float(np.mean(losses))


def train(cfg: PretrainConfig, resume: bool = False) -> dict:
    device = resolve_device(cfg.device)
    autocast_dtype = getattr(torch, cfg.dtype)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    tok, train_tokens, val_tokens = prepare_data(cfg)
    eos_id = tok.token_to_id(EOS_TOKEN)
    mcfg = cfg.model_config(eos_id)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(mcfg).to(device)
    _init_weights(model, mcfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    data_gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = Checkpointer(cfg.work_dir / "checkpoint.pt")
    step = ckpt.load(model, opt, data_gen, device) if resume else 0
    if step:
        log.info("resumed from step %d", step)
    tokens_per_step = cfg.batch_size * cfg.context
    history = []
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train-target", unit="step", dynamic_ncols=True)
    model.train()
    while step < cfg.max_steps:
        t0 = time.time()
        lr = cosine_lr(step, cfg.max_steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        window = sample_windows(train_tokens, cfg.batch_size, cfg.context + 1, data_gen).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype):
            loss = lm_loss(model, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        loss_value = loss.item()
        history.append((step, loss_value))
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / (time.time() - t0):.0f}")
        if ckpt.due(cfg.checkpoint_minutes):
            ckpt.save(model, opt, data_gen, step)
    bar.close()
    ckpt.save(model, opt, data_gen, step)
    wall = ckpt.elapsed()
    val_loss = evaluate(model, val_tokens, cfg, device, autocast_dtype)
    report = {
        "steps": step,
        "tokens_seen": step * tokens_per_step,
        "train_tokens": int(len(train_tokens)),
        "val_tokens": int(len(val_tokens)),
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "wall_seconds": wall,
        "parameters": model.num_parameters(),
        "final_train_loss": float(np.mean([l for _, l in history[-50:]])) if history else None,
    }
    export_checkpoint(model, mcfg, cfg.work_dir / "tokenizer", cfg.out_dir, report)
    return report


def _init_weights(model: LlamaForCausalLM, mcfg: ModelConfig) -> None:
    # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers).
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * mcfg.num_hidden_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)


def export_checkpoint(model: LlamaForCausalLM, mcfg: ModelConfig, tokenizer_dir: Path, out_dir: Path, report: dict) -> None:
    """HF layout: config.json, model.safetensors (bf16), tokenizer files, generation_config.json."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not (mcfg.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(mcfg.to_hf_dict(), indent=2) + "\n")
    from tokenizers import Tokenizer

    pad_id = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(PAD_TOKEN)
    gen = {"eos_token_id": mcfg.eos_token_id, "pad_token_id": pad_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
