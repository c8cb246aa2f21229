"""The report of `specdecode bench`: results.json, results.md (a markdown table) and plots."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(result: dict, out_dir: Path) -> None:
    """results.json, results.md and (with matplotlib) the plots, in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown_table(result))
    write_plots(result, out_dir)


def markdown_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"Model `{result['model']}`, {result['num_prompts']} `{result['prompts']}` prompts, "
        f"{result['max_tokens']} new tokens each; {m['device']} {m['dtype']}, torch {m['torch']}, "
        f"{m['cpu_count']} threads, {m['processor']}.", "",
        "Speedup is against specdecode's plain decoding in the same run, for every row (peers included); "
        "in brackets its 90% bootstrap interval over the interleaved timing rounds. Drafted: draft tokens "
        "sent to verification in one pass over the prompts. tok/s: output tokens over wall time (prefill "
        "included); decode tok/s (batch 1): tokens after the first over the time from first to last token; "
        "prefill tok/s (batch 1, plain engines): prompt tokens over the time of each prompt's first step, run "
        "alone (a second plain engine shows in brackets its ratio to the first's, the noise floor). "
        "Peers timed on one phase only (llama.cpp's binaries) are compared with plain decoding's rate of that phase.", "",
        "| method | exact | T | concurrency | tok/s | decode tok/s | prefill tok/s | speedup | acceptance rate | mean acc. length | per-position acceptance | drafted | draft / verify time | = plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if any(r.get("exact") for r in result["runs"]):
        lines[2] += (" Exact rows are measured against exact mode's own plain decoding; the exact plain row "
                     "shows in brackets its tokens/s against plain decoding without exact mode.")
    for r in result["runs"]:
        per_pos = ", ".join(f"{x:.2f}" for x in r.get("per_position_acceptance", []))
        split = (f"{r['draft_time_fraction']:.0%} / {r['verify_time_fraction']:.0%}"
                 if r.get("draft_time_fraction") is not None else "")
        acceptance = f"{r['acceptance_rate']:.1%}" if "acceptance_rate" in r else ""
        length = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else ""
        speedup = f"{r['speedup']:.2f}x"
        if "speedup_interval" in r:
            speedup += " ({:.2f}-{:.2f})".format(*r["speedup_interval"])
        if "vs_exact_off" in r:
            speedup += " [{:.2f}x, {:.2f}-{:.2f}]".format(r["vs_exact_off"], *r["vs_exact_off_interval"])
        prefill = "" if r.get("prefill_tokens_per_second") is None else format(r["prefill_tokens_per_second"], ".1f")
        if "prefill_speedup" in r:
            prefill += " ({:.2f}x, {:.2f}-{:.2f})".format(r["prefill_speedup"], *r["prefill_speedup_interval"])
        lines.append(
            f"| {r['method']} | {'on' if r.get('exact') else 'off'} | {r['temperature']} | {r['concurrency']} | "
            f"{r['tokens_per_second']:.1f} | "
            f"{'' if r.get('decode_tokens_per_second') is None else format(r['decode_tokens_per_second'], '.1f')} | "
            f"{prefill} | {speedup} | {acceptance} | {length} | {per_pos} | {r.get('num_draft_tokens', '')} | {split} | "
            f"{r.get('outputs_equal_to_plain', '')} |")
    for engine, reason in result.get("peer_errors", {}).items():
        lines += ["", f"Peer {engine} did not run: {reason}"]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None without matplotlib (plots are optional: bench extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """speedup.png (speedup by method and temperature) and acceptance.png (per-position acceptance)."""
    plt = pyplot()
    if plt is None:
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
    paths = [save(fig, out_dir / "speedup.png")]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in runs:
        if r.get("per_position_acceptance"):
            ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o",
                    label=f"{r['method']} T={r['temperature']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | earlier accepted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    paths.append(save(fig, out_dir / "acceptance.png"))
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
        paths.append(save(fig, out_dir / "speedup_vs_concurrency.png"))
    plt.close("all")
    return paths
