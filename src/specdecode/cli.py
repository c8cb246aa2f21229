"""Command line: `specdecode generate|serve|bench|profile|train-target|train-drafter|index-cache-search|export`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _add_config_flags(p, cls, flags: dict[str, str] | None = None, variants: dict[str, type] | None = None) -> None:
    """One `--field-name` flag per field of the config dataclass `cls`, its default and help
    taken from the field (metadata "help" and "choices"): the dataclass is the one source of
    defaults. `flags` renames a field's flag (field -> flag name without dashes); bool fields
    are store_true, the others take the field's type (int, float, str, Path). A field without a
    default is a required flag. The fields `cls` inherits (train/common.py's TrainRunConfig,
    the optimiser and run fields) come after its own, each group in declaration order.

    `variants` (name -> config class, `cls` the union of their fields): one parser for several
    configs, e.g. train-target's --arch. Flags then default to unset (the chosen class fills in
    its own default) and the help lists each variant's default."""
    import dataclasses
    import types
    import typing

    hints = typing.get_type_hints(cls)
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    for field in sorted(dataclasses.fields(cls), key=lambda f: f.name in inherited):
        name = (flags or {}).get(field.name, field.name.replace("_", "-"))
        kind = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))  # Path | None -> Path
        help_text = field.metadata.get("help", "").replace("%", "%%")
        kwargs: dict = {"dest": field.name}
        if variants:
            defaults = {name: next((f.default for f in dataclasses.fields(v) if f.name == field.name), None)
                        for name, v in variants.items()}
            owners = [name for name, v in variants.items() if field.name in {f.name for f in dataclasses.fields(v)}]
            kwargs["default"] = argparse.SUPPRESS
            if kind is not bool:
                shown = sorted({str(defaults[n]) for n in owners})
                help_text += (f" (default: {shown[0]})" if len(shown) == 1 else
                              " (default: " + "; ".join(f"{n}: {defaults[n]}" for n in owners) + ")")
            if len(owners) < len(variants):
                help_text += f" [{', '.join(owners)} only]"
        elif field.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = field.default
            if field.default is not None and kind is not bool:
                help_text += f" (default: {field.default})"
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = kind
            if "choices" in field.metadata:
                kwargs["choices"] = list(field.metadata["choices"])
            else:
                kwargs["metavar"] = name.upper().replace("-", "_")
        p.add_argument("--" + name, help=help_text, **kwargs)


def _config_from_args(cls, args):
    """The config dataclass `cls` built from the flags `_add_config_flags` added (flags left
    unset under `variants` take `cls`'s own defaults)."""
    import dataclasses

    return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls) if hasattr(args, field.name)})


def _target_archs() -> dict:
    from specdecode.train.deepseek_target import DeepSeekPretrainConfig
    from specdecode.train.pretrain import PretrainConfig

    return {"llama": PretrainConfig, "deepseek_v32": DeepSeekPretrainConfig}


def _add_train_target(sub) -> None:
    from specdecode.train.deepseek_target import DeepSeekPretrainConfig

    p = sub.add_parser(
        "train-target",
        help="pre-train the embedded default code model on the Python standard library",
        description="Pre-train a code model from scratch on this interpreter's standard library (.py "
        "files), then export it in HF layout (bf16 safetensors). --arch llama (default) is the shipped "
        "models/stdlib-code-22m; --arch deepseek_v32 a DeepSeek-V3.2-style model (MLA, MoE, DSA indexer, "
        "one jointly trained MTP layer), the shipped models/stdlib-code-21m-dsv32.",
    )
    p.add_argument("--arch", choices=list(_target_archs()), default="llama",
                   help="architecture and its recipe (default: llama)")
    # Flag names older than the generated ones, kept for the scripts and docs that use them.
    _add_config_flags(p, DeepSeekPretrainConfig, {"out_dir": "out", "num_layers": "layers", "num_heads": "heads",
                                                  "num_kv_heads": "kv-heads"}, variants=_target_archs())
    p.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt")
    p.set_defaults(func=_run_train_target)


