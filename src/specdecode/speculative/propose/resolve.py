"""Where a drafter's checkpoint comes from, whether it was built for this target (width,
vocabulary and token map, tapped layers, token ids), and at which weight precision it is served."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from specdecode.defaults import is_default_model, models_dir
from specdecode.errors import ConfigError, DrafterMismatchError
from specdecode.kernels import gemm_a8_cpu
from specdecode.models.quant import QuantScheme
from specdecode.speculative.propose.proposer import ProposerContext
from specdecode.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def resolve_drafter_dir(ctx: ProposerContext, default_name: str) -> Path:
    """speculative_config.model, or the drafter shipped for this method with the default model:
    the one matched to the target's weight quantisation when one is shipped (`train-drafter
    --target-quantization`), else `default_name`. Says which it picked, and warns when a drafter
    is paired with a target quantised differently from the one it was matched to."""
    method = ctx.config.method
    if ctx.config.model is not None:
        path = Path(ctx.config.model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"speculative_config.model {str(path)!r} is not a checkpoint directory (no config.json)")
        _warn_if_mismatched(ctx, path)
        return path
    if not is_default_model(ctx.target_dir):
        raise ConfigError(f"speculative_config.model is required for method {method!r}: drafters are shipped "
                          "only for the embedded default model")
    path = models_dir() / default_name
    if not (path / "config.json").is_file():
        raise ConfigError(f"the shipped {method!r} drafter is missing at {path}; train it with "
                          f"`specdecode train-drafter --method {method}` or pass speculative_config.model")
    if ctx.quantization is None:
        return path
    target_scheme = ctx.quantization.name
    matched = _shipped_matched_drafter(default_name, method, target_scheme)
    if matched is not None:
        log.info("speculative_config: %s target, using %s, the %s drafter trained against it", target_scheme,
                 matched.name, method)
        return matched
    log.info("speculative_config: no %s drafter matched to the %s target is shipped; using %s (trained against "
             "the full-precision target)", method, target_scheme, path.name)
    return path


def drafter_provenance(path: Path) -> dict:
    """The `specdecode` block of a drafter's config.json (method, target, target_quantization,
    qat; empty when it has none, e.g. a drafter made elsewhere)."""
    try:
        block = json.loads((path / "config.json").read_text()).get("specdecode")
    except (OSError, json.JSONDecodeError, AttributeError):
        return {}
    return block if isinstance(block, dict) else {}


def _shipped_matched_drafter(default_name: str, method: str, target_scheme: str) -> Path | None:
    """The shipped `<default_name>-...` folder of this method matched to `target_scheme`; of
    several, one that was also trained quantisation-aware at that scheme."""
    found = []  # (not trained quantisation-aware at the scheme, path): the QAT one sorts first
    for path in sorted(models_dir().glob(f"{default_name}-*")):
        meta = drafter_provenance(path)
        if meta.get("method") == method and meta.get("target_quantization") == target_scheme:
            found.append((meta.get("qat") != target_scheme, path))
    return min(found)[1] if found else None


def _warn_if_mismatched(ctx: ProposerContext, path: Path) -> None:
    meta = drafter_provenance(path)
    if "target_quantization" not in meta:
        return  # no record of what it was trained against
    theirs, ours = meta["target_quantization"], ctx.quantization.name if ctx.quantization is not None else None
    if theirs != ours:
        log.warning("speculative_config.model %s was trained against the %s target; this target is %s: its "
                    "acceptance may be lower (train a matched one with `specdecode train-drafter "
                    "--target-quantization %s`)", path, theirs or "full-precision", ours or "full-precision",
                    ours or "none")


# The drafter's scheme beside a full-precision (bf16 or float32) target on a CPU with the int8-activation
# kernels. Measured at batch 1 on the default model, 16 HumanEval prompts x 128: beside bf16 (BENCHMARKS
# "eighteenth pass", two runs) EAGLE-3 k=4 1.05-1.06x plain decoding with bf16 drafter weights, 1.15-1.16x
# with w4a8 (1.13-1.14x w8a8), MTP 1.15-1.18x -> 1.20-1.30x, the draft model 1.06-1.08x -> 1.26x, acceptance
# 0.0-1.5 points lower; beside float32 ("forty-second pass", an AVX-512 CPU without bf16 arithmetic, the
# drafters' bf16 weights under float32 before) EAGLE-3 1.35x -> 1.64x, MTP 1.57x -> 1.95x, the draft model
# 1.49x -> 1.72x, T=1 and 4 / 16 in flight gaining too. Outputs are the target's either way: verification
# decides every token.
FULL_PRECISION_DRAFTER_SCHEME = "w4a8"
FULL_PRECISION_DTYPES = (torch.bfloat16, torch.float32)
# Beside float32 activations a drafter that would be weight-only int4 in groups of 32 (the QAT drafters of
# an int4 target, or a drafter lent an int4 target's scheme) drafts at w4a8: the same int4 weights, int8
# activations. Measured beside a float32 + int4 target (BENCHMARKS "forty-fourth pass", 16 HumanEval
# prompts x 128, two runs): MTP 1.06-1.07x -> 1.20x plain decoding, EAGLE-3 0.91x -> 1.03x, the draft model
# 0.95x -> 1.09x, acceptance level (mean length within 0.01).
INT4_BESIDE_FLOAT32_SCHEME = "w4a8"


