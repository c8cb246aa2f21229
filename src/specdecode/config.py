"""Typed configuration: SamplingParams (per request) and EngineConfig (per engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

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
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ConfigError(f"device {self.device!r} is not a torch device; accepted: auto, cpu, cuda, cuda:N") from None
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

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


# ---- speculative decoding ---------------------------------------------------------------------

DRAFT_LENGTH_SCHEDULES = ("constant", "heuristic", "auto")
VERIFY_PRUNING = ("none", "dcut")


@dataclasses.dataclass(slots=True)
class SpeculativeConfig:
    """vLLM-style `--speculative-config`. Every key is documented in the README.

    method: a registered proposer (see `specdecode.spec.proposer.PROPOSERS`).
    model: drafter checkpoint dir; omitted = the drafter shipped for `method` when the
        target is the embedded default model.
    num_speculative_tokens: k, the most draft tokens per step.
    prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first (ngram).
    draft_p_min: stop drafting at the first token whose drafter probability is below it
        (llama.cpp --spec-draft-p-min; that token is dropped). 0 = off.
    draft_n_min: a draft shorter than this is dropped and the step decodes normally
        (llama.cpp --spec-draft-n-min). 0 = off.
    draft_length_schedule: "constant" (k every step), "heuristic" (Hugging Face's
        num_assistant_tokens_schedule: +2 after an all-accepted step, else -1, floor 1, cap k)
        or "auto" (per step, the k in 0..k that maximises expected tokens/s for the batch
        size under the profiled cost model).
    verify_pruning: "none" or "dcut" (D-Cut: cut low-confidence draft positions batch-wide
        when verifying them costs more than they are expected to return).
    confidence_threshold: verify only the draft prefix whose cumulative confidence (product
        of the drafter's per-position confidences) stays at or above it. 0 = off.
    dspark_block_size: DSpark's draft block gamma (verify window gamma + 1); sets
        num_speculative_tokens for method dspark.
    tree_topk: branching of tree drafts (1 = a chain); tree_num_nodes: nodes per tree
        (SGLang --speculative-eagle-topk / --speculative-num-draft-tokens; depth is
        num_speculative_tokens, SGLang's --speculative-num-steps).
    """

    method: str
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    draft_p_min: float = 0.0
    draft_n_min: int = 0
    draft_length_schedule: str = "constant"
    verify_pruning: str = "none"
    tree_topk: int = 1
    tree_num_nodes: int = 16
    confidence_threshold: float = 0.0
    dspark_block_size: int | None = None

    def __post_init__(self) -> None:
        import specdecode.spec.drafters  # noqa: F401  (registers the built-in methods)
        from specdecode.spec.proposer import PROPOSERS

        if self.method not in PROPOSERS:
            raise ConfigError(f"speculative_config.method {self.method!r} is unknown; accepted: {', '.join(sorted(PROPOSERS))}")
        _check(self.model is None or isinstance(self.model, str), "model", "a checkpoint directory path")
        _check(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 64,
               "num_speculative_tokens", "an integer in [1, 64]")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1, "prompt_lookup_min", "an integer >= 1")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "prompt_lookup_max", f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})")
        _check(isinstance(self.draft_p_min, (int, float)) and 0 <= self.draft_p_min < 1, "draft_p_min", "a number in [0, 1)")
        _check(_is_int(self.draft_n_min) and 0 <= self.draft_n_min <= self.num_speculative_tokens,
               "draft_n_min", f"an integer in [0, num_speculative_tokens={self.num_speculative_tokens}]")
        _check(self.draft_length_schedule in DRAFT_LENGTH_SCHEDULES, "draft_length_schedule",
               " or ".join(repr(s) for s in DRAFT_LENGTH_SCHEDULES))
        _check(self.verify_pruning in VERIFY_PRUNING, "verify_pruning", " or ".join(repr(s) for s in VERIFY_PRUNING))
        _check(_is_int(self.tree_topk) and 1 <= self.tree_topk <= 16, "tree_topk", "an integer in [1, 16]")
        _check(isinstance(self.confidence_threshold, (int, float)) and 0 <= self.confidence_threshold < 1,
               "confidence_threshold", "a number in [0, 1)")
        if self.dspark_block_size is not None:
            _check(self.method == "dspark", "dspark_block_size", "only with method 'dspark'")
            _check(_is_int(self.dspark_block_size) and 1 <= self.dspark_block_size <= 64, "dspark_block_size",
                   "an integer in [1, 64]")
            self.num_speculative_tokens = self.dspark_block_size
        _check(_is_int(self.tree_num_nodes) and 1 <= self.tree_num_nodes <= 256, "tree_num_nodes", "an integer in [1, 256]")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict, a JSON string (vLLM's --speculative-config), or None (no speculation)."""
        import json

        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object / dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config key {unknown[0]!r} is unknown; accepted keys: {', '.join(sorted(known))}")
        if "method" not in value:
            raise ConfigError("speculative_config needs a 'method'")
        return cls(**value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, key: str, accepted: str) -> None:
    if not ok:
        raise ConfigError(f"speculative_config.{key} is invalid: expected {accepted}")
