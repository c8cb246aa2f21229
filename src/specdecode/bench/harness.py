"""`specdecode bench`: every method side by side on the same model and prompts, in one run.

For each temperature and concurrency, plain decoding (`none`) is the baseline and every
method runs the same prompts with the same sampling parameters, timed in paired, interleaved
rounds (`specdecode.bench.timing`). Speedup = total baseline wall time / total method wall
time over all rounds (the same work), with a 90% bootstrap interval over rounds. At
temperature 0 each output is also compared with the baseline's, token for token. The records
go to results.json and results.md (`specdecode.bench.report`).
"""

from __future__ import annotations

import dataclasses
import logging
import platform
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.prompts import load_prompts
from specdecode.bench.report import markdown_table, write_plots, write_results
from specdecode.bench.timing import (ROUND_PROMPTS, Measured, measure_interleaved, measure_prefill, rounds_of,
                                     speedup_interval)
from specdecode.config import SamplingParams
from specdecode.engine.engine import LLM
from specdecode.errors import ConfigError
from specdecode.models.inference import Bf16WeightLinear

__all__ = ["PEERS", "BenchConfig", "machine_info", "run_bench",
           # re-exported from the modules they moved to
           "MethodSpec", "parse_methods", "ROUND_PROMPTS", "Measured", "rounds_of", "measure_interleaved",
           "speedup_interval", "markdown_table", "write_plots", "write_results"]

log = logging.getLogger(__name__)

# llama.cpp-bin: its own binaries (peers.run_llama_cpp_native); vllm: vLLM in its own venv (peers.run_vllm)
PEERS = ("transformers", "llama.cpp", "llama.cpp-bin", "vllm")


@dataclasses.dataclass(slots=True)
class BenchConfig:
    methods: list[MethodSpec]
    model: str | None = None
    prompts: str = "humaneval"
    num_prompts: int = 20
    max_tokens: int = 128
    concurrency: list[int] = dataclasses.field(default_factory=lambda: [1])
    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0])
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None  # weight-only int8 / int4 for every method's target and drafter
    hf_overrides: dict | None = None  # config.json keys replaced at load (IndexCache patterns, ...)
    compile: bool = False  # torch.compile every method's target forward (compilation happens in the warm-up)
    verify_kernels: str = "auto"  # quantised targets: LLM(verify_kernels=)
    kv_cache_dtype: str = "auto"  # every engine's target KV cache: LLM(kv_cache_dtype=)
    # Exact mode off and/or on: [False, True] runs every method both ways, interleaved in one run (the
    # plain engine of each mode is that mode's baseline; the exact plain row also shows its cost).
    exact: list[bool] = dataclasses.field(default_factory=lambda: [False])
    seed: int = 0
    out_dir: Path = Path("bench_out")
    peers: list[str] = dataclasses.field(default_factory=list)  # PEERS
    repeats: int = 1  # measured passes over the prompts per configuration (interleaved with the other methods)
    # More SamplingParams fields for every request (penalties, logprobs, structured_outputs, ...), the same for every method
    sampling: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.exact, bool):
            self.exact = [self.exact]
        if not self.exact or len(set(self.exact)) != len(self.exact):
            raise ConfigError(f"exact modes {self.exact}: expected off, on or off,on")
        if self.repeats < 1:
            raise ConfigError(f"--repeats {self.repeats}: expected an integer >= 1")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ConfigError(f"--peers {','.join(unknown)}: accepted: {', '.join(PEERS)}")


