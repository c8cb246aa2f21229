"""Deprecated: `specdecode.spec` is now `specdecode.speculative` (propose / verify / policy).

Every old module path keeps working for one release: `import specdecode.spec.X` gives a
module whose names come from where they live now, and importing this package warns once.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

_NEW = "specdecode.speculative"
_DRAFTERS = f"{_NEW}.propose.drafters"

# old module -> the modules its names live in now
MOVED: dict[str, tuple[str, ...]] = {
    "metrics": (f"{_NEW}.stats",),
    "speculator": (f"{_NEW}.speculator",),
    "proposer": (f"{_NEW}.propose.proposer", f"{_NEW}.propose.registry", f"{_NEW}.propose.resolve"),
    "verify": (f"{_NEW}.verify.chain",),
    "tree": (f"{_NEW}.verify.tree", f"{_NEW}.verify.kv", f"{_NEW}.propose.static_tree"),
    "depth": tuple(f"{_NEW}.policy.{m}" for m in ("controller", "guard", "estimators", "rules")),
    "cost_model": (f"{_NEW}.policy.cost_model",),
    "drafters": (f"{_NEW}.propose.builtin", _DRAFTERS),
    "drafters.chain": (f"{_NEW}.propose.chain",),
    "drafters.features": (f"{_NEW}.propose.features",),
    "drafters.checkpoint": ("specdecode.models.checkpoint",),
    "drafters.ngram": (f"{_DRAFTERS}.ngram.proposer",),
    "drafters.draft_model": (f"{_DRAFTERS}.draft_model.proposer",),
    "drafters.medusa": (f"{_DRAFTERS}.medusa.model", f"{_DRAFTERS}.medusa.proposer"),
    "drafters.eagle": (f"{_DRAFTERS}.eagle.model", f"{_DRAFTERS}.eagle.checkpoint", f"{_DRAFTERS}.eagle.proposer",
                       "specdecode.interop.speculators"),
    "drafters.dflash": (f"{_DRAFTERS}.dflash.model", f"{_DRAFTERS}.dflash.proposer"),
    "drafters.dspark": (f"{_DRAFTERS}.dspark.model", f"{_DRAFTERS}.dspark.proposer"),
}


def _alias(old: str, targets: tuple[str, ...]) -> types.ModuleType:
    module = types.ModuleType(f"{__name__}.{old}", f"Deprecated alias of {', '.join(targets)}.")

    def __getattr__(name: str):
        child = sys.modules.get(f"{module.__name__}.{name}")
        if child is not None:
            return child
        for target in targets:
            new = importlib.import_module(target)
            if hasattr(new, name):
                return getattr(new, name)
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} (it moved to {', '.join(targets)})")

    module.__getattr__ = __getattr__
    if any(other.startswith(old + ".") for other in MOVED):
        module.__path__ = []  # a package: its children are aliases too
    return module


warnings.warn("specdecode.spec is deprecated: import from specdecode.speculative (propose / verify / policy) instead",
              DeprecationWarning, stacklevel=2)
for _old, _targets in MOVED.items():
    sys.modules[f"{__name__}.{_old}"] = _alias(_old, _targets)


def __getattr__(name: str):
    if f"{__name__}.{name}" in sys.modules:
        return sys.modules[f"{__name__}.{name}"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
