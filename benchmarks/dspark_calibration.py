"""Calibration of DSpark's confidence head, measured while serving (not on training data).

Runs the shipped DSpark drafter on HumanEval prompts at temperature 1 with and without its
fitted per-position temperatures. For every drafted position j of every step it records the
cumulative confidence a_j = c_1 ... c_j (what the scheduler and D-Cut rank by) and whether
the verifier accepted position j. A calibrated head has P(accepted | a_j = x) = x: the
reliability curve lies on the diagonal. Writes calibration.json and calibration.png.

    python benchmarks/dspark_calibration.py --out benchmarks/results/calibration
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def collect(num_prompts: int, max_tokens: int, k: int, calibrated: bool) -> tuple[np.ndarray, np.ndarray]:
    from specdecode import LLM, SamplingParams
    from specdecode.bench.prompts import load_prompts

    llm = LLM(speculative_config={"method": "dspark", "num_speculative_tokens": k})
    proposer = llm.speculator.proposer
    if not calibrated:
        proposer.drafter.dspark.confidence_temperatures = []
    predicted, accepted = [], []
    llm.speculator.depth.tracks_confidence = True  # hand the drafted confidences to depth.update
    update = llm.speculator.depth.update

    def record(seqs, num_draft, num_accepted, *args):
        confidence = args[2] if len(args) > 2 else None  # (draft_seconds, num_draft_steps, confidence, ...)
        if confidence is not None:
            for row, n, a in zip(confidence, num_draft, num_accepted):
                survival = np.cumprod(row[:n])
                predicted.extend(survival.tolist())
                accepted.extend([1.0 if j < a else 0.0 for j in range(n)])
        return update(seqs, num_draft, num_accepted, *args)

    llm.speculator.depth.update = record
    prompts = load_prompts("humaneval", num_prompts)
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params)
    return np.asarray(predicted), np.asarray(accepted)


def reliability(predicted: np.ndarray, accepted: np.ndarray, bins: int = 10) -> dict:
    index = np.minimum((predicted * bins).astype(int), bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        sel = index == b
        if sel.any():
            rows.append({"bin": b, "count": int(sel.sum()), "mean_predicted": float(predicted[sel].mean()),
                         "accept_rate": float(accepted[sel].mean())})
            ece += sel.mean() * abs(predicted[sel].mean() - accepted[sel].mean())
    return {"ece": float(ece), "num_positions": int(len(predicted)), "bins": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/calibration"))
    args = parser.parse_args()
    result = {}
    for name, calibrated in (("raw", False), ("calibrated", True)):
        result[name] = reliability(*collect(args.num_prompts, args.max_tokens, args.k, calibrated))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8, label="perfect")
    for name, style in (("raw", "o--"), ("calibrated", "s-")):
        rows = result[name]["bins"]
        ax.plot([r["mean_predicted"] for r in rows], [r["accept_rate"] for r in rows], style,
                label=f"{name} (ECE {result[name]['ece']:.3f})")
    ax.set_xlabel("cumulative confidence a_j")
    ax.set_ylabel("measured acceptance of position j")
    ax.set_title("DSpark confidence head, HumanEval, T=1", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "calibration.png", dpi=90)
    print(json.dumps({k: v["ece"] for k, v in result.items()}))


if __name__ == "__main__":
    main()