def machine_info(llm: LLM) -> dict:
    import specdecode

    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
        "specdecode": specdecode.__version__, "device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""),
        "quantization": llm.quantization.name if llm.quantization is not None else None,
        "exact": llm.exact, "kv_cache_dtype": llm.config.kv_cache_dtype,
        # float32 activations on a bf16 checkpoint's weights kept as bf16 (models/inference.py Bf16WeightLinear)
        "bf16_weights": any(isinstance(m, Bf16WeightLinear) for m in llm.model.modules()),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def run_bench(cfg: BenchConfig) -> dict:
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    if cfg.methods[0].config is not None:
        cfg.methods.insert(0, MethodSpec("none", None))  # the baseline always runs, first
    # A later `none` is a control: a second plain engine timed like a method. Its speedup shows
    # how far apart two identical engines measure on this machine (the noise floor).
    cfg.methods = [cfg.methods[0]] + [MethodSpec("none (second engine)", None) if m.config is None else m
                                      for m in cfg.methods[1:]]
    runs = []
    total = len(cfg.temperatures) * len(cfg.exact) * len(cfg.methods) * cfg.repeats * sum(
        len(rounds_of(len(prompts), c)) for c in cfg.concurrency)
    bar = tqdm(total=total, desc="bench", unit="run")
    info = None
    peer_errors: dict[str, str] = {}
    for temperature in cfg.temperatures:
        # Seeds per prompt: sampled runs draw the same way for every method.
        params = [SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, ignore_eos=True,
                                 seed=None if temperature == 0 else cfg.seed + i, **cfg.sampling)
                  for i in range(len(prompts))]
        for concurrency in cfg.concurrency:
            bar.set_postfix(T=temperature, c=concurrency)
            engines = [(exact, method) for exact in cfg.exact for method in cfg.methods]
            llms = [LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, speculative_config=method.config,
                        max_num_seqs=concurrency, seed=cfg.seed, quantization=cfg.quantization,
                        compile=cfg.compile, exact=exact, hf_overrides=cfg.hf_overrides,
                        verify_kernels=cfg.verify_kernels, kv_cache_dtype=cfg.kv_cache_dtype)
                    for exact, method in engines]
            info = info or machine_info(llms[0])
            measured = measure_interleaved(llms, prompts, params, cfg.repeats, concurrency, on_run=lambda: bar.update(1))
            # Prompt processing at batch 1, of the plain engines (a speculative engine's first token is the same
            # forward: no drafting happens before it); the second plain engine gives its noise floor.
            plain = [i for i, (_, method) in enumerate(engines) if method.config is None] if concurrency == 1 else []
            prompt_ids = [llms[0].tokenizer.encode(p) for p in prompts]
            prefill = dict(zip(plain, measure_prefill([llms[i] for i in plain], prompt_ids, cfg.repeats)))
            prefill_baselines = {}  # exact mode -> round seconds of its plain engine's prompt processing
            baselines = {}  # exact mode -> (record, outputs, round seconds) of its plain engine
            for i, ((exact, method), llm, m) in enumerate(zip(engines, llms, measured)):
                record = _measured_record(method.label, method.config, exact, m, cfg.repeats, temperature,
                                         concurrency, len(prompts))
                wall = sum(m.round_seconds) / cfg.repeats  # mean seconds per pass
                if i in prefill:
                    record.update(_prefill_fields(prefill[i].round_seconds, prompt_ids, prefill_baselines, exact))
                baseline = baselines.get(exact)
                if baseline is None:
                    baselines[exact] = baseline = (record, m.outputs, m.round_seconds)
                    record["speedup"] = 1.0
                    off = baselines.get(False)
                    if exact and off is not None:  # exact mode's cost: its plain decoding against the other's
                        lo, hi = speedup_interval(off[2], m.round_seconds)
                        record["vs_exact_off"] = round(record["tokens_per_second"] / off[0]["tokens_per_second"], 3)
                        record["vs_exact_off_interval"] = [round(lo, 3), round(hi, 3)]
                else:
                    agg = llm.stats  # merged over the last pass's finished requests
                    lo, hi = speedup_interval(baseline[2], m.round_seconds)
                    record.update({
                        "speedup": round(record["tokens_per_second"] / baseline[0]["tokens_per_second"], 3),
                        "speedup_interval": [round(lo, 3), round(hi, 3)],
                        "acceptance_rate": round(agg.acceptance_rate, 4),
                        "mean_acceptance_length": round(agg.mean_acceptance_length, 3),
                        "per_position_acceptance": [round(x, 3) for x in agg.per_position_acceptance],
                        "num_drafts": agg.num_drafts, "num_draft_tokens": agg.num_draft_tokens,
                        "num_accepted_tokens": agg.num_accepted_tokens,
                        "draft_time_fraction": round(agg.draft_time / wall, 3) if concurrency == 1 else None,
                        "verify_time_fraction": round(agg.verify_time / wall, 3) if concurrency == 1 else None,
                    })
                # Greedy, and seeded sampling (every sampled request has a seed): the same tokens as plain?
                record["outputs_equal_to_plain"] = _equal_to_plain([o.token_ids for o in m.outputs], baseline[1])
                runs.append(record)
            baseline = baselines[cfg.exact[0]]
            llm = llms[0]
            del llms, measured  # free every engine's KV cache before the next concurrency level
            # Peers run at batch 1 (their speculative generation is batch-1 only), greedy.
            if cfg.peers and concurrency == 1 and temperature == 0 and baseline is not None:
                peer_rows = _peer_runs(cfg, llm, prompts, temperature, baseline, peer_errors)
                if peer_rows:
                    runs += peer_rows + [_plain_after_peers(cfg, llm, prompts, params, temperature, baseline)]
    bar.close()
    result = {"machine": info, "model": str(cfg.model or "default"), "prompts": cfg.prompts,
              "num_prompts": len(prompts), "max_tokens": cfg.max_tokens, "runs": runs}
    if peer_errors:
        result["peer_errors"] = peer_errors
    write_results(result, cfg.out_dir)
    return result


