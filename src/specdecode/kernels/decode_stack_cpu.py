"""A Llama-family layer stack's cached forward as one C++ call (decode_stack_cpu.cpp): the ops of
`models/llama.py`'s forward, in its order and on its kernels, without Python between them.

`models/native_stack.py` decides which models and batches it serves and builds it from a model's
layers. SPECDECODE_NATIVE_STACK=0 turns it off (the Python modules serve every forward).
"""

from __future__ import annotations

import functools
from pathlib import Path

from specdecode.kernels import build, rms_norm_cpu

SOURCE = Path(__file__).with_name("decode_stack_cpu.cpp")


@functools.cache
def extension():
    """The built module, or None where it is turned off, the RMSNorm kernel it calls is missing or
    the build failed (logged once)."""
    if rms_norm_cpu._extension() is None:  # loading it registers specdecode_norm::rms_norm
        return None
    return build.optional_extension("decode_stack_cpu", SOURCE, "SPECDECODE_NATIVE_STACK",
                                    fallback="the Python modules serve every forward")
