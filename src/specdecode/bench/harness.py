"""`specdecode bench`: every method side by side on the same model and prompts, in one run.

For each temperature and concurrency, plain decoding (`none`) is the baseline and every
method runs the same prompts with the same sampling parameters. Timing is paired and
interleaved: the prompts are cut into rounds (a multiple of the concurrency, at least
`ROUND_PROMPTS` prompts), and each round runs every method back to back, in an order that
rotates from round to round. A slow phase of a shared machine (measured here: the same work
varies by 10-25% over tens of seconds) then lands on every method alike. Speedup = total
baseline wall time / total method wall time over all rounds (the same work), with a 90%
bootstrap interval over rounds. At temperature 0 each output is also compared with the
baseline's, token for token.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.bench.prompts import load_prompts
from specdecode.config import SamplingParams
from specdecode.speculative.config import SpeculativeConfig
from specdecode.engine.engine import LLM
from specdecode.errors import ConfigError
from specdecode.speculative.stats import SpecStats

log = logging.getLogger(__name__)

ROUND_PROMPTS = 8  # prompts per timing round at low concurrency (a round at concurrency 1 lasts a few seconds)


@dataclasses.dataclass(slots=True)
class MethodSpec:
    label: str
    config: dict | None  # None = plain decoding

    @classmethod
    def parse(cls, text: str) -> "MethodSpec":
        """`none`, `ngram`, `draft_model:k=3`, `ngram:k=4:prompt_lookup_max=3` or a JSON object."""
        text = text.strip()
        if text == "none":
            return cls("none", None)
        if text.startswith("{"):
            config = json.loads(text)
            label = config.get("method", "?") + "".join(f" {k}={v}" for k, v in config.items() if k != "method")
            SpeculativeConfig.parse(config)
            return cls(label, config)
        name, _, args = text.partition(":")
        config: dict = {"method": name}
        for item in filter(None, args.split(":")):
            key, _, value = item.partition("=")
            key = {"k": "num_speculative_tokens"}.get(key, key)
            try:
                config[key] = json.loads(value)
            except json.JSONDecodeError:
                config[key] = value  # a bare string such as dcut
        SpeculativeConfig.parse(config)  # fail now, not after an hour of baseline
        return cls(text, config)


PEERS = ("transformers", "llama.cpp")


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
    seed: int = 0
    out_dir: Path = Path("bench_out")
    peers: list[str] = dataclasses.field(default_factory=list)  # PEERS
    repeats: int = 1  # measured passes over the prompts per configuration (interleaved with the other methods)

    def __post_init__(self) -> None:
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
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


@dataclasses.dataclass(slots=True)
class Measured:
    round_seconds: list[float]  # wall seconds of every timed round, repeats x rounds, in order
    outputs: list  # the last pass's outputs, in prompt order (its stats stay in llm.stats)


def rounds_of(num_prompts: int, concurrency: int) -> list[range]:
    """Prompt ranges of the timing rounds: whole batches of `concurrency`, >= ROUND_PROMPTS prompts."""
    size = concurrency * max(1, -(-ROUND_PROMPTS // concurrency))
    return [range(i, min(i + size, num_prompts)) for i in range(0, num_prompts, size)]


def measure_interleaved(llms: list[LLM], prompts: list[str], params: list[SamplingParams], repeats: int,
                        concurrency: int = 1, on_run=lambda: None) -> list[Measured]:
    """Time every engine on the same rounds of prompts, round by round: engines A, B, C on
    round 1, then B, C, A on round 2, ... (`repeats` passes over all rounds)."""
    for llm in llms:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up (allocations, caches)
    rounds = rounds_of(len(prompts), concurrency)
    measured = [Measured([], []) for _ in llms]
    turn = 0
    for _ in range(repeats):
        for llm, m in zip(llms, measured):
            llm.stats, m.outputs = SpecStats(), []  # stats and outputs of the last pass only
        for idx in rounds:
            for i in [(turn + j) % len(llms) for j in range(len(llms))]:
                start = time.perf_counter()
                outs = llms[i].generate([prompts[j] for j in idx], [params[j] for j in idx])
                measured[i].round_seconds.append(time.perf_counter() - start)
                measured[i].outputs += outs
                on_run()
            turn += 1
    return measured


def speedup_interval(baseline: list[float], method: list[float], samples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of sum(baseline) / sum(method) over paired rounds."""
    import random

    rng = random.Random(seed)
    n = len(baseline)
    ratios = []
    for _ in range(samples):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(baseline[i] for i in pick) / sum(method[i] for i in pick))
    ratios.sort()
    return ratios[int(0.05 * samples)], ratios[int(0.95 * samples) - 1]