def _run_train_target(args) -> int:
    import json

    import dataclasses

    from specdecode.errors import ConfigError
    from specdecode.train.pretrain import train

    cls = _target_archs()[args.arch]
    foreign = sorted(name for name in vars(args) if name in {f.name for f in dataclasses.fields(_target_archs()["deepseek_v32"])}
                     and name not in {f.name for f in dataclasses.fields(cls)})
    if foreign:
        raise ConfigError(f"--arch {args.arch} has no option {', '.join('--' + n.replace('_', '-') for n in foreign)}")
    report = train(_config_from_args(cls, args), resume=args.resume)
    print(json.dumps(report, indent=2))
    return 0


def _json_object(value: str) -> dict:
    import json

    try:
        data = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return data


def _on_off(value: str) -> bool:
    from specdecode.errors import ConfigError

    if value.strip() not in ("on", "off"):
        raise ConfigError(f"--exact {value!r}: expected off, on or off,on")
    return value.strip() == "on"


def _add_model_args(p, speculative: bool = True, exact: bool = True) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (Llama, Mistral, Qwen2, Qwen3, DeepSeek-V3, DeepSeek-V3.2, GLM-5 glm_moe_dsa); default: the embedded model")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/activations dtype; auto = the measured faster one for the device (see README)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--quantization", default=None, metavar="SCHEME",
                   help="quantisation of the target and its drafter: weight-only int8 (per channel), int4 (groups "
                   "of 32), int4-g64, int4-g128, or w8a8 / w4a8 (int8 / int4-g32 weights, activations quantised to "
                   "int8 per block of 32 as llama.cpp's Q8_0 / Q4_0 matmuls do: other models, faster verification "
                   "on AVX-512 VNNI CPUs); "
                   "quantised at load and cached on disk (default: none, dtype weights). "
                   "With the default model, a drafter matched to this scheme is used where one is shipped; the "
                   "drafter's own precision: speculative_config draft_quantization")
    p.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help='config.json keys to replace at load, as vLLM\'s, e.g. \'{"index_topk_pattern": "FSSS"}\' '
                   "(IndexCache on DeepSeek-V3.2 / GLM-5 targets; default: none)")
    p.add_argument("--verify-kernels", default="auto", choices=["auto", "quantized"],
                   help="with --quantization: auto = verify forwards from a measured width on (about 6-8 tokens here) run "
                   "a dense copy of each quantised layer, faster there than the int kernels but the dtype's bytes per "
                   "weight more memory; quantized = the int kernels at every width (least memory). Default: auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="the target's KV cache: auto = the served dtype; int8 = int8 values with a float32 scale per "
                   "token and KV head, half a bf16 cache's bytes, which decode steps over a deep context and at "
                   "concurrency stream (README 'Speed': 1.2-1.5x faster 512-token generations measured on a "
                   "float32-served CPU; outputs close to, not identical with, the served dtype's; not with "
                   "--exact or MLA / DSA models). Default: auto")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the target's (and a draft model's) forward: faster steps after compiling a few "
                   "graphs once (tens of seconds on a CPU, logged; default: --no-compile)")
    if exact:
        p.add_argument("--exact", action=argparse.BooleanOptionalAction, default=False,
                       help="exact mode (CPU): bitwise width- and batch-invariant target forwards, and requests with "
                       "a seed sampled by position-keyed noise, so speculation reproduces plain decoding token for "
                       "token, greedy and seeded (README 'Exact mode'; not with --compile; default: --no-exact)")
    if speculative:
        p.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='vLLM-style JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (keys: README); '
                       '"none" = plain decoding; unset = the default model\'s best measured drafter (plain for other models)')


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal",
                       description="Generate a continuation of --prompt, streaming it as it is produced, then "
                       "print a one-line summary (tokens, tokens/s, and speculative stats when enabled).")
    p.add_argument("--prompt", required=True, help="prompt text (use --chat to wrap it as a user message)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exact argmax; the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text")
    _add_model_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    import time

    from specdecode import LLM, SamplingParams
    from specdecode.tokenizer import IncrementalDetokenizer

    from specdecode.defaults import cli_speculative_config

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
              compile=args.compile, exact=args.exact, hf_overrides=args.hf_overrides, verify_kernels=args.verify_kernels,
              kv_cache_dtype=args.kv_cache_dtype,
              speculative_config=cli_speculative_config(args.speculative_config, args.model), max_num_seqs=1)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
                            seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    sys.stdout.write(args.prompt if not args.chat else "")
    request_id = llm.add_request(prompt, params)
    detok = IncrementalDetokenizer(hold_back=max((len(x) for x in params.stop), default=1) - 1)
    start = time.perf_counter()
    final = None
    while llm.has_unfinished():
        for out in llm.step():
            if out.request_id == request_id:
                sys.stdout.write(detok.delta(out.text, final=out.finished))
                sys.stdout.flush()
                final = out
    elapsed = time.perf_counter() - start
    m = final.metrics
    summary = (f"\n\n[{m.num_output_tokens} tokens in {elapsed:.2f}s, {m.num_output_tokens / elapsed:.1f} tokens/s, "
               f"finish_reason={final.finish_reason}")
    if llm.speculator is not None:
        per_pos = ", ".join(f"{x:.2f}" for x in m.per_position_acceptance)
        summary += (f"; {llm.speculator.config.method}: mean acceptance length {m.mean_acceptance_length:.2f}, "
                    f"acceptance rate {m.acceptance_rate:.1%} ({m.num_accepted_tokens}/{m.num_draft_tokens}), "
                    f"per-position [{per_pos}]")
    print(summary + "]")
    return 0


