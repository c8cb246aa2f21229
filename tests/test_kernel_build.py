"""kernels/build.py: the optional kernels' switch and the few-row kernels' blocked layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode.kernels import build


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
    assert {p.name for p in build.local_includes(shipped)} == {"rms_norm.h", "a8_gemm.h", "cached_attention.h"}
