#!/usr/bin/env bash
# Measure every benchmark of BENCHMARKS.md on this machine and regenerate it.
#   bash benchmarks/run_all.sh                      # everything
#   bash benchmarks/run_all.sh spec concurrency     # only these sections (engine spec mtbench concurrency calibration serve)
# Needs the bench extras: pip install -e ".[test,bench,peers]"
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
mkdir -p "$R"
TREE=tree_topk=4:tree_num_nodes=24
SPEC="specdecode bench --methods none,ngram:k=4,ngram:k=8,draft_model:k=5,medusa:k=4,medusa:k=4:$TREE,eagle:k=5,eagle:k=5:$TREE,eagle3:k=3,eagle3:k=5,eagle3:k=5:$TREE,mtp:k=3,mtp:k=5,mtp:k=5:$TREE,dflash:k=7,dflash:k=15,dflash:k=7:$TREE,dspark:k=7,dspark:k=7:confidence_threshold=0.3 --num-prompts 16 --max-tokens 128 --temperature 0,1 --concurrency 1 --peers transformers,llama.cpp --out benchmarks/results/spec"
MTBENCH="specdecode bench --prompts mtbench --methods none,ngram:k=4,draft_model:k=5,eagle3:k=5,eagle3:k=5:$TREE,mtp:k=5,dflash:k=7,dspark:k=7 --num-prompts 16 --max-tokens 128 --out benchmarks/results/mtbench"
CONC='specdecode bench --methods none,draft_model:k=4,draft_model:k=4:draft_length_schedule=auto,draft_model:k=4:verify_pruning=dcut,eagle3:k=2,eagle3:k=4,eagle3:k=4:verify_pruning=dcut,none --num-prompts 64 --max-tokens 64 --concurrency 1,4,16,32,64 --repeats 4 --out benchmarks/results/concurrency'
CALIB='python benchmarks/dspark_calibration.py --out benchmarks/results/calibration'
python - "$SPEC" "$MTBENCH" "$CONC" "$CALIB" <<'PY'
import json, sys
keys = ["spec", "mtbench", "concurrency", "calibration"]
json.dump(dict(zip(keys, sys.argv[1:])), open("benchmarks/results/commands.json", "w"), indent=2)
PY
SECTIONS="${*:-engine spec mtbench concurrency calibration serve}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
if want engine; then python benchmarks/engine_bench.py --out "$R/engine.json"; fi
if want spec; then eval "$SPEC"; fi
if want mtbench; then eval "$MTBENCH"; fi
if want concurrency; then eval "$CONC"; fi
if want calibration; then eval "$CALIB"; fi
if want serve; then
    python -m specdecode.bench.loadgen --concurrency 1,4,16,64 --max-tokens 64 \
        --speculative-config '{"method": "draft_model", "num_speculative_tokens": 3}' --out "$R/serve"
fi
python benchmarks/render.py
