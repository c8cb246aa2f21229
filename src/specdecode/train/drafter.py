"""`specdecode train-drafter`: train a drafter against a target's own behaviour.

Each method's recipe (how to build the drafter from the target, its loss, its predictions
aligned with the target's, its export) lives in train/recipes/, registered in `RECIPES`. What
they share is here: data windows from the stdlib corpus (or the target's own continuations,
`--data generated`), target soft labels computed on the fly, the one loop of train/loop.py
(AdamW + cosine, checkpoints, --resume), export and validation agreement before and after.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from specdecode.defaults import default_model_dir
from specdecode.device import resolve_device
from specdecode.errors import ConfigError
from specdecode.models.checkpoint import store_quantized
from specdecode.models.loader import load_model
from specdecode.models.quant import QuantScheme
from specdecode.tokenizer import Tokenizer
from specdecode.train.common import Checkpointer, TrainRunConfig, option, tokenize_corpus
from specdecode.train.generated_data import generate_dataset
from specdecode.train.loop import run_loop
from specdecode.train.qat import enable_qat
from specdecode.train.recipes import RECIPES, DrafterRecipe
from specdecode.train.recipes.base import distill_loss, target_logits  # noqa: F401
# The recipes' pieces, importable from here as before the split into train/recipes/.
from specdecode.train.recipes.dflash import (_block_states, build_dflash, dflash_block_mask, dflash_loss,  # noqa: F401
                                             dflash_predict, export_dflash)
from specdecode.train.recipes.draft_model import (build_draft_model, draft_model_loss, draft_model_predict,  # noqa: F401
                                                  export_draft_model)
from specdecode.train.recipes.dspark import (build_dspark, calibrate_dspark, dspark_loss, dspark_predict,  # noqa: F401
                                             expected_calibration_error, export_dspark)
from specdecode.train.recipes.eagle import (_eagle_unroll, build_eagle, build_eagle3, eagle_loss,  # noqa: F401
                                            eagle_predict, export_eagle, ttt_mask)
from specdecode.train.recipes.medusa import build_medusa, export_medusa, medusa_loss, medusa_predict  # noqa: F401

log = logging.getLogger(__name__)

DATA_HELP = (
    "corpus: stdlib windows with the target's soft labels; generated: the target's own continuations of corpus "
    "prompts (generated once, cached in WORK_DIR, resumable). Measured on DFlash, 300 steps each, HumanEval mean "
    "acceptance length: generated 1.54 vs corpus 1.45 at T=0, 1.52 vs 1.54 at T=1, and generating its data cost "
    "~8 min more: corpus stays the default (BENCHMARKS.md, training data)"
)


@dataclasses.dataclass(slots=True, kw_only=True)
class DrafterTrainConfig(TrainRunConfig):
    """Defaults are the ones every shipped drafter was trained with, except for the flags
    its training_report.json `command` names (e.g. --context 512, --max-steps). The optimiser
    and run fields (lr, warm-up, weight decay, clipping, checkpoints, device) are TrainRunConfig's."""

    method: str = option(help="which drafter to train", choices=tuple(RECIPES))
    target: Path | None = option(None, "target checkpoint dir (default: the embedded model)")
    out_dir: Path | None = option(None, "export dir (default: next to the target, <target>-<method>; "
                                        "draft_model: <target>-draft; a matched drafter adds "
                                        "-<target quantization> and -qat)")
    work_dir: Path | None = option(None, "checkpoints and token cache (default: runs/train-drafter-<method>, "
                                         "with the same matched suffix)")
    max_steps: int = option(600, "optimizer steps (the cosine schedule spans them)")
    batch_size: int = option(4, "windows per step")
    context: int = option(1024, "window length in tokens")
    eval_windows: int = option(16, "fixed validation windows for the agreement figures (and DSpark's calibration)")
    data: str = option("corpus", DATA_HELP, choices=("corpus", "generated"))
    generated_sequences: int = option(2000, "with --data generated: how many sequences")
    # matching a quantised target (README "Quantised targets: matched drafters")
    target_quantization: str | None = option(
        None, "train against the target served with this weight quantisation (int8, int4 = int4-g32, int4-g64, "
              "int4-g128): its features and soft labels (and --data generated's text) come from the quantised model")
    qat: str | None = option(
        None, "quantisation-aware training: the drafter's linear layers compute with their int8 / int4 weights "
              "as served (straight-through estimator), so it can be served quantised; such a drafter is served "
              "at this scheme unless speculative_config.draft_quantization says otherwise")
    init_from: Path | None = option(
        None, "fine-tune: start from this exported drafter's weights instead of a fresh initialisation (the "
              "shape flags must be the ones it was trained with, see its training_report.json)")
    # TrainRunConfig's, with the help a drafter's run needs
    seed: int = option(0, "seed of the initialisation, the data order and the random anchors")
    dtype: str = option("bfloat16", "autocast dtype for target and drafter", choices=("bfloat16", "float32"))
    # draft_model shape
    num_layers: int = option(2, "draft_model: decoder layers")
    intermediate_size: int = option(512, "draft_model: MLP width")
    # eagle3: reduced draft vocabulary (most frequent tokens)
    draft_vocab_size: int = option(4096, "eagle3: reduced draft vocabulary size")
    medusa_heads: int = option(4, "medusa: number of heads")
    # dflash / dspark
    block_size: int = option(8, "dflash / dspark: block size (drafts = block - 1)")
    dflash_layers: int = option(2, "dflash / dspark: draft layers")
    markov_rank: int = option(128, "dspark: rank of the Markov (bigram) head")

    def __post_init__(self) -> None:
        if self.method not in RECIPES:
            raise ValueError(f"--method {self.method!r} has no trainer; accepted: {', '.join(RECIPES)}")
        if self.data not in ("corpus", "generated"):
            raise ValueError(f"--data {self.data!r}: accepted: corpus, generated")
        # Canonical names ("int4" -> "int4-g32"): what the provenance records and serving compares.
        for key in ("target_quantization", "qat"):
            scheme = QuantScheme.parse(getattr(self, key))
            if scheme is not None and not scheme.weight_only:  # its kernels have no backward, its rounding no gradient
                raise ValueError(f"--{key.replace('_', '-')} {scheme.name}: drafter training takes weight-only schemes "
                                 "(int8, int4-g*); a w8a8 / w4a8 target has int8 / int4-g32's weights")
            setattr(self, key, None if scheme is None else scheme.name)
        if self.init_from is not None:
            self.init_from = Path(self.init_from)
            if not (self.init_from / "model.safetensors").is_file():
                raise ValueError(f"--init-from {str(self.init_from)!r} is not an exported drafter (no model.safetensors)")
        if self.target is None:
            self.target = default_model_dir()
        self.target = Path(self.target)
        # A matched drafter gets a name of its own: <target>-<method>[-<target quantization>][-qat[-<scheme>]]
        # (the QAT scheme is named only when it differs from the target's).
        qat = self.qat and ("qat" if self.qat == self.target_quantization else f"qat-{self.qat}")
        matched = "".join(f"-{part}" for part in (self.target_quantization, qat) if part)
        suffix = {"draft_model": "draft"}.get(self.method, self.method) + matched
        self.out_dir = Path(self.out_dir) if self.out_dir else self.target.parent / f"{self.target.name}-{suffix}"
        self.work_dir = (Path(self.work_dir) if self.work_dir
                         else Path("runs") / f"train-drafter-{self.method}{matched}")


