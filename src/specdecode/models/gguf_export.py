"""Deprecated: moved to `specdecode.interop.gguf`; this path works for one release."""

import warnings

from specdecode.interop.gguf import *  # noqa: F401,F403
from specdecode.interop.gguf import export_gguf  # noqa: F401

warnings.warn("specdecode.models.gguf_export is deprecated: import from specdecode.interop.gguf",
              DeprecationWarning, stacklevel=2)
