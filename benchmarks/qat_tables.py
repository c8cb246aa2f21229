"""Markdown tables of the matched-drafter benchmarks (BENCHMARKS.md "Quantised targets and
matched drafters"), from the result files the commands in that section write.

    python benchmarks/qat_tables.py mismatch   # benchmarks/results/qat_mismatch/<target precision>/
    python benchmarks/qat_tables.py matched    # benchmarks/results/qat_matched/<prompts>[_bf16]/
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ("none", "int8", "int4-g32", "int4-g128")


def _runs(path: Path) -> list[dict]:
    return json.loads((path / "results.json").read_text())["runs"]


def _speedup(r: dict) -> str:
    lo, hi = r.get("speedup_interval") or (None, None)
    return f"{r['speedup']:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if lo is not None else "")


def _same_drafter(a: dict | None, b: dict) -> bool:
    """The same method, k and drafter precision; `model` (named in the int4 runs, where the default
    would be the matched drafter) aside."""
    def strip(c):
        return {k: v for k, v in c.items() if k != "model"}
    return a is not None and strip(a) == strip(b)


def mismatch() -> list[str]:
    """Mean acceptance length (speedup) per drafter x drafter precision x target precision."""
    by_target = {t: _runs(RESULTS / "qat_mismatch" / t) for t in TARGETS if (RESULTS / "qat_mismatch" / t).is_dir()}
    lines = ["| drafter | drafter weights | " + " | ".join(f"target {'bf16' if t == 'none' else t}" for t in by_target)
             + " |", "| --- | --- |" + " --- |" * len(by_target)]
    first = next(iter(by_target.values()))
    for r in first:
        config = r["config"]
        if config is None:
            continue
        cells = []
        for runs in by_target.values():
            match = next(x for x in runs if _same_drafter(x["config"], config))
            cells.append(f"{match['mean_acceptance_length']:.2f} ({match['speedup']:.2f}x, {match['outputs_equal_to_plain']})")
        label = f"{config['method']} k={config['num_speculative_tokens']}"
        lines.append(f"| {label} | {config['draft_quantization']} | " + " | ".join(cells) + " |")
    lines += ["", "Per-position acceptance against the int4-g32 target (drafter bf16 / int8 / int4):", "",
              "| drafter | drafter weights | per-position acceptance | acceptance rate | draft / verify time |",
              "| --- | --- | --- | --- | --- |"]
    for r in by_target.get("int4-g32", []):
        if r["config"] is None:
            continue
        lines.append(f"| {r['config']['method']} | {r['config']['draft_quantization']} | "
                     f"{', '.join(f'{p:.2f}' for p in r['per_position_acceptance'])} | {r['acceptance_rate']:.1%} | "
                     f"{r['draft_time_fraction']:.0%} / {r['verify_time_fraction']:.0%} |")
    controls = {t: next((x for x in runs if x["method"] == "none (second engine)"), None) for t, runs in by_target.items()}
    lines += ["", "Control (a second plain engine): " + ", ".join(
        f"{'bf16' if t == 'none' else t} {_speedup(c)}" for t, c in controls.items() if c) + "."]
    return lines


def _row_name(config: dict | None) -> str:
    if config is None:
        return "plain decoding"
    model = Path(config.get("model", "")).name
    drafter = {"-control": "bf16-trained, fine-tuned 150 more steps on bf16 (control)",
               "-int4-g32-qat": "matched + QAT int4", "-int4-g32": "matched (fine-tuned on int4)"}
    kind = next((v for k, v in drafter.items() if model.endswith(k)), "bf16-trained (shipped)")
    weights = config.get("draft_quantization") or ("int4 (its QAT scheme)" if "qat" in model else "int4 (the target's)")
    return f"{config['method']} k={config['num_speculative_tokens']}: {kind}, drafter weights {weights}"


def matched() -> list[str]:
    lines = []
    for prompts in ("humaneval", "mtbench"):
        path = RESULTS / "qat_matched" / prompts
        if not path.is_dir():
            continue
        pair_by_t = {(r["config"]["method"], r["temperature"]): r  # the bf16 target with its bf16 drafter
                     for r in _runs(RESULTS / "qat_matched" / f"{prompts}_bf16") if r["config"] is not None}
        lines += [f"**{prompts}** (int4-g32 target):", "",
                  "| configuration | T | tok/s | speedup vs int4 plain | mean acc. length | vs the bf16 pair | "
                  "per-position acceptance | = plain |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in _runs(path):
            if r["method"] == "none (second engine)":
                lines.append(f"| plain decoding (second engine, control) | {r['temperature']:g} | "
                             f"{r['tokens_per_second']:.0f} | {_speedup(r)} | | | | |")
                continue
            if r["config"] is None:
                lines.append(f"| plain decoding | {r['temperature']:g} | {r['tokens_per_second']:.0f} | 1.00x | | | | "
                             f"{r.get('outputs_equal_to_plain', '')} |")
                continue
            ref = pair_by_t.get((r["config"]["method"], r["temperature"]))
            vs = f"{r['mean_acceptance_length'] / ref['mean_acceptance_length']:.1%}" if ref else ""
            lines.append(f"| {_row_name(r['config'])} | {r['temperature']:g} | {r['tokens_per_second']:.0f} | "
                         f"{_speedup(r)} | {r['mean_acceptance_length']:.2f} | {vs} | "
                         f"{', '.join(f'{p:.2f}' for p in r['per_position_acceptance'])} | "
                         f"{r.get('outputs_equal_to_plain', '')} |")
        lines += ["", "The bf16 pair (bf16 target, shipped bf16 drafter, same prompts, separate run: acceptance "
                  "only): " + ", ".join(f"{m} T={t:g} {r['mean_acceptance_length']:.2f}"
                                        for (m, t), r in sorted(pair_by_t.items())) + ".", ""]
    return lines


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "mismatch"
    print("\n".join({"mismatch": mismatch, "matched": matched}[which]()))
