"""Peer engines measured in the same run as specdecode: Hugging Face transformers `generate`.

Three variants on the same checkpoint and prompts, batch 1 (transformers' speculative
generation is batch-1 only): plain, `assistant_model=` (the same draft model specdecode's
`draft_model` method uses, `num_assistant_tokens` = k, constant schedule) and
`prompt_lookup_num_tokens=k`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def run_transformers(model_dir: Path, draft_dir: Path | None, prompts: list[str], max_tokens: int, temperature: float,
                     dtype: torch.dtype, k: int, seed: int) -> list[dict]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assistant = None
    if draft_dir is not None and (draft_dir / "config.json").is_file():
        assistant = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    variants = [("transformers", {})]
    if assistant is not None:
        variants.append((f"transformers assisted k={k}", {"assistant_model": assistant, "num_assistant_tokens": k,
                                                          "num_assistant_tokens_schedule": "constant",
                                                          "assistant_confidence_threshold": 0.0}))
    variants.append((f"transformers prompt-lookup k={k}", {"prompt_lookup_num_tokens": k}))
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    rows = []
    for label, extra in variants:
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=tok.pad_token_id,
                      **sampling, **extra)
        with torch.inference_mode():
            ids = tok(prompts[0], return_tensors="pt").input_ids
            model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
            outputs, total_tokens = [], 0
            start = time.perf_counter()
            for i, prompt in enumerate(prompts):
                torch.manual_seed(seed + i)
                ids = tok(prompt, return_tensors="pt").input_ids
                out = model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
                outputs.append(out)
                total_tokens += len(out)
            wall = time.perf_counter() - start
        rows.append({"method": label, "tokens": total_tokens, "wall_seconds": wall, "outputs": outputs})
    return rows
