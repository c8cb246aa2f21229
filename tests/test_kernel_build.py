"""kernels/build.py: the optional kernels' switch and the few-row kernels' blocked layout."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from specdecode.kernels import (attention_cpu, build, decode_stack_cpu, gemm_a8_cpu, gemv_bf16w_cpu, gemv_cpu,
                                gemv_int4_cpu, gemv_int8_cpu, rms_norm_cpu)

# Each optional kernel: its accessor (None / False where it does not serve), the CPU flags it needs and its switch.
OPTIONAL_KERNELS = {
    "attention_cpu": (attention_cpu.available, attention_cpu.REQUIRED_FLAGS, "SPECDECODE_ATTENTION_KERNEL"),
    "decode_stack_cpu": (decode_stack_cpu.extension, set(), "SPECDECODE_NATIVE_STACK"),
    "gemm_a8_cpu": (gemm_a8_cpu._extension, gemm_a8_cpu.REQUIRED_FLAGS, "SPECDECODE_A8_KERNELS"),
    "gemv_bf16w_cpu": (gemv_bf16w_cpu._extension, gemv_bf16w_cpu.REQUIRED_FLAGS, "SPECDECODE_BF16_WEIGHTS"),
    "gemv_cpu": (gemv_cpu._extension, gemv_cpu.REQUIRED_FLAGS, "SPECDECODE_FEW_ROW_KERNELS"),
    "gemv_int4_cpu": (gemv_int4_cpu._extension, build.FEW_ROW_FLAGS, "SPECDECODE_FEW_ROW_KERNELS"),
    "gemv_int8_cpu": (gemv_int8_cpu._extension, build.FEW_ROW_FLAGS, "SPECDECODE_FEW_ROW_KERNELS"),
    "rms_norm_cpu": (rms_norm_cpu._extension, set(), "SPECDECODE_NORM_KERNEL"),
}


@pytest.mark.parametrize("name", OPTIONAL_KERNELS)
def test_every_kernel_this_cpu_supports_builds(name):
    # A kernel that fails to compile is logged and left out, and its tests skip: a compile error would
    # only show as a shorter test run. Where the CPU has its flags and a compiler is here, it must build.
    accessor, flags, switch = OPTIONAL_KERNELS[name]
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None:
        pytest.skip("the kernels are built for x86-64 with a C++ compiler")
    if not set(flags) <= build.cpu_flags() or os.environ.get(switch, "1") == "0":
        pytest.skip(f"{name} does not serve this CPU or is switched off")
    assert accessor(), f"{name} failed to build (see the warning logged above)"


@pytest.mark.parametrize("source, march", [(decode_stack_cpu.SOURCE, "x86-64"), (gemv_bf16w_cpu.SOURCE, "x86-64-v3")])
def test_kernels_with_avx512_and_narrower_forms_compile_for_cpus_without_avx512(source, march):
    # Built with -march=native, these sources take their AVX-512 parts only where the CPU has them: the
    # layer stack builds on any x86-64 CPU, the bf16-weight kernel on AVX2 + FMA ones (x86-64-v3). A build
    # on this CPU cannot show that (an int8 KV cache helper reachable only through the AVX-512 path once
    # kept the stack from building anywhere else), so compile them for those targets (syntax only).
    compiler = shutil.which("c++")
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None:
        pytest.skip("the kernels are built for x86-64 with a C++ compiler")
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    command = [compiler, "-std=c++17", "-fsyntax-only", f"-march={march}", "-fopenmp", "-DTORCH_EXTENSION_NAME=x",
               *includes, str(source)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_few_row_kernels_blocked_layout():
    w = torch.arange(10 * 16, dtype=torch.float32).view(10, 16)
    blocked = build.block_weight(w, 4, 8)  # [ceil(10/4), 16/8, 4, 8]
    assert blocked.shape == (3, 2, 4, 8) and blocked.is_contiguous()
    for b, s, j, k in [(0, 0, 0, 0), (1, 1, 2, 5), (2, 0, 1, 7)]:
        assert blocked[b, s, j, k] == w[b * 4 + j, s * 8 + k]
    assert torch.count_nonzero(blocked[2, :, 2:]) == 0  # rows 10 and 11 are padding
    with pytest.raises(ValueError, match="multiple of 8"):
        build.block_weight(torch.zeros(4, 12), 4, 8)


def test_an_optional_kernel_is_none_when_switched_off_unsupported_or_broken(monkeypatch, caplog):
    source = Path("no-such-kernel.cpp")
    monkeypatch.setenv("SPECDECODE_TEST_KERNEL", "0")
    assert build.optional_extension("test_kernel", source, "SPECDECODE_TEST_KERNEL") is None
    monkeypatch.delenv("SPECDECODE_TEST_KERNEL")
    assert build.optional_extension("test_kernel", source, "SPECDECODE_TEST_KERNEL", {"no_such_cpu_flag"}) is None
    with caplog.at_level("WARNING"):
        assert build.optional_extension("test_kernel", source, "SPECDECODE_TEST_KERNEL") is None  # the build fails
    assert "test_kernel kernel failed to build" in caplog.text


def test_a_kernel_build_is_named_by_its_headers_too(tmp_path):
    # A source's build digest covers the headers it includes (and theirs): a changed header rebuilds it.
    (tmp_path / "k.cpp").write_text('#include <vector>\n#include "a.h"\nint f() { return g(); }\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\ninline int g() { return h(); }\n')
    (tmp_path / "b.h").write_text("#pragma once\ninline int h() { return 1; }\n")
    assert build.local_includes(tmp_path / "k.cpp") == [tmp_path / "a.h", tmp_path / "b.h"]
    before = build.source_digest(tmp_path / "k.cpp")
    (tmp_path / "b.h").write_text("#pragma once\ninline int h() { return 2; }\n")
    build.source_digest.cache_clear()
    assert build.source_digest(tmp_path / "k.cpp") != before
    shipped = Path(build.__file__).with_name("decode_stack_cpu.cpp")
    assert {p.name for p in build.local_includes(shipped)} == {"rms_norm.h", "a8_gemm.h", "bf16_gemm.h", "bf16w_gemm.h",
                                                                "pair_groups.h", "lines_ahead.h", "cached_attention.h",
                                                                "kv_records.h", "thread_team.h", "swiglu.h",
                                                                "fp32_lanes.h"}


def _hold_build_lock(build_dir: Path):
    """A second process that takes `build_dir`'s build lock and keeps it until killed."""
    import subprocess
    import sys
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(build_dir / "build.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.skipif(os.name != "posix", reason="POSIX file locks")
def test_a_build_killed_midway_does_not_hang_the_next_load(tmp_path, caplog):
    # PyTorch's plain `lock` file, left by a build killed midway, made every later load wait forever.
    (tmp_path / "lock").touch()
    with caplog.at_level("WARNING"), build.build_lock(tmp_path, "test_kernel", timeout_s=5):
        assert not (tmp_path / "lock").exists()
    assert "interrupted build" in caplog.text
    # A holder killed while holding the lock releases it with its death: the next load goes on.
    holder = _hold_build_lock(tmp_path)
    with pytest.raises(TimeoutError, match="test_kernel kernel's build lock"):
        with build.build_lock(tmp_path, "test_kernel", timeout_s=0.3):
            pass
    holder.kill()
    holder.wait()
    with build.build_lock(tmp_path, "test_kernel", timeout_s=5):
        pass


def test_a_kernel_loads_under_the_build_lock_in_a_folder_per_torch_install_and_checkout(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    loaded = {}

    def fake_load(name, sources, build_directory, **kwargs):
        folder = Path(build_directory)
        loaded["folder"] = folder
        if os.name == "posix":  # the build lock is held during the load
            import fcntl
            with open(folder / "build.lock", "a") as other, pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    assert build.load_extension.__wrapped__("k", source) == "module"
    assert loaded["folder"].name.endswith(f"_{build.cpu_fingerprint()}_{build.torch_install_digest()}_"
                                          f"{build.source_location_digest(source)}")
    # Another checkout of the same source builds in its own folder (PyTorch's build files name the path).
    other = tmp_path / "other" / "k.cpp"
    other.parent.mkdir()
    other.write_text(source.read_text())
    build.load_extension.__wrapped__("k", other)
    assert loaded["folder"].name.endswith(f"_{build.source_location_digest(other)}")
    assert build.source_location_digest(other) != build.source_location_digest(source)
