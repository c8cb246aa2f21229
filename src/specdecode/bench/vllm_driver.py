"""vLLM as a bench peer: run by vLLM's own Python (its own virtual environment), not imported.

    <vllm python> vllm_driver.py job.json result.json

job.json: {"model", "prompt_ids" [[int]], "max_tokens", "variants": [{"label", "speculative_config" | null}],
           "max_model_len", "seed"}. Every variant runs greedy at batch 1 (one prompt per generate call,
the prompts' token ids as they are, so tokenization cannot differ), after a warm-up prompt; its
wall time covers the timed prompts only. Acceptance is read from vLLM's own counters
(vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens), read before and after.

Only the standard library and vLLM are imported: this file runs outside specdecode's environment.
vLLM starts its engine in a child process, hence the __main__ guard.
"""

from __future__ import annotations

import json
import sys
import time

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters (0 where the engine does not speculate)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals and hasattr(metric, "value"):
            totals[metric.name] += float(metric.value)
    return totals


def run_variant(job: dict, variant: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job.get("dtype", "bfloat16"), max_model_len=job["max_model_len"],
              speculative_config=variant["speculative_config"], seed=job["seed"], max_num_seqs=1,
              disable_log_stats=False, enforce_eager=job.get("enforce_eager", False))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompt_ids"]]
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = spec_counters(llm)
    outputs = []
    start = time.perf_counter()
    for prompt in prompts:
        outputs.append(list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids))
    wall = time.perf_counter() - start
    after = spec_counters(llm)
    delta = {name.split(":")[1]: after[name] - before[name] for name in SPEC_COUNTERS}
    row = {"method": variant["label"], "tokens": sum(len(o) for o in outputs), "wall_seconds": wall,
           "outputs": outputs}
    if delta["spec_decode_num_draft_tokens"] > 0:
        row["acceptance_rate"] = round(delta["spec_decode_num_accepted_tokens"] / delta["spec_decode_num_draft_tokens"], 3)
        row["mean_acceptance_length"] = round(1 + delta["spec_decode_num_accepted_tokens"]
                                              / max(1.0, delta["spec_decode_num_drafts"]), 3)
    return row


def main(job_path: str, result_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    rows, errors = [], {}
    for variant in job["variants"]:
        try:
            rows.append(run_variant(job, variant))
        except Exception as e:  # one variant vLLM cannot run must not cost the others
            errors[variant["label"]] = f"{type(e).__name__}: {e}"
        import gc

        gc.collect()
    with open(result_path, "w") as f:
        json.dump({"rows": rows, "errors": errors, "vllm": __import__("vllm").__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
