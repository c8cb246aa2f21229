"""Typed configuration: SamplingParams (per request) and EngineConfig (per engine).

The speculative-decoding config lives with the code it configures: `specdecode.speculative.config`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from specdecode.device import resolve_device
from specdecode.errors import ConfigError, InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. Defaults follow vLLM (temperature 1, max_tokens 16).

    temperature 0 is an exact argmax, not a tiny temperature. top_k 0 (or -1) and top_p 1
    disable those filters. With `seed` set, the request draws from its own generator, so
    its tokens do not depend on what else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", "a number >= 0"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 or -1 disables it)"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (self.seed is None or isinstance(self.seed, int), "seed", "an integer or None"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "a list of token ids"),
        ]
        for ok, key, accepted in checks:
            if not ok:
                raise InvalidRequestError(f"invalid {key}={getattr(self, key)!r}: expected {accepted}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(slots=True)
class EngineConfig:
    """One engine: a target model, its memory bounds, dtype and device."""

    model: str | Path
    dtype: str = "auto"  # auto = the measured fastest sane dtype for the device (see README)
    device: str = "auto"  # auto = CUDA when available, else CPU
    max_num_seqs: int = 16  # KV-cache slots = sequences running at once; more requests wait
    max_model_len: int | None = None  # per-sequence bound (prompt + output); None = model's context
    seed: int = 0  # seeds the shared generator of requests without their own seed

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; accepted: auto, {', '.join(DTYPES)}")
        resolve_device(self.device)  # a clear error now for a bad or unavailable device
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        # Measured in BENCHMARKS.md: bf16 is the faster choice on CUDA and on CPUs with AMX.
        return torch.bfloat16 if self.torch_device().type == "cuda" else _cpu_auto_dtype()


def _cpu_auto_dtype() -> torch.dtype:
    """bfloat16 on CPUs with native bf16 matrix units (AMX / AVX512-BF16), else float32.

    Measured (BENCHMARKS.md, engine table): on an AMX CPU bf16 decodes faster at every batch
    size and a verify of 8 tokens costs ~1.1x one token, against ~1.8x in float32."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        try:
            if getattr(cpu, probe)():
                return torch.bfloat16
        except (AttributeError, RuntimeError):
            continue
    return torch.float32


def __getattr__(name: str):
    """Deprecated: `specdecode.config.SpeculativeConfig` moved to `specdecode.speculative.config`
    (import it from `specdecode` or there); this path works for one release."""
    if name in ("SpeculativeConfig", "DRAFT_LENGTH_SCHEDULES", "VERIFY_PRUNING"):
        import warnings

        from specdecode.speculative import config as speculative_config

        warnings.warn(f"specdecode.config.{name} moved to specdecode.speculative.config", DeprecationWarning, stacklevel=2)
        return getattr(speculative_config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