def run_bench(cfg: BenchConfig) -> dict:
    prompts = load_prompts(cfg.prompts, cfg.num_prompts)
    if cfg.methods[0].config is not None:
        cfg.methods.insert(0, MethodSpec("none", None))  # the baseline always runs, first
    # A later `none` is a control: a second plain engine timed like a method. Its speedup shows
    # how far apart two identical engines measure on this machine (the noise floor).
    cfg.methods = [cfg.methods[0]] + [MethodSpec("none (second engine)", None) if m.config is None else m
                                      for m in cfg.methods[1:]]
    runs = []
    total = len(cfg.temperatures) * len(cfg.methods) * cfg.repeats * sum(
        len(rounds_of(len(prompts), c)) for c in cfg.concurrency)
    bar = tqdm(total=total, desc="bench", unit="run")
    info = None
    peer_errors: dict[str, str] = {}
    for temperature in cfg.temperatures:
        # Seeds per prompt: sampled runs draw the same way for every method.
        params = [SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens, ignore_eos=True,
                                 seed=None if temperature == 0 else cfg.seed + i) for i in range(len(prompts))]
        for concurrency in cfg.concurrency:
            bar.set_postfix(T=temperature, c=concurrency)
            llms = [LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, speculative_config=method.config,
                        max_num_seqs=concurrency, seed=cfg.seed) for method in cfg.methods]
            info = info or machine_info(llms[0])
            measured = measure_interleaved(llms, prompts, params, cfg.repeats, concurrency, on_run=lambda: bar.update(1))
            baseline = None
            for method, llm, m in zip(cfg.methods, llms, measured):
                num_tokens = sum(len(o.token_ids) for o in m.outputs)  # one pass
                wall = sum(m.round_seconds) / cfg.repeats  # mean seconds per pass
                record = {
                    "method": method.label, "config": method.config, "temperature": temperature,
                    "concurrency": concurrency, "num_prompts": len(prompts), "output_tokens": num_tokens,
                    "wall_seconds": round(wall, 4), "tokens_per_second": round(num_tokens / wall, 2),
                    "round_seconds": [round(w, 4) for w in m.round_seconds],
                }
                if baseline is None:
                    baseline = (record, m.outputs, m.round_seconds)
                    record["speedup"] = 1.0
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
                if temperature == 0 and baseline is not None:
                    same = sum(o.token_ids == b.token_ids for o, b in zip(m.outputs, baseline[1]))
                    record["outputs_equal_to_plain"] = f"{same}/{len(m.outputs)}"
                runs.append(record)
            llm = llms[0]
            del llms, measured  # free every engine's KV cache before the next concurrency level
            # Peers run at batch 1 (their speculative generation is batch-1 only), greedy.
            if cfg.peers and concurrency == 1 and temperature == 0 and baseline is not None:
                runs += _peer_runs(cfg, llm, prompts, temperature, baseline, peer_errors)
    bar.close()
    result = {"machine": info, "model": str(cfg.model or "default"), "prompts": cfg.prompts,
              "num_prompts": len(prompts), "max_tokens": cfg.max_tokens, "runs": runs}
    if peer_errors:
        result["peer_errors"] = peer_errors
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (cfg.out_dir / "results.md").write_text(markdown_table(result))
    write_plots(result, cfg.out_dir)
    return result


def _peer_runs(cfg: BenchConfig, llm: LLM, prompts: list[str], temperature: float, baseline,
               errors: dict[str, str]) -> list[dict]:
    """Peer engines on the same checkpoint, prompts and draft model (batch 1, greedy): HF
    transformers (plain / assisted / prompt lookup) and llama.cpp (plain / prompt lookup /
    draft model). A peer that cannot run here is recorded with the reason, not silently dropped."""
    from specdecode.bench.peers import run_llama_cpp, run_transformers
    from specdecode.defaults import DEFAULT_MODEL_NAME, is_default_model, models_dir

    drafts = [m.config for m in cfg.methods if m.config and m.config["method"] == "draft_model"]
    lookups = [m.config for m in cfg.methods if m.config and m.config["method"] == "ngram"]
    # k of the peers' drafts: the draft model's as benchmarked here, else prompt lookup's, else 4.
    k = (drafts or lookups or [{}])[0].get("num_speculative_tokens", 4)
    draft_dir = Path(drafts[0]["model"]) if drafts and drafts[0].get("model") else (
        models_dir() / f"{DEFAULT_MODEL_NAME}-draft" if is_default_model(llm.config.model) else None)
    model_dir = Path(llm.config.model)
    runners = {
        "transformers": lambda: run_transformers(model_dir, draft_dir, prompts, cfg.max_tokens, temperature, llm.dtype,
                                                 k, cfg.seed),
        "llama.cpp": lambda: run_llama_cpp(model_dir, draft_dir, [llm.tokenizer.encode(p) for p in prompts],
                                           cfg.max_tokens, k, torch.get_num_threads()),
    }
    records = []
    for engine in cfg.peers:
        try:
            rows = runners[engine]()
        except ImportError as e:
            log.warning("peer %s unavailable: %s", engine, e)
            errors[engine] = f"not installed: {e}"
            continue
        for row in rows:
            tps = row["tokens"] / row["wall_seconds"]
            record = {"method": row["method"], "engine": engine, "config": None, "temperature": temperature,
                      "concurrency": 1, "num_prompts": len(prompts), "output_tokens": row["tokens"],
                      "wall_seconds": round(row["wall_seconds"], 4), "tokens_per_second": round(tps, 2),
                      "speedup": round(tps / baseline[0]["tokens_per_second"], 3)}
            same = sum(o == b.token_ids for o, b in zip(row["outputs"], baseline[1]))
            record["outputs_equal_to_plain"] = f"{same}/{len(prompts)}"
            records.append(record)
    return records


