"""`speculative_config`: vLLM-style keys plus this project's own (all documented in the README)."""

from __future__ import annotations

import dataclasses

import specdecode.speculative.propose.builtin  # noqa: F401  (registers the built-in methods)
from specdecode.errors import ConfigError
from specdecode.models.quant import QuantScheme
from specdecode.speculative.propose.registry import PROPOSERS

DRAFT_LENGTH_SCHEDULES = ("constant", "heuristic", "auto")
VERIFY_PRUNING = ("none", "dcut")


@dataclasses.dataclass(slots=True)
class SpeculativeConfig:
    """vLLM-style `--speculative-config`. Every key is documented in the README.

    method: a registered proposer (`specdecode.speculative.propose.registry.PROPOSERS`).
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
    draft_quantization: how the drafter's own weights are stored: "none", "int8", "int4"
        ("int4-g64", "int4-g128"), "w8a8", "w4a8"; unset = the scheme the drafter was trained quantisation-aware
        at (its config.json), else the target's quantization, and beside a full-precision bf16 or
        float32 target on a CPU with AVX-512 VNNI "w4a8" (faster drafting, same outputs; vLLM's
        speculative_draft_model_quantization). Drafters that reuse the target's LM head
        (DFlash, DSpark, Medusa) keep it as the target stores it.
    draft_vocab_size: FR-Spec: learned drafters score only the N most frequent tokens (EAGLE-3:
        the N most frequent of its own draft vocabulary); unset = every token the drafter has.
        Outputs are unchanged (verification is); drafting gets cheaper, acceptance may drop.
    greedy_draft_vocab_size: the same for all-greedy proposals only (verified by token equality,
        where FR-Spec measured no acceptance lost for MTP and the draft model); 0 = every token; unset = draft_vocab_size if
        set, else the method's measured default where token counts are at hand
        (draft_vocab.DEFAULT_GREEDY_DRAFT_VOCAB_SIZE: MTP and the draft model 2,048).
    draft_vocab_frequencies: the token counts ranking them (`specdecode token-frequencies`);
        unset = token_frequencies.json beside the target's weights.
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
    draft_quantization: str | None = None
    draft_vocab_size: int | None = None
    greedy_draft_vocab_size: int | None = None
    draft_vocab_frequencies: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or self.method not in PROPOSERS:
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
        if self.draft_quantization is not None:
            _check(isinstance(self.draft_quantization, str), "draft_quantization", "a string: none, int8, int4, "
                   "int4-g64, int4-g128, w8a8 or w4a8")
            try:
                QuantScheme.parse(self.draft_quantization)
            except ConfigError as e:
                raise ConfigError(f"speculative_config.draft_quantization is invalid: {e}") from None
        for key, least, accepted in (("draft_vocab_size", 1, "an integer >= 1"),
                                     ("greedy_draft_vocab_size", 0, "an integer >= 1, or 0 for every token")):
            size = getattr(self, key)
            if size is not None:
                _check(_is_int(size) and size >= least, key, accepted)
                _check(getattr(PROPOSERS[self.method], "scores_vocabulary", False), key,
                       "only with a learned drafter (it restricts the drafter's LM head)")
        _check(self.draft_vocab_frequencies is None or isinstance(self.draft_vocab_frequencies, str),
               "draft_vocab_frequencies", "a file path")
        _check(_is_int(self.tree_num_nodes) and 1 <= self.tree_num_nodes <= 256, "tree_num_nodes", "an integer in [1, 256]")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From a dict, a JSON string (vLLM's --speculative-config), or None / "none" (any case,
        as on the command line): no speculation."""
        import json

        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object / dict, \"none\" or None; "
                              f"got {type(value).__name__}")
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