def _add_train_drafter(sub) -> None:
    from specdecode.train.drafter import DrafterTrainConfig

    p = sub.add_parser("train-drafter", help="train a drafter for a target model (default: the embedded model)",
                       description="Train a drafter against the target's own distribution (soft labels computed "
                       "on the fly on the stdlib corpus), then export it in HF layout next to the target. Each "
                       "shipped drafter's training_report.json names the command that trained it.")
    _add_config_flags(p, DrafterTrainConfig, {"out_dir": "out", "num_layers": "layers"})  # the flags' older names
    p.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt")
    p.set_defaults(func=_run_train_drafter)


def _run_train_drafter(args) -> int:
    import json

    from specdecode.train.drafter import DrafterTrainConfig, train_drafter

    print(json.dumps(train_drafter(_config_from_args(DrafterTrainConfig, args), resume=args.resume), indent=2))
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark methods side by side (speedup vs plain decoding in the same run)",
                       description="Run plain decoding and each speculative method on the same model and prompts, "
                       "write results.json and results.md to --out, and print the table.")
    p.add_argument("--methods", default="none,ngram,draft_model",
                   help="comma-separated: none, a method name, name:k=4:prompt_lookup_max=3, or a JSON object")
    p.add_argument("--prompts", default="humaneval", help="humaneval, mtbench, or a JSONL file with a 'prompt' field per line")
    p.add_argument("--repeats", type=int, default=1,
                   help="measured runs per configuration, tokens/s from the median (short runs are noisy); "
                        "the runs of all methods are interleaved, so machine slowdowns hit every method alike")
    p.add_argument("--num-prompts", type=int, default=20, help="first N prompts of the set (0 = all)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (EOS ignored: equal work)")
    p.add_argument("--concurrency", default="1", help="comma-separated batch sizes, e.g. 1,4,16")
    p.add_argument("--sampling", type=_json_object, default={}, metavar="JSON",
                   help='more SamplingParams fields for every request (every method alike), e.g. \'{"logprobs": 5}\', '
                        '\'{"frequency_penalty": 0.5}\' or \'{"structured_outputs": {"json": {"type": "object"}}}\'')
    p.add_argument("--temperature", default="0", help="comma-separated temperatures, e.g. 0,0.8")
    p.add_argument("--out", default="bench_out", help="directory for results.json and results.md")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default="", help="comma-separated peer engines run in the same process on the same checkpoint and prompts (batch 1, greedy): transformers, llama.cpp (needs llama-cpp-python and gguf: pip install -e .[peers]), llama.cpp-bin (llama.cpp's own llama-bench, decode and prompt processing, and llama-speculative-simple from $SPECDECODE_LLAMA_CPP_BIN, at the weight precision matching --quantization: F16, Q8_0, Q4_0), vllm (vLLM plain and with each benchmarked ngram / draft_model / eagle3 config, same drafter and k, run by the Python of its own venv: $SPECDECODE_VLLM_PYTHON)")
    _add_model_args(p, speculative=False, exact=False)
    p.add_argument("--exact", default="off", metavar="off|on|off,on",
                   help="exact mode for every engine; off,on runs each method both ways, interleaved in one run, "
                   "so the cost of exact mode and its identity counts come side by side (default: off)")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from pathlib import Path

    from specdecode.bench.harness import BenchConfig, parse_methods, run_bench, markdown_table

    cfg = BenchConfig(methods=parse_methods(args.methods), model=args.model, prompts=args.prompts,
                      num_prompts=args.num_prompts or None, max_tokens=args.max_tokens,
                      concurrency=[int(c) for c in args.concurrency.split(",")],
                      temperatures=[float(t) for t in args.temperature.split(",")], dtype=args.dtype,
                      device=args.device, quantization=args.quantization, compile=args.compile,
                      verify_kernels=args.verify_kernels, kv_cache_dtype=args.kv_cache_dtype,
                      hf_overrides=args.hf_overrides, exact=[_on_off(v) for v in args.exact.split(",")], seed=args.seed,
                      out_dir=Path(args.out),
                      repeats=args.repeats,
                      peers=[p for p in args.peers.split(",") if p], sampling=args.sampling)
    print(markdown_table(run_bench(cfg)))
    return 0


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and speculative decoding",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
                       "Binds to 127.0.0.1 unless --host says otherwise. The API key comes from --api-key-file or "
                       "--api-key (visible in ps), else the SPECDECODE_API_KEY environment variable.")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded at once; more requests queue")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output bound (default: model context)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait beyond the --max-num-seqs running; more get 503 + Retry-After (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=2 * 2 ** 20,
                   help="largest request body accepted; larger ones get 413 (default 2 MiB)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="file holding the API key (surrounding whitespace ignored); required on every route but /health")
    key.add_argument("--api-key", default=None,
                     help="the API key itself; shows in ps and shell history: prefer --api-key-file or SPECDECODE_API_KEY")
    p.add_argument("--public-metrics", action="store_true",
                   help="with an API key: serve /metrics, /docs, /redoc and /openapi.json without it")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the model dir name)")
    p.set_defaults(func=_run_serve)