def markdown_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"Model `{result['model']}`, {result['num_prompts']} `{result['prompts']}` prompts, "
        f"{result['max_tokens']} new tokens each; {m['device']} {m['dtype']}, torch {m['torch']}, "
        f"{m['cpu_count']} threads, {m['processor']}.", "",
        "Speedup is against specdecode's plain decoding in the same run, for every row (peers included); "
        "in brackets its 90% bootstrap interval over the interleaved timing rounds. Drafted: draft tokens "
        "sent to verification in one pass over the prompts.", "",
        "| method | T | concurrency | tok/s | speedup | acceptance rate | mean acc. length | per-position acceptance | drafted | draft / verify time | = plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        per_pos = ", ".join(f"{x:.2f}" for x in r.get("per_position_acceptance", []))
        split = (f"{r['draft_time_fraction']:.0%} / {r['verify_time_fraction']:.0%}"
                 if r.get("draft_time_fraction") is not None else "")
        acceptance = f"{r['acceptance_rate']:.1%}" if "acceptance_rate" in r else ""
        length = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else ""
        speedup = f"{r['speedup']:.2f}x"
        if "speedup_interval" in r:
            speedup += " ({:.2f}-{:.2f})".format(*r["speedup_interval"])
        lines.append(
            f"| {r['method']} | {r['temperature']} | {r['concurrency']} | {r['tokens_per_second']:.1f} | "
            f"{speedup} | {acceptance} | {length} | {per_pos} | {r.get('num_draft_tokens', '')} | {split} | "
            f"{r.get('outputs_equal_to_plain', '')} |")
    for engine, reason in result.get("peer_errors", {}).items():
        lines += ["", f"Peer {engine} did not run: {reason}"]
    return "\n".join(lines) + "\n"


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated method specs; options of one method are separated by ':'."""
    parts, depth, current = [], 0, ""
    for ch in text:  # split on commas outside JSON braces
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    try:
        return [MethodSpec.parse(part) for part in parts if part.strip()]
    except json.JSONDecodeError as e:
        raise ConfigError(f"--methods: {e}") from None


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """speedup.png (speedup by method and temperature) and acceptance.png (per-position acceptance)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional (bench extra)
        return []
    runs = [r for r in result["runs"] if r["concurrency"] == min(x["concurrency"] for x in result["runs"])]
    methods = list(dict.fromkeys(r["method"] for r in runs if r["method"] != "none"))
    temps = list(dict.fromkeys(r["temperature"] for r in runs))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(methods)), 3.5))
    width = 0.8 / max(1, len(temps))
    for j, t in enumerate(temps):
        values = [next((r["speedup"] for r in runs if r["method"] == m and r["temperature"] == t), 0) for m in methods]
        ax.bar([i + j * width for i in range(len(methods))], values, width, label=f"T={t}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(methods))], methods, rotation=20, fontsize=8)
    ax.set_ylabel("speedup vs plain decoding")
    ax.legend()
    fig.tight_layout()
    paths = [out_dir / "speedup.png"]
    fig.savefig(paths[0], dpi=90)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in runs:
        if r.get("per_position_acceptance"):
            ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                    label=f"{r['method']} T={r['temperature']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "acceptance.png")
    fig.savefig(paths[1], dpi=90)
    levels = sorted({r["concurrency"] for r in result["runs"]})
    if len(levels) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for t in temps:
            for m in methods:
                sel = sorted((r for r in result["runs"] if r["method"] == m and r["temperature"] == t),
                             key=lambda r: r["concurrency"])
                ax.plot([r["concurrency"] for r in sel], [r["speedup"] for r in sel], marker="o",
                        label=m if len(temps) == 1 else f"{m} T={t}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("speedup vs plain decoding")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out_dir / "speedup_vs_concurrency.png")
        fig.savefig(paths[-1], dpi=90)
    plt.close("all")
    return paths