def drafter_quantization(ctx: ProposerContext, path: Path) -> QuantScheme | None:
    """How the drafter's own linear layers are stored: speculative_config.draft_quantization
    when set ("none": the activation dtype); else the scheme it was trained quantisation-aware
    at (`train-drafter --qat`); else the target's, and beside a full-precision bf16 or float32 target
    on a CPU where the w8a8 / w4a8 kernels are built, `FULL_PRECISION_DRAFTER_SCHEME` (the drafter's
    weights are read once per drafted token: int4 weights with int8 activations draft faster). On such
    a CPU, an int4-g32 scheme beside float32 activations becomes `INT4_BESIDE_FLOAT32_SCHEME`."""
    if ctx.config.draft_quantization is not None:
        return QuantScheme.parse(ctx.config.draft_quantization)
    qat = drafter_provenance(path).get("qat")
    scheme = QuantScheme.parse(qat) if qat else ctx.quantization
    a8_kernels = gemm_a8_cpu.available(ctx.device)
    if scheme is None and ctx.dtype in FULL_PRECISION_DTYPES and a8_kernels:
        return QuantScheme.parse(FULL_PRECISION_DRAFTER_SCHEME)
    if (scheme is not None and scheme.weight_only and scheme.bits == 4 and scheme.group_size == gemm_a8_cpu.BLOCK
            and ctx.dtype == torch.float32 and a8_kernels):
        return QuantScheme.parse(INT4_BESIDE_FLOAT32_SCHEME)
    return scheme


def check_fits_target(ctx: ProposerContext, drafter_dir: Path, *, hidden_size: int | None = None,
                      vocab_size: int | None = None, taps: dict[str, Sequence[int]] | None = None,
                      token_ids: dict[str, Sequence[int]] | None = None) -> None:
    """A learned drafter must have been built for this target; each family passes what its
    checkpoint declares, and a mismatch is a `DrafterMismatchError` (a ConfigError) naming it:
    - hidden_size: the width at which it reads the target's features or embeddings;
    - vocab_size: the vocabulary it speaks; its tokenizer.json, when it has one, must map every
      token to the target's id (`check_same_vocabulary`);
    - taps: config key -> the target hidden_states indices it reads, each in 0 .. num_hidden_layers;
    - token_ids: config key -> target token ids it uses (a mask id, draft-to-target ids), each < vocab_size."""
    target = ctx.target.config
    where = f"speculative_config.model {str(drafter_dir)!r}"
    if hidden_size is not None and hidden_size != target.hidden_size:
        raise DrafterMismatchError(f"{where} was built for a target with hidden_size {hidden_size}; this target's "
                                   f"hidden_size is {target.hidden_size}")
    check_same_vocabulary(drafter_dir, vocab_size, ctx)
    for key, layers in (taps or {}).items():
        outside = [i for i in layers if not 0 <= i <= target.num_hidden_layers]
        if outside:
            raise DrafterMismatchError(
                f"{where} reads target layers {key}={list(layers)}, but this target has {target.num_hidden_layers} "
                f"layers (hidden_states indices 0..{target.num_hidden_layers}): it was built for another target")
    for key, ids in (token_ids or {}).items():
        outside = [i for i in ids if not 0 <= i < target.vocab_size]
        if outside:
            raise DrafterMismatchError(f"{where}: {key} uses token id {outside[0]}, outside this target's vocabulary "
                                       f"(vocab_size {target.vocab_size}): it was built for another target")


def check_same_vocabulary(drafter_dir: Path, drafter_vocab_size: int | None, ctx: ProposerContext) -> None:
    """A drafter must speak the target's vocabulary: same size (when it declares one), same
    token -> id map (when it has a tokenizer.json)."""
    where = f"speculative_config.model {str(drafter_dir)!r}"
    if drafter_vocab_size is not None and drafter_vocab_size != ctx.target.config.vocab_size:
        raise DrafterMismatchError(f"{where}: the drafter's vocab_size is {drafter_vocab_size}, the target's is "
                                   f"{ctx.target.config.vocab_size}; a drafter must use the target's tokenizer")
    if (drafter_dir / "tokenizer.json").is_file():
        ours, theirs = ctx.tokenizer._tok.get_vocab(), Tokenizer(drafter_dir)._tok.get_vocab()
        if theirs != ours:
            token = next((t for t in ours if theirs.get(t) != ours[t]), None) or next(t for t in theirs if t not in ours)
            raise DrafterMismatchError(
                f"{where}: the drafter's tokenizer.json maps tokens differently from the target's (token {token!r}: "
                f"id {theirs.get(token)} there, {ours.get(token)} in the target's); a drafter must use the "
                "target's tokenizer")