def invocation() -> str | None:
    """The command line that is running, as typed (None when not run from the CLI)."""
    name = Path(sys.argv[0]).name
    return shlex.join(["specdecode", *sys.argv[1:]]) if name == "specdecode" else None


@torch.no_grad()
def evaluate_agreement(recipe: DrafterRecipe, drafter, target, val: np.ndarray, cfg: DrafterTrainConfig, device, dtype) -> dict:
    """On fixed validation windows: top-1 agreement with the target (greedy acceptance per
    token) and mean sum_x min(p, q) = 1 - TV (sampled acceptance per token, METHODS.md 1)."""
    drafter.eval()
    n = cfg.eval_windows
    starts = np.linspace(0, len(val) - cfg.context - 1, n).astype(np.int64)
    agree, overlap, kl = [], [], []
    for i in range(0, n, cfg.batch_size):
        window = torch.from_numpy(np.stack([val[s: s + cfg.context].astype(np.int64) for s in starts[i: i + cfg.batch_size]])).to(device)
        with torch.autocast(device.type, dtype=dtype):
            q_logits, p_logits = recipe.predict(drafter, target, window)
        p, q = p_logits.float().softmax(-1), q_logits.float().softmax(-1)
        agree.append((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean().item())
        overlap.append(torch.minimum(p, q).sum(-1).mean().item())
        kl.append(distill_loss(q_logits, p_logits).item())
    drafter.train()
    return {"val_top1_agreement": float(np.mean(agree)), "val_one_minus_tv": float(np.mean(overlap)),
            "val_kl": float(np.mean(kl))}


def load_initial_weights(drafter: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Fine-tuning's start: an exported drafter's tensors into the freshly built one. Every
    tensor of the checkpoint must fit by name and shape, and every trainable parameter be
    covered (a tied or frozen one may be absent: it came from the target)."""
    from specdecode.models.checkpoint import read_checkpoint

    _, state = read_checkpoint(checkpoint_dir, f"{type(drafter).__name__} drafter")
    own = drafter.state_dict()
    wrong = [k for k, v in state.items() if k not in own or own[k].shape != v.shape]
    uncovered = [n for n, p in drafter.named_parameters() if p.requires_grad and n not in state]
    if wrong or uncovered:
        detail = (f"its tensor {wrong[0]!r} " + ("is not in" if wrong[0] not in own else "has another shape than in")
                  if wrong else f"it lacks the trainable {uncovered[0]!r} of")
        raise ValueError(f"--init-from {str(checkpoint_dir)!r} does not fit the drafter these flags build: {detail} "
                         "the new drafter; pass the method and shape flags it was trained with (its "
                         "training_report.json `command`)")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def train_drafter(cfg: DrafterTrainConfig, resume: bool = False) -> dict:
    device = resolve_device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    recipe = RECIPES[cfg.method]
    # The drafter is initialised from the full-precision target's layers; what it learns to predict
    # (features, soft labels) comes from the target as served, quantised when --target-quantization says so.
    full_target = load_model(cfg.target, torch.float32, device)
    if full_target.config.is_mla:
        raise ConfigError(f"{cfg.target} is a DeepSeek-family target (MLA): its drafter is its own MTP layers "
                          "(speculative_config {\"method\": \"mtp\"} with no model); training separate drafters "
                          "for these targets is not supported yet")
    target_scheme = QuantScheme.parse(cfg.target_quantization)
    target = full_target if target_scheme is None else load_model(cfg.target, torch.float32, device, target_scheme)
    train_tokens, val_tokens = tokenize_corpus(cfg.target / "tokenizer.json", cfg.work_dir / "tokens.npz")
    if cfg.data == "generated":
        train_tokens = generate_dataset(cfg.target, train_tokens, cfg.work_dir / "generated.npz", cfg.generated_sequences,
                                        eos_id=Tokenizer(cfg.target).eos_token_id, seed=cfg.seed,
                                        quantization=cfg.target_quantization)
    torch.manual_seed(cfg.seed)
    drafter = recipe.build(full_target, cfg, train_tokens).to(device).train()
    if cfg.init_from is not None:
        load_initial_weights(drafter, cfg.init_from)
    qat_layers = []
    if cfg.qat is not None:
        qat_layers = enable_qat(drafter, QuantScheme.parse(cfg.qat), exclude=(full_target, target))
    del full_target
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = Checkpointer(cfg.work_dir / "checkpoint.pt", device)
    step = ckpt.load(drafter, opt, data_gen, device) if resume else 0
    before = evaluate_agreement(recipe, drafter, target, val_tokens, cfg, device, dtype) if step == 0 else None
    step, losses = run_loop(cfg, drafter, opt, lambda window: recipe.loss(drafter, target, window), train_tokens,
                            cfg.context, checkpointer=ckpt, data_gen=data_gen, step=step, device=device,
                            autocast_dtype=dtype, desc=f"train-drafter {cfg.method}", params=params)
    after = evaluate_agreement(recipe, drafter, target, val_tokens, cfg, device, dtype)
    if recipe.finalize is not None:
        after.update(recipe.finalize(drafter, target, val_tokens, cfg, device))
    report = {
        "method": cfg.method, "target": cfg.target.name, "command": invocation(), "data": cfg.data,
        "target_quantization": cfg.target_quantization, "qat": cfg.qat,
        "init_from": None if cfg.init_from is None else cfg.init_from.name,
        "steps": step, "tokens_seen": step * cfg.batch_size * cfg.context,
        "wall_seconds": ckpt.elapsed(), "parameters": sum(p.numel() for p in drafter.parameters()),
        "final_train_loss": float(np.mean(losses[-30:])) if losses else None,
        "before_training": before, **after,
    }
    recipe.export(drafter, target, cfg, report)
    if qat_layers:  # ship the weights it is served with: its QAT layers stored quantised
        modules = dict(drafter.named_modules())
        store_quantized(cfg.out_dir, {name: modules[name].weight for name in qat_layers}, QuantScheme.parse(cfg.qat))
    return report

