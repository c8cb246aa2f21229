#!/usr/bin/env bash
# Measure every benchmark of BENCHMARKS.md on this machine and regenerate it.
# Needs the bench extras: pip install -e ".[test,bench]"
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
mkdir -p "$R"
SPEC='specdecode bench --methods none,ngram:k=2,ngram:k=4,draft_model:k=2,draft_model:k=3,draft_model:k=5 --num-prompts 16 --max-tokens 128 --temperature 0,0.8 --concurrency 1 --peers transformers --out benchmarks/results/spec'
CONC='specdecode bench --methods none,draft_model:k=4,draft_model:k=4:draft_length_schedule=auto,draft_model:k=4:verify_pruning=dcut --num-prompts 64 --max-tokens 64 --concurrency 1,4,16,32,64 --out benchmarks/results/concurrency'
python - "$SPEC" "$CONC" <<'PY'
import json, sys
json.dump({"spec": sys.argv[1], "concurrency": sys.argv[2]}, open("benchmarks/results/commands.json", "w"), indent=2)
PY
python benchmarks/engine_bench.py --out "$R/engine.json"
eval "$SPEC"
eval "$CONC"
python -m specdecode.bench.loadgen --concurrency 1,4,16,64 --max-tokens 64 \
    --speculative-config '{"method": "draft_model", "num_speculative_tokens": 3}' --out "$R/serve"
python benchmarks/render.py
