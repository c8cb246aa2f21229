"""LLM: the public engine. add_request / step / generate.

A step reads like the spec: schedule a batch, run it (prefill, plain decode, or a
speculative step) into a `StepOutput`, and let the scheduler apply it (cache lengths,
tokens, stop checks, finishing). This module is the composition root: it builds the target
and, from `speculative_config`, the speculator, which sees the target through a
`TargetHandle` only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from pathlib import Path

import torch

from specdecode.config import EngineConfig, SamplingParams
from specdecode.defaults import default_model_dir
from specdecode.engine.lean_width import widen_lean_path
from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner
from specdecode.engine.scheduler import ScheduledBatch, Scheduler
from specdecode.engine.sequence import Sequence
from specdecode.engine.step_output import StepOutput
from specdecode.errors import ConfigError, InvalidRequestError, ModelLoadError
from specdecode.exact.noise import seed_key
from specdecode.logit_adjust import LogitAdjust, RowHistory
from specdecode.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from specdecode.models.loader import load_model
from specdecode.models.wide_kernels import attach_wide_kernels
from specdecode.sampling import SamplingBatch, sample_host
from specdecode.speculative.speculator import TargetHandle, build_speculator
from specdecode.speculative.stats import SpecStats
from specdecode.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | dict  # text, or {"prompt_token_ids": [...]}


@dataclasses.dataclass(slots=True)
class RequestMetrics:
    """Per-request figures: speculative stats (see speculative/stats.py) and latencies (seconds)."""

    num_prompt_tokens: int
    num_output_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]
    per_position_acceptance: list[float]
    acceptance_rate: float
    mean_acceptance_length: float
    draft_time: float
    verify_time: float
    time_to_first_token: float | None
    e2e_latency: float | None

    @classmethod
    def from_sequence(cls, seq: Sequence) -> "RequestMetrics":
        s: SpecStats = seq.stats
        end = seq.finish_time or time.perf_counter()
        return cls(
            num_prompt_tokens=len(seq.prompt_token_ids), num_output_tokens=len(seq.output_token_ids),
            num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
            accepted_per_position=list(s.accepted_per_position), per_position_acceptance=s.per_position_acceptance,
            acceptance_rate=s.acceptance_rate, mean_acceptance_length=s.mean_acceptance_length,
            draft_time=s.draft_time, verify_time=s.verify_time,
            time_to_first_token=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            e2e_latency=end - seq.arrival_time,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    metrics: RequestMetrics
    error: str | None = None  # finish_reason "error": the exception's type and message
    logprobs: list[TokenLogprob] | None = None  # SamplingParams.logprobs set: one per token of token_ids
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs set: one per prompt token


class LLM:
    """Offline engine: `LLM(model=None).generate(prompts, SamplingParams(...))`.

    model: an HF checkpoint directory (Llama / Mistral / Qwen2 / Qwen3 / DeepSeek-V3 / V3.2 / GLM-5); None = the
    embedded default model. speculative_config: a dict or vLLM-style JSON string (see README).
    quantization: weight-only "int8" or "int4" (groups of 32; "int4-g64", "int4-g128") for the
    target and its drafter, quantised at load time and cached on disk; None = dtype weights. With
    the default model, a drafter shipped matched to that scheme is picked when there is one
    (speculative_config.draft_quantization sets the drafter's own precision, w4a8 by default
    beside a bf16 or float32 target, and beside a float32 int4 one, on an AVX-512 VNNI CPU; README
    "Quantised targets: matched drafters").
    compile: torch.compile the target's forward (a draft model's, an EAGLE/MTP drafter's step): faster steps after a
    one-time compilation of a few graphs (tens of seconds on a CPU; logged, and cached by PyTorch).
    verify_kernels: with `quantization`, "auto" lets verify forwards from a measured width on (about 6-8
    tokens here) run a dense copy of each quantised layer, faster than the int kernels there but
    the served dtype's bytes per weight more memory; "quantized" keeps the int kernels at every width
    (README "Speed"). Exact mode always keeps the int kernels.
    exact: exact mode (CPU): the target's forwards give bitwise the same logits for a token alone, in a
    verify forward or in any batch, and a request with a `seed` samples with noise keyed by (seed,
    position, token), so speculation reproduces plain decoding token for token (README "Exact mode").
    hf_overrides: config.json keys to replace at load, as vLLM's --hf-overrides (DeepSeek-V3.2 / GLM-5:
    IndexCache's index_topk_pattern "FSSS..." or index_topk_freq; README "DeepSeek family").
    kv_cache_dtype: the target's KV cache, "auto" (the served dtype) or "int8" (per token and KV head scaled
    records: half a bf16 cache's bytes; standard attention, not exact mode; README "Speed").
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "auto",
        device: str = "auto",
        speculative_config: dict | str | None = None,
        max_num_seqs: int = 16,
        max_model_len: int | None = None,
        seed: int = 0,
        quantization: str | None = None,
        compile: bool = False,
        exact: bool = False,
        hf_overrides: dict | None = None,
        verify_kernels: str = "auto",
        kv_cache_dtype: str = "auto",
    ):
        model_dir = Path(model) if model is not None else default_model_dir()
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        self.config = EngineConfig(model=model_dir, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
                                   max_model_len=max_model_len, seed=seed, quantization=quantization,
                                   compile=compile, exact=exact, hf_overrides=hf_overrides,
                                   verify_kernels=verify_kernels, kv_cache_dtype=kv_cache_dtype)
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype()
        self.tokenizer = Tokenizer(model_dir)
        self.quantization = self.config.quant_scheme()
        self.model = load_model(model_dir, self.dtype, self.device, self.quantization, hf_overrides)
        self.exact = exact
        if exact and self.model.config.is_mla:
            raise ConfigError("exact=True covers standard attention; this model uses MLA (DeepSeek family), which has "
                              "no invariant kernel yet")
        if self.config.kv_cache_dtype != "auto" and (self.model.config.is_mla or self.model.config.index_topk):
            raise ConfigError(f"kv_cache_dtype={self.config.kv_cache_dtype!r} covers standard attention; this model "
                              "uses MLA / DSA (DeepSeek family), whose caches keep the served dtype: use 'auto'")
        if exact:
            _prepare_exact(self.model, self.dtype, self.device)
        elif self.quantization is not None and verify_kernels == "auto":
            attach_wide_kernels(self.model, self.dtype)
        self.model_config = self.model.config
        self.tokenizer.check_fits(self.model_config.vocab_size)
        context = self.model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > context:
            raise ConfigError(f"max_model_len={max_model_len} exceeds this model's context "
                              f"(max_position_embeddings={context}); accepted: 2 .. {context}, or None for {context}")
        self.max_model_len = max_model_len or context
        self.runner = Runner(self.model, max_num_seqs, self.max_model_len, self.dtype, self.device, self.quantization,
                             compile=compile, exact=exact, kv_cache_dtype=self.config.kv_cache_torch_dtype())
        widen_lean_path(self.runner)  # before any request holds a KV slot (and before the cost profile)
        self.scheduler = Scheduler(max_num_seqs, self.tokenizer)
        self.eos_token_ids = tuple(dict.fromkeys(
            self.model_config.eos_token_ids + ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())))
        torch.manual_seed(seed)
        self._request_counter = itertools.count()
        self._grammar_compiler = None
        # The last step's sequences and SamplingBatch, reused while the batch is the same and nothing in
        # it depends on the step (`_sampling_batch`).
        self._reusable_sampling: tuple[list[Sequence], SamplingBatch] | None = None
        self.stats = SpecStats()  # aggregate over finished requests
        self.speculator = build_speculator(speculative_config, TargetHandle(
            self.runner, model_dir, self.tokenizer, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len))

    # ---- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            _check_text(prompt, "the prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            text = prompt.get("prompt")
            if text is not None:
                if not isinstance(text, str):
                    raise InvalidRequestError(f"'prompt' beside prompt_token_ids must be a string, got {type(text).__name__}")
                _check_text(text, "the prompt")
            return text, list(ids)
        raise InvalidRequestError(f"a prompt is a string or a dict {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}")

    def _make_sequence(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> Sequence:
        """Validate a request and build its Sequence (nothing is queued yet)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {type(request_id).__name__}")
        text, ids = self._prompt_ids(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed")
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab}); got {min(ids)}..{max(ids)}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens, "
                "and at least one must be left for the output")
        if params.stop_token_ids and max(params.stop_token_ids) >= vocab:
            raise InvalidRequestError(f"invalid stop_token_ids: token ids must lie in [0, {vocab}); "
                                      f"got {max(params.stop_token_ids)}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(f"invalid logit_bias: token ids must lie in [0, {vocab}); "
                                      f"got {max(params.logit_bias)}")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler.state(params.structured_outputs)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        generator = noise_key = None
        if params.seed is not None and self.exact:
            noise_key = seed_key(params.seed)  # noise keyed by (seed, position, token): no generator state
        elif params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return Sequence(request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
                        eos_token_ids=self.eos_token_ids, max_len=self.max_model_len, generator=generator,
                        noise_key=noise_key, grammar=grammar, bad_word_ids=self._bad_word_ids(params.bad_words),
                        logprobs=[] if params.logprobs is not None else None)

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, as written and after a space (as vLLM: a word mid-text
        usually starts with one)."""
        out = []
        for word in words:
            for text in dict.fromkeys((word, word if word.startswith(" ") else " " + word)):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    @property
    def grammar_compiler(self):
        """The structured-outputs compiler for this tokenizer (built on first use)."""
        if self._grammar_compiler is None:
            from specdecode.structured import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer.to_json(), self.model_config.vocab_size,
                                                     self.eos_token_ids[0])
        return self._grammar_compiler

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        seq = self._make_sequence(prompt, params, request_id)
        if self.scheduler.find(seq.request_id) is not None:  # drafter state is kept per request id
            raise InvalidRequestError(f"request_id {seq.request_id!r} is already waiting or running")
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None and self.speculator is not None:
            self.speculator.release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of every request it advanced or finished."""
        return self._step(finished_only=False)

    def _step(self, finished_only: bool) -> list[RequestOutput]:
        """finished_only: build outputs for the finished requests only (`generate`, which needs no
        running request's output: each copies its token list and logprobs)."""
        batch = self.scheduler.schedule()
        output, failed = self._execute(batch)
        failed += self.scheduler.postprocess(output)
        for seq, error in failed:
            if not seq.is_finished:
                seq.error = f"{type(error).__name__}: {error}"
                self.scheduler.finish(seq, "error")
        done = {id(seq) for seq in output.seqs}
        return self._outputs(output.seqs + [seq for seq, _ in failed if id(seq) not in done], finished_only)

    def _execute(self, batch: ScheduledBatch) -> tuple[StepOutput, list[tuple[Sequence, Exception]]]:
        """The step's StepOutput, and the sequences that made it fail (see `_isolated`)."""
        if batch.prefill:
            return self._isolated(self._prefill, batch.prefill, "prefill")
        if not batch.decode:
            return StepOutput.empty(), []
        if self.speculator is not None:
            return self._isolated(self._speculative, batch.decode, "speculative")
        return self._isolated(self._decode, batch.decode, "decode")

    def _isolated(self, run, seqs: list[Sequence], kind: str) -> tuple[StepOutput, list[tuple[Sequence, Exception]]]:
        """run(seqs) -> StepOutput; if it raises, the same kind of step is retried on halves of
        the batch down to single sequences. A sequence that fails alone is returned with its
        exception (logged once, with its traceback); the other parts' outputs are merged.

        Retries are exact: nothing in a step changes sequence state (the `StepOutput` is applied
        afterwards), drafter state commits only in `on_commit`, cache columns past a sequence's
        length are rewritten by the next forward, and every seeded generator is restored to its
        state before the step ahead of each retry, so a sequence draws what it would have drawn
        in the step that did not fail."""
        rng = {s.request_id: s.generator.get_state() for s in seqs if s.generator is not None}
        outputs, failed = [], []
        # Parts still to run, the next one last: halves depth first, in batch order. A loop, not a
        # recursive closure: that closure referred to itself, so every step's outputs lived in a
        # reference cycle until the garbage collector's next pass.
        parts = [seqs]
        while parts:
            part = parts.pop()
            try:
                outputs.append(run(part))
                continue
            except Exception as error:
                if len(part) == 1:
                    log.exception("request %s failed in a %s step; it finishes with finish_reason 'error'",
                                  part[0].request_id, kind)
                    failed.append((part[0], error))
                    continue
                log.debug("a %s step of %d sequences failed (%r); retrying on halves", kind, len(part), error)
            # Retried outside the except block, so a part's traceback does not chain onto this one.
            for s in part:
                if s.generator is not None:
                    s.generator.set_state(rng[s.request_id])
            parts += [part[len(part) // 2:], part[: len(part) // 2]]
        return StepOutput.merge(outputs), failed

    def _speculative(self, seqs: list[Sequence]) -> StepOutput:
        return self.speculator.step(seqs, self._sampling_batch(seqs))

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The step's sampling batch: parameters, seeded noise, and (for the rows that use them)
        the logit adjustments of each sequence's committed context and its grammar's mask.

        A batch without adjustments, grammars or keyed noise depends only on its sequences'
        parameters and generators (objects that live as long as the sequences), so the same
        sequences in the same order reuse the last step's: building it was 15-18 us of a plain
        W4A8 engine step's ~65 us of host work (its forward ~320-440 us)."""
        reusable = self._reusable_sampling
        if reusable is not None and len(reusable[0]) == len(seqs) and all(a is b for a, b in zip(reusable[0], seqs)):
            return reusable[1]
        batch = self._build_sampling_batch(seqs)
        step_independent = batch.adjust is None and batch.grammar is None and not batch.keyed_rows
        self._reusable_sampling = (list(seqs), batch) if step_independent else None
        return batch

    def _build_sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        from specdecode.structured import committed_masks

        keys = [s.noise_key for s in seqs] if self.exact else None
        params = [s.params for s in seqs]
        adjust = None
        if any(p.adjusts_logits for p in params):
            adjust = LogitAdjust.build(params, [RowHistory(s.prompt_token_ids, s.output_token_ids, s.bad_word_ids)
                                                if s.params.adjusts_logits else None for s in seqs],
                                       self.model_config.vocab_size, self.device)
        grammars = [s.grammar for s in seqs]
        return SamplingBatch.build(params, [s.generator for s in seqs], self.device, noise_keys=keys,
                                   positions=[s.num_tokens for s in seqs], adjust=adjust, grammars=grammars,
                                   grammar=committed_masks(grammars, self.model_config.vocab_size))

    def _prefill(self, seqs: list[Sequence]) -> StepOutput:
        # A request with prompt_logprobs takes logits at every prompt position (only it pays for them).
        num_logits = [len(s.prompt_token_ids) if s.params.prompt_logprobs is not None else 1 for s in seqs]
        entries = [ForwardEntry(s.slot, s.prompt_token_ids, start=0, num_logits=n) for s, n in zip(seqs, num_logits)]
        result = self.runner.forward(entries, hidden_taps=self.speculator.hidden_taps if self.speculator else ())
        batch = self._sampling_batch(seqs)
        last = result.logits[torch.arange(len(seqs)), torch.tensor(num_logits) - 1]  # [B, V] after each prompt
        tokens = sample_host(last, batch)
        if self.speculator is not None:
            self.speculator.on_prefill(seqs, result)
        prompt = None
        if any(s.params.prompt_logprobs is not None for s in seqs):
            prompt = [None if s.params.prompt_logprobs is None else
                      prompt_logprobs(result.logits[b], s.prompt_token_ids, s.params.prompt_logprobs)
                      for b, s in enumerate(seqs)]
        return StepOutput(seqs, [[t] for t in tokens], [len(s.prompt_token_ids) for s in seqs],
                          logprobs=_plain_logprobs(seqs, last[:, None], batch, tokens), prompt_logprobs=prompt)

    def _decode(self, seqs: list[Sequence]) -> StepOutput:
        entries = [ForwardEntry(s.slot, [s.last_token_id], start=s.num_cached) for s in seqs]
        batch = self._sampling_batch(seqs)
        result = self.runner.forward(entries, argmax=batch.raw_argmax)
        tokens = sample_host(result.logits, batch, result.first_choices())
        return StepOutput(seqs, [[t] for t in tokens], [1] * len(seqs),
                          logprobs=_plain_logprobs(seqs, result.logits, batch, tokens))

    def _outputs(self, seqs: list[Sequence], finished_only: bool) -> list[RequestOutput]:
        """Outputs of the step's requests (only the finished ones'); finished ones hand their stats
        over and free drafter state."""
        for seq in seqs:
            if seq.is_finished:
                self._on_finish(seq)
        return [self.output_of(seq) for seq in seqs if seq.is_finished or not finished_only]

    def _on_finish(self, seq: Sequence) -> None:
        self.stats.merge(seq.stats)
        if self.speculator is not None:
            self.speculator.release(seq)

    def output_of(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text.of(self.tokenizer, seq.output_token_ids)
        if seq.stop_text_len is not None:
            text = text[: seq.stop_text_len]
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, text, list(seq.output_token_ids),
                             seq.is_finished, seq.finish_reason, RequestMetrics.from_sequence(seq), seq.error,
                             None if seq.logprobs is None else list(seq.logprobs), seq.prompt_logprobs)

    # ---- offline batch API --------------------------------------------------------------------

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; results come back in input order. A request that fails
        inside the engine comes back finished with finish_reason "error" (see `step`)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a prompt (a string or a dict {{'prompt_token_ids': [...]}}) "
                                      f"or a list of prompts; got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams or a list of them; "
                                      f"got {type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        # Validate every prompt before any is queued: one bad prompt must not leave others half-run.
        seqs = [self._make_sequence(p, sp, f"gen-{next(self._request_counter)}") for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        ids = [seq.request_id for seq in seqs]
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        wanted = set(ids)
        try:
            while wanted - finished.keys():
                for out in self._step(finished_only=True):
                    if out.request_id in wanted:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # interrupted (or a failure outside any request): leave nothing queued
            for request_id in wanted - finished.keys():
                self.abort(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _plain_logprobs(seqs: list[Sequence], logits: torch.Tensor, batch: SamplingBatch,
                    tokens: list[int]) -> list[list[TokenLogprob] | None] | None:
    """Logprobs of a one-token step's tokens for the rows that asked (None when nobody did), from
    logits [B, T, V] at position 0."""
    rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return None
    values = token_logprobs(logits[torch.tensor(rows, device=logits.device), 0], batch.select(rows),
                            [tokens[b] for b in rows], [seqs[b].params.logprobs for b in rows])
    out: list[list[TokenLogprob] | None] = [None] * len(seqs)
    for b, value in zip(rows, values):
        out[b] = [value]
    return out


def _prepare_exact(model, dtype: torch.dtype, device: torch.device) -> None:
    """Exact mode's kernels for the target: the invariant attention (built now, so a missing compiler
    fails at startup) and row-invariant linear layers (`exact/rows.py`)."""
    if device.type != "cpu":
        raise ConfigError(f"exact=True runs on the CPU only for now (its invariant attention is a C++ CPU kernel); "
                          f"got device {device}")
    from specdecode.kernels import exact_cpu
    from specdecode.exact.rows import make_rows_invariant

    exact_cpu.build()
    tiled = make_rows_invariant(model, dtype, device)
    if tiled:
        log.info("exact mode: %d linear layers run in row tiles (%s)", len(tiled),
                 ", ".join(sorted({f"{name.rsplit('.', 1)[-1]}: {tile}" for name, tile in tiled.items()})))


def _check_text(text: str, what: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (e.g. "\\ud800" from a JSON escape) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode text: it holds a lone surrogate ({text[e.start]!r}) "
                                  f"at character {e.start}; send well-formed UTF-8") from None
