"""Exact mode's CPU kernels (exact_cpu.cpp): attention whose every query row is computed the same
way in any batch, at any width and with any number of key columns, and position-keyed noise.

It is compiled on first use with PyTorch's extension builder (a C++ compiler is needed, as for
`torch.compile` on a CPU; about 30 s once, then cached under $SPECDECODE_CACHE/extensions).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from specdecode.errors import ConfigError

SOURCE = Path(__file__).with_name("exact_cpu.cpp")


def _cpu_fingerprint() -> str:
    """Part of the build's name: a kernel compiled with -march=native must not load on another CPU."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags} {torch.__version__}".encode()).hexdigest()[:10]


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load

    from specdecode.defaults import cache_root

    if shutil.which("ninja") is None:  # the ninja wheel's script sits beside this interpreter (a venv not activated)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

    source_hash = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]
    build_dir = cache_root() / "extensions" / f"exact_kernels_{source_hash}_{_cpu_fingerprint()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", "-ffp-contract=fast"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-march=native", "-mprefer-vector-width=512"]
    try:
        return load(name=f"specdecode_exact_kernels_{source_hash}", sources=[str(SOURCE)], extra_cflags=flags,
                    build_directory=str(build_dir), verbose=os.environ.get("SPECDECODE_VERBOSE_BUILD") == "1")
    except Exception as error:  # no compiler, no ninja, a failed build: say what exact mode needs
        raise ConfigError(f"exact mode needs its CPU kernels, which failed to build ({type(error).__name__}: "
                          f"{error}); it needs a C++ compiler and ninja (pip install ninja)") from None


def build() -> None:
    """Compile (or load the cached build of) the kernel now, so a failure shows at startup."""
    _extension()


def exact_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slot_ids: torch.Tensor,
                    mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, H, D]; cache_k/v [slots, C, KVH, D]; slot_ids [B]; mask [B, T, S] bool -> [B, T, H, D]."""
    return _extension().exact_attention(q, cache_k, cache_v, slot_ids, mask, scale)


def keyed_exponential_cpu(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [N], positions [N] int64 -> [N, vocab] float32 Exp(1) noise (noise.py defines the hash)."""
    return _extension().keyed_exponential(keys, positions, vocab)