def _serve_api_key(args) -> str | None:
    """--api-key-file or --api-key (one of them), else SPECDECODE_API_KEY, else None (no key)."""
    import os

    from specdecode.errors import ConfigError

    if args.api_key_file is not None:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--api-key-file {args.api_key_file}: cannot be read ({e})") from None
        if not key:
            raise ConfigError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get("SPECDECODE_API_KEY", "").strip() or None


def _run_serve(args) -> int:
    from specdecode.server.serve import serve

    from specdecode.defaults import cli_speculative_config

    serve(args.host, args.port, model=args.model, speculative_config=cli_speculative_config(args.speculative_config, args.model),
          dtype=args.dtype, device=args.device, quantization=args.quantization, compile=args.compile,
          exact=args.exact, hf_overrides=args.hf_overrides, max_num_seqs=args.max_num_seqs,
          verify_kernels=args.verify_kernels, kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
          api_key=_serve_api_key(args), served_model_name=args.served_model_name, max_waiting=args.max_waiting,
          max_request_bytes=args.max_request_bytes, public_metrics=args.public_metrics)
    return 0


def _add_index_cache_search(sub) -> None:
    p = sub.add_parser(
        "index-cache-search", help="choose which DSA layers share top-k (IndexCache), on calibration text",
        description="Training-free IndexCache search (arXiv 2603.12201) for a DeepSeek-V3.2 / GLM-5 style model: "
        "from every layer full, greedily make shared the layer whose sharing raises the calibration LM loss "
        "least, down to --num-full full layers. Prints each step's pattern and loss, and the --hf-overrides "
        "that serves the result.")
    p.add_argument("--model", required=True, help="DSA checkpoint directory")
    p.add_argument("--num-full", type=int, default=None,
                   help="full layers to keep (default: a quarter of the layers, at least 1)")
    p.add_argument("--calibration-file", default=None,
                   help="text to calibrate on (default: the held-out files of the stdlib corpus)")
    p.add_argument("--windows", type=int, default=8, help="calibration windows (default 8)")
    p.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="default float32")
    p.set_defaults(func=_run_index_cache_search)


