#!/usr/bin/env bash
# Measure every benchmark of BENCHMARKS.md on this machine and regenerate it.
#   bash benchmarks/run_all.sh                      # everything
#   bash benchmarks/run_all.sh spec concurrency     # only these sections (engine spec mtbench concurrency calibration serve exact)
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
EXACT="specdecode bench --methods none,ngram:k=8,draft_model:k=4,medusa:k=3,eagle:k=4,eagle3:k=4,eagle3:k=4:tree_topk=2,mtp:k=4,mtp:k=4:tree_topk=2,dflash:k=7,dspark:k=7,none --exact off,on --temperature 0,1 --num-prompts 8 --max-tokens 128 --repeats 3 --out benchmarks/results/exact && specdecode bench --methods none,ngram:k=8,draft_model:k=4,eagle3:k=4,eagle3:k=4:tree_topk=2,mtp:k=4,dspark:k=7,none --exact off,on --temperature 0,1 --num-prompts 8 --max-tokens 128 --repeats 2 --quantization int8 --out benchmarks/results/exact_int8 && specdecode bench --methods none,ngram:k=8,eagle3:k=4,mtp:k=4:tree_topk=2,none --exact off,on --temperature 0,1 --num-prompts 16 --max-tokens 64 --concurrency 4 --repeats 2 --out benchmarks/results/exact_c4"
python - "$SPEC" "$MTBENCH" "$CONC" "$CALIB" "$EXACT" <<'PY'
import json, sys
keys = ["spec", "mtbench", "concurrency", "calibration", "exact"]
json.dump(dict(zip(keys, sys.argv[1:])), open("benchmarks/results/commands.json", "w"), indent=2)
PY
SECTIONS="${*:-engine spec mtbench concurrency calibration serve exact}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
if want engine; then python benchmarks/engine_bench.py --out "$R/engine.json"; fi
if want spec; then eval "$SPEC"; fi
if want mtbench; then eval "$MTBENCH"; fi
if want concurrency; then eval "$CONC"; fi
if want calibration; then eval "$CALIB"; fi
if want exact; then eval "$EXACT"; fi
if want serve; then
    python -m specdecode.bench.loadgen --concurrency 1,4,16,64 --max-tokens 64 \
        --speculative-config '{"method": "draft_model", "num_speculative_tokens": 3}' --out "$R/serve"
fi
python benchmarks/render.py
