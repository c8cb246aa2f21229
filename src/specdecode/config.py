"""Typed configuration: SamplingParams (per request) and EngineConfig (per engine).

The speculative-decoding config lives with the code it configures: `specdecode.speculative.config`."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from specdecode.device import resolve_device
from specdecode.errors import ConfigError, InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (exactly one field set), vLLM's `StructuredOutputsParams`.

    json: a JSON schema (a dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: the output is one of these strings; grammar: a
    context-free grammar in Lark syntax (GBNF is converted). Compiled by llguidance
    (`specdecode/structured.py`); the output always parses under it.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError("structured outputs take exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("structured outputs json must be a JSON schema (an object, or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured outputs {name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured outputs choice must be a non-empty list of non-empty strings")


@dataclasses.dataclass(slots=True)
class SamplingParams:
    """How one request is decoded. Defaults follow vLLM (temperature 1, max_tokens 16).

    temperature 0 (or below 1e-5) is an exact argmax, not a tiny temperature. top_k 0 (or -1)
    and top_p 1 disable those filters. With `seed` set, the request draws from its own generator, so
    its tokens do not depend on what else is in the batch.

    Logit adjustments (vLLM semantics, applied in this order before temperature, by the one
    `adjust_logits` that plain sampling, drafting and verification share): the grammar of
    `structured_outputs`, `bad_words` (a word's last token is banned where its other tokens
    end the output), `logit_bias` (token id -> added to its logit), `repetition_penalty` (tokens
    seen in the prompt or output: positive logits divided by it, negative multiplied),
    `frequency_penalty` (minus penalty x count in the output) and `presence_penalty` (minus
    penalty once a token is in the output). Then temperature, `min_p` (drop tokens below min_p x
    the top probability), top-k, top-p. `logprobs=N`: each output token's log probability under
    that processed distribution and the N most likely tokens'; `prompt_logprobs=N`: the same
    for every prompt token under the model's raw distribution.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = dataclasses.field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if self.bad_words is None:
            self.bad_words = []
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        stop_ok = isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS and all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)
        checks = [
            (_is_number(self.temperature) and self.temperature >= 0, "temperature", "a finite number >= 0"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]"),
            (_is_int(self.top_k) and 0 <= self.top_k < MAX_TOP_K, "top_k",
             "an integer in [0, 2^31) (0 or -1 disables it; above the vocabulary it keeps every token)"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
             "an integer in [0, 2^64) or None"),
            (stop_ok, "stop", f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                              f"{MAX_STOP_STRING_CHARS} characters"),
            (isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "a list of token ids (integers >= 0)"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "true or false"),
            (_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]"),
            (_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             "a number in [-2, 2]"),
            (_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             "a number in [-2, 2]"),
            (_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             "repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY}] (1 disables it)"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items())),
             "logit_bias", "a map of token ids (integers >= 0) to biases in [-100, 100]"),
            (isinstance(self.bad_words, (list, tuple)) and len(self.bad_words) <= MAX_BAD_WORDS and all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_STRING_CHARS for w in self.bad_words),
             "bad_words", f"a list of at most {MAX_BAD_WORDS} non-empty strings"),
            (self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS), "logprobs",
             f"an integer in [0, {MAX_LOGPROBS}] or None"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}] or None"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "a StructuredOutputsParams (or a dict of its fields) or None"),
        ]
        for ok, key, accepted in checks:
            if not ok:
                raise InvalidRequestError(f"invalid {key}={_short_repr(getattr(self, key))}: expected {accepted}")
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items() if b != 0} or None

    @property
    def adjusts_logits(self) -> bool:
        """Uses a context-dependent logit adjustment (bias, bad words, penalties; not the grammar)."""
        return bool(self.logit_bias or self.bad_words or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Exact argmax: temperature 0, or below 1e-5 (as vLLM): dividing logits by a tinier
        temperature overflows float32 into inf logits and NaN probabilities."""
        return self.temperature < GREEDY_BELOW


# Bounds of SamplingParams (the README lists them).
GREEDY_BELOW = 1e-5
MAX_TOP_K = 2 ** 31
MAX_SEED = 2 ** 64
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_BAD_WORDS = 256
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_REPETITION_PENALTY = 100.0


def _is_int(x) -> bool:
    """An int that is not a bool (True is not a token count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite int or float that is not a bool."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:  # an int beyond float range
        return False


def _short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


VERIFY_KERNELS = ("auto", "quantized")  # EngineConfig.verify_kernels
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8}  # EngineConfig.kv_cache_dtype -> the cache's storage dtype


@dataclasses.dataclass(slots=True)
class EngineConfig:
    """One engine: a target model, its memory bounds, dtype and device."""

    model: str | Path
    dtype: str = "auto"  # auto = the measured fastest sane dtype for the device (see README)
    device: str = "auto"  # auto = CUDA when available, else CPU
    max_num_seqs: int = 16  # KV-cache slots = sequences running at once; more requests wait
    max_model_len: int | None = None  # per-sequence bound (prompt + output); None = model's context
    seed: int = 0  # seeds the shared generator of requests without their own seed
    quantization: str | None = None  # weight-only: None, "int8", "int4" / "int4-g32|64|128" (models/quant.py)
    compile: bool = False  # torch.compile the target's (and a draft model's) forward; see README "Speed"
    # Quantised targets: "auto" = verify forwards from the measured width on run a dense copy of each
    # quantised layer (faster, more memory; models/wide_kernels.py); "quantized" = the int kernels only
    verify_kernels: str = "auto"
    exact: bool = False  # exact mode: invariant kernels + position-keyed seeded sampling; see README "Exact mode"
    hf_overrides: dict | None = None  # config.json keys replaced at load (vLLM's --hf-overrides), e.g. index_topk_pattern
    # The target's KV cache: "auto" = the served dtype; "int8" = per (token, KV head) scaled int8 records (README
    # "Speed": half a bf16 cache's bytes, which attention over a deep context streams)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from specdecode.models.quant import QuantScheme

        QuantScheme.parse(self.quantization)  # a clear error now for an unknown scheme
        if not isinstance(self.compile, bool):
            raise ConfigError(f"compile must be True or False, got {_short_repr(self.compile)}")
        if not isinstance(self.exact, bool):
            raise ConfigError(f"exact must be True or False, got {_short_repr(self.exact)}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ConfigError(f"hf_overrides must be a JSON object of config.json keys, got {_short_repr(self.hf_overrides)}")
        if self.verify_kernels not in VERIFY_KERNELS:
            raise ConfigError(f"verify_kernels {_short_repr(self.verify_kernels)} is not supported; accepted: "
                              f"{', '.join(VERIFY_KERNELS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = (" (fp8 caches need a GPU's fp8 kernels; this engine's quantised cache is int8)"
                    if isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype.startswith("fp8") else "")
            raise ConfigError(f"kv_cache_dtype {_short_repr(self.kv_cache_dtype)} is not supported; accepted: "
                              f"{', '.join(KV_CACHE_DTYPES)}{hint}")
        if self.exact and self.kv_cache_dtype != "auto":
            raise ConfigError("exact=True keeps the KV cache in the served dtype (its invariant attention kernel reads "
                              "no int8 cache): use kv_cache_dtype='auto'")
        if self.exact and self.compile:
            raise ConfigError("exact=True runs eager forwards and cannot be combined with compile=True: compiled "
                              "graphs are specialised by width, and their fused kernels are not width-invariant")
        if not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in DTYPES):
            raise ConfigError(f"dtype {self.dtype!r} is not supported; accepted: auto, {', '.join(DTYPES)}")
        resolve_device(self.device)  # a clear error now for a bad or unavailable device
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2 (or None: the model's context), "
                              f"got {self.max_model_len!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED:
            raise ConfigError(f"seed must be an integer in [0, 2^64), got {_short_repr(self.seed)}")

    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    def quant_scheme(self):
        from specdecode.models.quant import QuantScheme

        return QuantScheme.parse(self.quantization)

    def kv_cache_torch_dtype(self) -> torch.dtype | None:
        """The target's KV cache storage dtype, None = the served dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        # Measured in BENCHMARKS.md: bf16 is the faster choice on CUDA and on CPUs with AMX.
        return torch.bfloat16 if self.torch_device().type == "cuda" else _cpu_auto_dtype()


def _cpu_auto_dtype() -> torch.dtype:
    """bfloat16 on CPUs with native bf16 matrix units (AMX / AVX512-BF16), else float32.

    Measured (BENCHMARKS.md, engine table): on an AMX CPU bf16 decodes faster at every batch
    size and a verify of 8 tokens costs ~1.1x one token, against ~1.8x in float32. On an
    AVX2-only AMD EPYC bf16 decoded one stream 1.9x faster but batch 8 at 0.64x and n-gram
    verification at batch 8 at 0.33x of float32 (BENCHMARKS.md, fourth pass): not faster
    everywhere, so float32 stays the choice there."""
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
