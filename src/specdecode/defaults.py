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