def _run_index_cache_search(args) -> int:
    import json

    import numpy as np
    import torch

    from specdecode.errors import ConfigError
    from specdecode.models.index_cache import greedy_search
    from specdecode.models.loader import load_model
    from specdecode.tokenizer import Tokenizer

    model = load_model(args.model, getattr(torch, args.dtype))
    if not model.config.has_dsa:
        raise ConfigError(f"{args.model} has no DSA indexer (model_type {model.config.model_type}); IndexCache "
                          "applies to deepseek_v32 and glm_moe_dsa models")
    tok = Tokenizer(Path(args.model))
    if args.calibration_file:
        text = Path(args.calibration_file).read_text(errors="replace")
    else:
        from specdecode.train import corpus

        text = "\n".join(f.text for f in corpus.split_files(corpus.iter_stdlib_files())[1])
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    n = args.context + 1
    if len(ids) < n:
        raise ConfigError(f"the calibration text has {len(ids)} tokens; a window needs {n}")
    starts = np.linspace(0, len(ids) - n, args.windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([ids[s: s + n] for s in starts]))
    L = model.config.num_hidden_layers
    steps = greedy_search(model, windows, args.num_full or max(1, L // 4))
    for step in steps:
        print(f"{step.pattern}  loss {step.loss:.4f}  ({100 * (step.loss / steps[0].loss - 1):+.2f}%)")
    print(json.dumps({"steps": [{"pattern": s.pattern, "loss": s.loss} for s in steps],
                      "hf_overrides": {"index_topk_pattern": steps[-1].pattern}}))
    return 0


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure the target's step time vs forward size (the cost model)",
                       description="Time target forwards of B sequences x n new tokens (thorough grid), cache the "
                       "result for this model/dtype/device (auto-k and D-Cut read it) and plot it.")
    _add_model_args(p, speculative=False)
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest batch size profiled")
    p.add_argument("--max-tokens-per-seq", type=int, default=9, help="largest verify width profiled (k + 1)")
    p.add_argument("--plot", default="cost_model.png", help="where to write the plot (PNG)")
    p.add_argument("--reprobe-kernels", action="store_true",
                   help="measure again which kernel serves each layer shape at each width (few-row and dense-copy "
                   "choices, cached per CPU and thread count at the first start): do this when that start ran "
                   "while the machine was busy, or after changing the machine's load for good")
    p.set_defaults(func=_run_profile)


def _run_profile(args) -> int:
    from specdecode import LLM
    from specdecode.models import kernel_probe
    from specdecode.speculative.policy.cost_model import load_or_profile, plot

    if args.reprobe_kernels:
        deleted = kernel_probe.forget_choices()
        print(f"kernel choices forgotten ({len(deleted)} cache file(s)): measuring them again while loading")
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
              compile=args.compile, exact=args.exact, hf_overrides=args.hf_overrides, max_num_seqs=args.max_num_seqs,
              verify_kernels=args.verify_kernels, kv_cache_dtype=args.kv_cache_dtype)
    if args.reprobe_kernels:
        print("kernel choices (layer shape and kernel: the most rows it serves, or the width a dense copy takes "
              "over from; none: never faster):")
        for key, value in sorted(kernel_probe.load_choices().items()):
            print(f"  {key}: {value if value is not None else 'none'}")
    model = load_or_profile(llm.runner, llm.config.model, args.max_num_seqs, args.max_tokens_per_seq, thorough=True)
    widths = sorted(next(iter(model.table.values())))
    print("ms per target forward; rows: batch size, columns: new tokens per sequence")
    print("B \\ n " + " ".join(f"{n:>8}" for n in widths))
    for B, row in sorted(model.table.items()):
        print(f"{B:>6} " + " ".join(f"{row[n] * 1000:8.2f}" for n in widths))
    try:
        plot(model, Path(args.plot))
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a model or drafter in another engine's checkpoint layout",
                       description="--format speculators: an EAGLE-3 drafter in the speculators / vLLM layout "
                       "(LlamaForCausalLMEagle3 config, fc / layers.0.* / norm / lm_head / d2t / t2d). "
                       "--format gguf: a Llama-family model (the default model, a draft model) as one GGUF "
                       "file for llama.cpp (needs the gguf package: pip install -e .[export]).")
    p.add_argument("--format", required=True, choices=["speculators", "gguf"])
    p.add_argument("--drafter", default=None, help="speculators: the EAGLE-3 drafter directory to export")
    p.add_argument("--model", default=None, help="gguf: the model directory (default: the embedded model)")
    p.add_argument("--gguf-type", default="f16", choices=["f16", "f32"], help="gguf: weight type (norms stay f32)")
    p.add_argument("--target", default=None, help="speculators: the drafter's target model (default: the embedded model)")
    p.add_argument("--out", required=True, help="output directory (speculators) or .gguf file (gguf)")
    p.set_defaults(func=_run_export)


