"""Where the embedded default model and its drafters live.

The project trains and commits its own default model under the repository's `models/`
folder (see models/README.md). `SPECDECODE_MODELS_DIR` points elsewhere, e.g. when the
package is installed without the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

from specdecode.errors import ModelLoadError

DEFAULT_MODEL_NAME = "stdlib-code-22m"


def cache_root() -> Path:
    """Where measured and converted artefacts are cached: $SPECDECODE_CACHE or ~/.cache/specdecode."""
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode"))


def models_dir() -> Path:
    env = os.environ.get("SPECDECODE_MODELS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "models"  # src/specdecode/ -> repo root


def default_model_dir() -> Path:
    path = models_dir() / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"the embedded default model was not found at {path}; pass --model DIR (an HF checkpoint "
            "directory), or set SPECDECODE_MODELS_DIR to the folder holding " + DEFAULT_MODEL_NAME
        )
    return path


def is_default_model(path: str | Path) -> bool:
    try:
        return Path(path).resolve() == default_model_dir().resolve()
    except ModelLoadError:
        return False


# The default model's best measured speculative configuration at batch 1 (BENCHMARKS.md):
# what `specdecode generate` and `specdecode serve` use when no --speculative-config is given.
# ngram k=8: 2.83x on HumanEval at T=0 (k=4: 2.54x; best learned drafter, MTP tree: 1.50x), and 1.00x at T=1.
BEST_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 8}


def cli_speculative_config(value: str | None, model: str | None):
    """--speculative-config: JSON, "none" (plain decoding), or unset = the default model's best
    measured configuration (plain decoding for other models)."""
    if value is None:
        return dict(BEST_SPECULATIVE_CONFIG) if model is None else None
    return value  # JSON or "none": SpeculativeConfig.parse reads both
