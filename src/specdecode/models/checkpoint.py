"""Trained checkpoints, target or drafter: one folder each, HF-style (config.json + bf16
safetensors + the tokenizer files + training_report.json). `save_checkpoint` writes them;
`store_quantized` turns a QAT drafter's layers into the quantised tensors it is served with."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdecode.errors import ModelLoadError


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, out: Path, target_dir: Path,
                    report: dict | None = None, extra_json: dict[str, dict] | None = None) -> None:
    """Write `out`: model.safetensors (floating tensors as bf16), config.json (with the
    method / target / command provenance when `report` names a method), the tokenizer files
    (and generation_config.json) found in `target_dir`, each `extra_json` file (name -> JSON
    object, written after the copies, e.g. a target's own generation_config.json) and
    training_report.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # Copies: a loaded (fused) drafter's q/k/v weights are views of one tensor, which safetensors refuses.
    tensors = {k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype, copy=True).contiguous()
               for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if report is not None and "method" in report:
        # Provenance: which method this drafter serves, for which target, made by which command.
        # A drafter matched to a quantised target records that scheme and its own QAT scheme (None:
        # trained against the full-precision target / without QAT): serving compares them (resolve.py).
        config = {**config, "specdecode": {"method": report["method"], "target": report.get("target"),
                                           "training_command": report.get("command"),
                                           "target_quantization": report.get("target_quantization"),
                                           "qat": report.get("qat")}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target_dir / name).is_file():
            (out / name).write_bytes((target_dir / name).read_bytes())
    for name, data in (extra_json or {}).items():
        (out / name).write_text(json.dumps(data, indent=2) + "\n")
    if report is not None:
        (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")


def read_checkpoint(path: Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of a drafter folder; a clear error when it is not one. Layers the
    checkpoint stores quantised come back as their dense (dequantised) weights."""
    from safetensors.torch import load_file

    try:
        config, state = json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not a {kind} checkpoint: {e}") from None
    except Exception as e:  # safetensors' own error types for truncated files
        raise ModelLoadError(f"{path}: model.safetensors is corrupt: {e}") from None
    from specdecode.models.quant import dequantize_stored_state, stored_scheme

    scheme = stored_scheme(path)
    if scheme is not None:  # layers stored quantised (models/quant.py): their dense weights for the module
        state = dequantize_stored_state(state, scheme)
    return config, state


def store_quantized(out: Path, linears: dict[str, torch.Tensor], scheme) -> list[str]:
    """Rewrite the checkpoint in `out` with these linear layers (name -> the module's weight)
    stored quantised as `scheme` serves them (models/quant.py), where the saved tensor is that
    weight; returns the names stored. A drafter trained quantisation-aware for `scheme` is then
    shipped as the weights it is served with (int4: about a third of the bytes)."""
    from safetensors.torch import load_file, save_file

    from specdecode.models.quant import store_quantized_state

    state = load_file(str(out / "model.safetensors"))
    names = [name for name, weight in linears.items() if f"{name}.weight" in state
             and torch.equal(state[f"{name}.weight"], weight.detach().to(torch.bfloat16).cpu())]
    if not names:
        return []
    save_file(store_quantized_state(state, names, scheme), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.setdefault("specdecode", {})["stored_quantization"] = scheme.name
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return names