def _timed(temperature: float, concurrency: int, num_prompts: int, tokens: int, wall: float) -> dict:
    """The fields every record has, specdecode's methods and peers alike, in the order results.json shows them."""
    return {"temperature": temperature, "concurrency": concurrency, "num_prompts": num_prompts, "output_tokens": tokens,
            "wall_seconds": round(wall, 4), "tokens_per_second": round(tokens / wall, 2)}


def _measured_record(label: str, config: dict | None, exact: bool, m: Measured, repeats: int, temperature: float,
                     concurrency: int, num_prompts: int) -> dict:
    """An engine's timing over `repeats` passes; at batch 1 also its decode rate (first tokens left out)."""
    num_tokens = sum(len(o.token_ids) for o in m.outputs)  # one pass
    wall = sum(m.round_seconds) / repeats  # mean seconds per pass
    record = {"method": label, "config": config, "exact": exact,
              **_timed(temperature, concurrency, num_prompts, num_tokens, wall),
              "round_seconds": [round(w, 4) for w in m.round_seconds]}
    if concurrency == 1:  # one request at a time: its decode time is a part of the wall time
        decode_tokens = num_tokens - sum(1 for o in m.outputs if o.token_ids)
        decode_wall = sum(m.decode_seconds) / repeats
        record["decode_tokens_per_second"] = round(decode_tokens / decode_wall, 2) if decode_wall else None
    return record


def _plain_after_peers(cfg: BenchConfig, llm: LLM, prompts: list[str], params: list[SamplingParams],
                       temperature: float, baseline) -> dict:
    """Our plain engine (`llm`) timed again once the peers have run, against its own first timing: the
    peers ran between the two, so a ratio far from 1.0 says the machine's speed moved meanwhile and the
    peers' ratios compare different phases of the run."""
    m = measure_interleaved([llm], prompts, params, cfg.repeats, 1, warm=False)[0]
    record = _measured_record("none (after peers)", None, baseline[0]["exact"], m, cfg.repeats, temperature, 1,
                              len(prompts))
    lo, hi = speedup_interval(baseline[2], m.round_seconds)
    record.update({"speedup": round(record["tokens_per_second"] / baseline[0]["tokens_per_second"], 3),
                   "speedup_interval": [round(lo, 3), round(hi, 3)],
                   "outputs_equal_to_plain": _equal_to_plain([o.token_ids for o in m.outputs], baseline[1])})
    return record


def _prefill_fields(round_seconds: list[float], prompt_ids: list[list[int]], baselines: dict, exact: bool) -> dict:
    """A plain engine's prompt processing rate (prompt tokens over the time of their first steps), and for a
    second plain engine its ratio to the first's with the interval (the noise floor of that rate)."""
    passes = len(round_seconds) // len(rounds_of(len(prompt_ids), 1))
    fields = {"prefill_tokens_per_second": round(passes * sum(map(len, prompt_ids)) / sum(round_seconds), 2)}
    baseline = baselines.setdefault(exact, round_seconds)
    if baseline is not round_seconds:
        lo, hi = speedup_interval(baseline, round_seconds)
        fields.update(prefill_speedup=round(sum(baseline) / sum(round_seconds), 3),
                      prefill_speedup_interval=[round(lo, 3), round(hi, 3)])
    return fields


def _equal_to_plain(outputs: list[list[int]], baseline_outputs: list) -> str:
    """'same/total': outputs whose token ids equal plain decoding's, prompt by prompt ('-': not compared)."""
    if outputs is None:
        return "-"
    same = sum(o == b.token_ids for o, b in zip(outputs, baseline_outputs))
    return f"{same}/{len(outputs)}"


def portable(text: str) -> str:
    """A peer's error with this machine's paths named by the variables that set them
    ($SPECDECODE_LLAMA_CPP_BIN, $SPECDECODE_VLLM_PYTHON, $SPECDECODE_CACHE, ~): results are
    committed and shared."""
    import os

    from specdecode.defaults import cache_root

    places = [(os.environ.get(var), f"${var}") for var in ("SPECDECODE_LLAMA_CPP_BIN", "SPECDECODE_VLLM_PYTHON")]
    places += [(str(cache_root()), "$SPECDECODE_CACHE"), (str(Path.home()), "~")]
    for path, name in sorted(((p.rstrip("/"), n) for p, n in places if p and p.rstrip("/")), key=lambda x: -len(x[0])):
        text = text.replace(path, name)
    return text


