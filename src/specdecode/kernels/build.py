"""Compiling the C++ kernels on first use, with PyTorch's extension builder, cached per source,
CPU and PyTorch install under $SPECDECODE_CACHE/extensions (a C++ compiler and ninja are needed,
as for `torch.compile` on a CPU; about 30 s once)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@functools.cache
def _cpuinfo_flags_line() -> str:
    """The feature-flags line of /proc/cpuinfo ("flags" on x86, "Features" on ARM; "" where unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def cpu_fingerprint() -> str:
    """Part of a build's name: a kernel compiled with -march=native must not load on another CPU."""
    return hashlib.sha256(f"{platform.machine()} {_cpuinfo_flags_line()} {torch.__version__}".encode()).hexdigest()[:10]


def cpu_flags() -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    line = _cpuinfo_flags_line()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _compile_flags() -> list[str]:
    # -fopenmp: at::parallel_for is OpenMP in PyTorch's CPU builds, and serial without it.
    flags = ["-O3", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags += ["-march=native", "-mprefer-vector-width=512"]
    return flags


def local_includes(source: Path) -> list[Path]:
    """The headers beside `source` that it includes (`#include "name.h"`), and theirs, each once."""
    found: list[Path] = []
    pending = [source]
    while pending:
        for name in re.findall(r'^#include "([^"]+)"', pending.pop().read_text(), flags=re.MULTILINE):
            header = source.with_name(name)
            if header not in found:
                found.append(header)
                pending.append(header)
    return found


@functools.cache
def source_digest(source: Path) -> str:
    """A kernel build's identity: its source, the headers it includes and the compiler flags (a changed
    kernel builds anew, and what was measured of the old one is measured again)."""
    text = b"".join(path.read_bytes() for path in [source, *local_includes(source)])
    return hashlib.sha256(text + " ".join(_compile_flags()).encode()).hexdigest()[:10]


def torch_install_digest() -> str:
    """Part of a build's name: the PyTorch install compiled against. Its headers' paths are in the
    build's commands, so two environments sharing one cache would otherwise rebuild each other's
    kernels whenever they alternate."""
    return hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:6]


def source_location_digest(source: Path) -> str:
    """Part of a build's name: the folder the source lives in. PyTorch's build files name the source's
    path, so two checkouts sharing one cache (a worktree beside the main one, for a before/after
    measurement) rebuilt each other's kernels whenever they alternated (30-60 s a load)."""
    return hashlib.sha256(str(Path(source).resolve().parent).encode()).hexdigest()[:6]


BUILD_LOCK_TIMEOUT_S = 900.0  # a build takes 30-60 s; a holder this slow is stuck, not building


@contextlib.contextmanager
def build_lock(build_dir: Path, name: str, timeout_s: float = BUILD_LOCK_TIMEOUT_S) -> Iterator[None]:
    """One process at a time builds or loads a kernel in `build_dir`, under an OS file lock that dies
    with its holder. PyTorch's own lock is a plain file: a build killed midway (Ctrl-C on a first
    load, a killed job) leaves it behind and every later load waits on it forever. Under this lock
    no other process of ours can be building, so such a file is stale and is removed."""
    try:
        import fcntl
    except ImportError:  # no POSIX file locks (Windows): PyTorch's own lock alone
        yield
        return
    with open(build_dir / "build.lock", "a") as handle:
        started = next_report = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - started > timeout_s:
                    raise TimeoutError(f"another process has held the {name} kernel's build lock for "
                                       f"{now - started:.0f} s ({build_dir / 'build.lock'})") from None
                if now >= next_report:
                    log.info("waiting for another process to finish building the %s kernel", name)
                    next_report = now + 30
                time.sleep(0.1)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing the %s kernel's build lock left by an interrupted build (%s)", name, stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load_extension(name: str, source: Path):
    """Compile (or load the cached build of) one C++ source as a Python module; raises what the
    build raised."""
    from torch.utils.cpp_extension import load

    from specdecode.defaults import cache_root

    if shutil.which("ninja") is None:  # the ninja wheel's script sits beside this interpreter (a venv not activated)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    flags = _compile_flags()
    source_hash = source_digest(source)
    build_dir = cache_root() / "extensions" / (f"{name}_{source_hash}_{cpu_fingerprint()}_{torch_install_digest()}_"
                                             f"{source_location_digest(source)}")
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir, name):
        return load(name=f"specdecode_{name}_{source_hash}", sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir), verbose=os.environ.get("SPECDECODE_VERBOSE_BUILD") == "1")


def optional_extension(name: str, source: Path, switch: str, required_flags: set[str] = frozenset(),
                       fallback: str = "PyTorch's ops serve instead"):
    """An optional speed-up kernel: the built module, or None where the environment variable
    `switch` is "0", the CPU lacks `required_flags` or the build failed (logged, then PyTorch's
    path serves). Callers cache the answer (functools.cache), so it is decided once per process."""
    if os.environ.get(switch, "1") == "0" or not set(required_flags) <= cpu_flags():
        return None
    try:
        return load_extension(name, source)
    except Exception as error:
        log.warning("the %s kernel failed to build (%s: %s); %s", name,
                                            type(error).__name__, error, fallback)
        return None


def block_weight(weight: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """weight [N, K] -> [ceil(N / block_n), K / block_k, block_n, block_k], the missing rows zero:
    the few-row kernels' layout, `block_n` outputs' next `block_k` inputs contiguous (one stream)."""
    if weight.dim() != 2 or weight.shape[1] % block_k:
        raise ValueError(f"a 2-D weight whose input size is a multiple of {block_k} is needed, got {tuple(weight.shape)}")
    N, K = weight.shape
    blocks = -(-N // block_n)
    padded = weight.new_zeros(blocks * block_n, K)
    padded[:N] = weight
    return padded.view(blocks, block_n, K // block_k, block_k).transpose(1, 2).contiguous()


FEW_ROW_FLAGS = {"avx2", "fma"}  # what the few-row kernels' intrinsics need


def few_row_ops(name: str, source: Path, namespace: str, ops: tuple[str, ...], fallback: str):
    """A few-row matmul extension (gemv_int8_cpu, gemv_int4_cpu): the built module, or None where the
    CPU lacks AVX2/FMA, SPECDECODE_FEW_ROW_KERNELS=0 or the build failed (logged once). Loading it
    registers the ops `torch.ops.<namespace>.*`; each gets a fake kernel for torch.compile's tracing
    (they run in C++ only): x [..., K] and out_features, their first and fifth arguments, give the
    output [..., out_features]."""
    module = optional_extension(name, source, "SPECDECODE_FEW_ROW_KERNELS", FEW_ROW_FLAGS, fallback)
    if module is not None:
        register_fake_kernels(namespace, ops)
    return module


@functools.cache  # once per process, however often the extension is asked for again
def register_fake_kernels(namespace: str, ops: tuple[str, ...]) -> None:
    for op in ops:
        torch.library.register_fake(f"{namespace}::{op}")(lambda x, *args: x.new_empty(*x.shape[:-1], args[3]))