def _add_token_frequencies(sub) -> None:
    p = sub.add_parser("token-frequencies", help="count a corpus's tokens (FR-Spec's reduced draft vocabulary)",
                       description="Write the token counts that speculative_config.draft_vocab_size ranks tokens by "
                       "(drafters then score only the N most frequent). Default corpus: the training split of the "
                       "stdlib corpus the default model was trained on. The engine reads token_frequencies.json "
                       "beside the target's weights unless draft_vocab_frequencies names another file.")
    p.add_argument("--model", default=None, help="the target model directory (its tokenizer; default: the embedded model)")
    p.add_argument("--data", nargs="*", default=None, help="text files to count (default: the stdlib training split)")
    p.add_argument("--out", required=True, help="the JSON file to write (e.g. <model>/token_frequencies.json)")
    p.set_defaults(func=_run_token_frequencies)


def _run_token_frequencies(args) -> int:
    from specdecode.defaults import default_model_dir
    from specdecode.train.token_frequencies import write_frequencies

    data = write_frequencies(Path(args.model) if args.model else default_model_dir(), Path(args.out),
                             [Path(f) for f in args.data] if args.data else None)
    print(f"wrote {args.out}: {data['num_tokens']:,} tokens of {data['source']}, vocabulary {data['vocab_size']}")
    return 0


def _run_export(args) -> int:
    import torch

    from specdecode.defaults import default_model_dir
    from specdecode.errors import ConfigError

    if args.format == "gguf":
        from specdecode.interop.gguf import export_gguf

        export_gguf(Path(args.model) if args.model else default_model_dir(), Path(args.out), args.gguf_type)
    else:
        from specdecode.interop.speculators import export_speculators
        from specdecode.speculative.propose.drafters.eagle.checkpoint import load_drafter

        if args.drafter is None:
            raise ConfigError("--format speculators needs --drafter DIR (an EAGLE-3 drafter)")
        drafter = load_drafter(Path(args.drafter), torch.float32, "cpu")
        export_speculators(drafter, Path(args.target) if args.target else default_model_dir(), Path(args.out))
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_train_target(sub)
    _add_index_cache_search(sub)
    _add_train_drafter(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_profile(sub)
    _add_export(sub)
    _add_token_frequencies(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from specdecode.errors import SpecDecodeError

    try:
        return args.func(args)
    except SpecDecodeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