def _peer_runs(cfg: BenchConfig, llm: LLM, prompts: list[str], temperature: float, baseline,
               errors: dict[str, str]) -> list[dict]:
    """Peer engines on the same checkpoint, prompts and draft model (batch 1, greedy): HF
    transformers (plain / assisted / prompt lookup) and llama.cpp (plain / prompt lookup /
    draft model). A peer that cannot run here is recorded with the reason, not silently dropped."""
    from specdecode.bench.peers import run_llama_cpp, run_llama_cpp_native, run_transformers, run_vllm
    from specdecode.defaults import DEFAULT_MODEL_NAME, is_default_model, models_dir

    drafts = [m.config for m in cfg.methods if m.config and m.config["method"] == "draft_model"]
    lookups = [m.config for m in cfg.methods if m.config and m.config["method"] == "ngram"]
    # k of the peers' drafts: the draft model's as benchmarked here, else prompt lookup's, else 4.
    k = (drafts or lookups or [{}])[0].get("num_speculative_tokens", 4)
    draft_dir = Path(drafts[0]["model"]) if drafts and drafts[0].get("model") else (
        models_dir() / f"{DEFAULT_MODEL_NAME}-draft" if is_default_model(llm.config.model) else None)
    model_dir = Path(llm.config.model)

    def default_drafter(method: str) -> Path | None:  # the drafter shipped for `method` with the default model
        suffix = {"draft_model": "draft"}.get(method, method)
        return models_dir() / f"{DEFAULT_MODEL_NAME}-{suffix}" if is_default_model(llm.config.model) else None

    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    runners = {
        "transformers": lambda: run_transformers(model_dir, draft_dir, prompts, cfg.max_tokens, temperature, llm.dtype,
                                                 k, cfg.seed),
        "llama.cpp": lambda: run_llama_cpp(model_dir, draft_dir, prompt_ids, cfg.max_tokens, k, torch.get_num_threads()),
        "llama.cpp-bin": lambda: run_llama_cpp_native(model_dir, draft_dir, prompts, prompt_ids, cfg.max_tokens, k,
                                                      torch.get_num_threads(), cfg.quantization),
        "vllm": lambda: run_vllm(model_dir, [m.config for m in cfg.methods if m.config], prompt_ids, cfg.max_tokens,
                                 default_drafter, llm.dtype),
    }
    records = []
    for engine in cfg.peers:
        try:
            rows = runners[engine]()
        except ImportError as e:
            log.warning("peer %s unavailable: %s", engine, e)
            errors[engine] = portable(f"not installed: {e}")
            continue
        except Exception as e:  # a peer that fails must not cost the run its own results
            log.warning("peer %s failed: %r", engine, e)
            errors[engine] = portable(f"failed: {type(e).__name__}: {e}")
            continue
        for row in rows:
            if "error" in row:  # one variant the peer could not run
                errors[f"{engine}: {row['method']}"] = portable(row["error"])
                continue
            records.append(peer_record(engine, row, temperature, len(prompts), baseline))
    return records


def peer_record(engine: str, row: dict, temperature: float, num_prompts: int, baseline) -> dict:
    """A peer's row as a record, its speedup against our plain decoding (`baseline`: its record and
    outputs): against our decode tok/s where the peer timed its decode only (row["timing"] ==
    "decode", llama.cpp's own timings, prompt processing left out), against our prompt processing
    rate where it timed that alone (row["timing"] == "prefill", row["tokens"]: prompt tokens), else
    against our wall-time tok/s."""
    tps = row["tokens"] / row["wall_seconds"]
    phase = {"decode": "decode_tokens_per_second", "prefill": "prefill_tokens_per_second"}.get(row.get("timing"))
    phase = phase if phase and baseline[0].get(phase) else None
    ours = baseline[0][phase or "tokens_per_second"]
    return {"method": row["method"], "engine": engine, "config": None,
            **_timed(temperature, 1, num_prompts, row["tokens"], row["wall_seconds"]),
            **({phase: round(tps, 2)} if phase else {}),
            "speedup": round(tps / ours, 3),
            "outputs_equal_to_plain": _equal_to_plain(row["outputs"], baseline[1]),
            **{key: row[key] for key in ("spread", "acceptance_rate", "mean_acceptance_length") if key in row}}
