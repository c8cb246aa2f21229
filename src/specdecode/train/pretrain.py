"""`specdecode train-target`: pre-train the embedded default code model from scratch.

Reads the stdlib corpus (train/corpus.py), trains a byte-level BPE tokenizer, tokenizes
once into a cached uint16 array, then trains a Llama-architecture model on random windows
with AdamW, linear warm-up and a cosine schedule, bf16 autocast (the loop: train/loop.py). A
checkpoint (model + optimizer + RNG states) is written every `checkpoint_minutes`; `--resume`
continues from it bit-for-bit in schedule and data order (tests/test_train_target.py compares
an interrupted and resumed run with an uninterrupted one). At the end the model is exported in
HF layout (bf16 safetensors, models/checkpoint.py) with validation loss and perplexity.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from specdecode.device import resolve_device
from specdecode.models.checkpoint import save_checkpoint
from specdecode.models.config import ModelConfig
from specdecode.models.llama import LlamaForCausalLM
from specdecode.train import corpus
from specdecode.train.common import Checkpointer, TrainRunConfig, option, tokenize_corpus
from specdecode.train.loop import run_loop
from specdecode.train.tokenizer_train import EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, kw_only=True)
class PretrainConfig(TrainRunConfig):
    """Defaults are those that built the shipped models/stdlib-code-22m (its README and
    training_report.json): 6 layers, 1200 steps of 8 x 1024 tokens, peak lr 1e-3, 50 warm-up steps.
    The optimiser and run fields (lr, clipping, checkpoints, dtype, device) are TrainRunConfig's."""

    out_dir: Path = option(Path("models/stdlib-code-22m"), "export directory (HF layout)")
    work_dir: Path = option(Path("runs/train-target"), "checkpoints, tokenizer and token cache (not committed)")
    # small vocab: cheap LM head, still ~3.6 bytes per token on code
    vocab_size: int = option(8192, "BPE vocabulary size (tokenizer trained on the train split)")
    hidden_size: int = option(512, "model width")
    # ~2.75 d, rounded to a multiple of 64 (SwiGLU)
    intermediate_size: int = option(1408, "SwiGLU MLP width")
    num_layers: int = option(6, "decoder layers")
    num_heads: int = option(8, "attention heads (head_dim = hidden-size / heads)")
    # GQA halves the KV cache at no visible quality cost
    num_kv_heads: int = option(4, "key / value heads (grouped-query attention)")
    context: int = option(1024, "training window = model context length")
    batch_size: int = option(8, "windows of CONTEXT tokens per step")
    max_steps: int = option(1200, "optimizer steps (the cosine schedule spans them)")
    eval_batches: int = option(16, "validation batches of BATCH_SIZE windows for the final loss")
    # TrainRunConfig's, with the shipped model's values
    warmup_steps: int = option(50, "linear warm-up steps")
    weight_decay: float = option(0.1, "AdamW weight decay of matrices (norms and biases: none)")

    def __post_init__(self) -> None:
        self.out_dir, self.work_dir = Path(self.out_dir), Path(self.work_dir)
        for name in ("vocab_size", "hidden_size", "num_layers", "context", "batch_size", "max_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def objective(self, model: LlamaForCausalLM):
        """The training loss of one window (the DeepSeek recipe adds MTP and indexer losses)."""
        return lambda window: lm_loss(model, window)

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


def prepare_data(cfg: PretrainConfig):
    """Tokenizer (trained on the train split) + token arrays, cached in work_dir for --resume."""
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
    cfg.objective(model)  # ties the MTP head before the optimiser sees the parameters
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    data_gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = Checkpointer(cfg.work_dir / "checkpoint.pt", device)
    step = ckpt.load(model, opt, data_gen, device) if resume else 0
    if step:
        log.info("resumed from step %d", step)
    tokens_per_step = cfg.batch_size * cfg.context
    objective = cfg.objective(model)
    step, losses = run_loop(cfg, model, opt, objective, train_tokens, cfg.context + 1,
                            checkpointer=ckpt, data_gen=data_gen, step=step, device=device,
                            autocast_dtype=autocast_dtype, desc="train-target",
                            on_step=getattr(objective, "set_step", None))
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
        "final_train_loss": float(np.mean(losses[-50:])) if losses else None,
    }
    if hasattr(objective, "evaluate"):  # the DeepSeek recipe: MTP, DSA and IndexCache measurements
        report.update(objective.evaluate(val_tokens, device, autocast_dtype))
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
    """HF layout: config.json, model.safetensors (bf16; a tied LM head is not stored), tokenizer
    files, generation_config.json, training_report.json (models/checkpoint.py writes them)."""
    # Tied heads (the LM head; an MTP layer's shared head) are not stored: the loader ties them back.
    embed = model.model.embed_tokens.weight
    state = {k: v for k, v in model.state_dict().items()
             if not (mcfg.tie_word_embeddings and k.endswith("head.weight") and v.data_ptr() == embed.data_ptr())}
    pad_id = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(PAD_TOKEN)
    generation = {"eos_token_id": mcfg.eos_token_id, "pad_token_id": pad_id, "do_sample": False}
    save_checkpoint(state, mcfg.to_hf_dict(), out_dir, tokenizer_dir, report,
                    extra_json={"generation_config.json": generation})
