#!/usr/bin/env bash
# Measure every benchmark of BENCHMARKS.md on this machine and regenerate it.
#   bash benchmarks/run_all.sh                      # everything
#   bash benchmarks/run_all.sh spec concurrency     # only these sections (engine spec mtbench concurrency calibration serve exact qat deepseek api)
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
# Matched drafters (BENCHMARKS.md "Quantised targets and matched drafters"). The matched runs read the
# drafters trained by the commands listed there into runs/qat/ (the QAT ones are shipped under models/).
QAT_MISMATCH='python -m specdecode.bench.quant_quality --max-windows 120 | tee benchmarks/results/qat_mismatch/quant_quality.md; M=""; for m in draft_model:k=4 medusa:k=4 eagle:k=3 eagle3:k=3 mtp:k=3 dflash:k=4 dspark:k=4; do for dq in none int8 int4; do M="$M,$m:draft_quantization=$dq"; done; done; for q in none int8 int4-g32 int4-g128; do specdecode bench --methods "none$M,none" --quantization $q --num-prompts 8 --max-tokens 64 --repeats 2 --out benchmarks/results/qat_mismatch/$q; done'
QAT_MATCHED='M=""; for fam in eagle3 mtp; do B=models/stdlib-code-22m-$fam; C=runs/qat/$fam-control; MA=runs/qat/$fam-int4-g32; Q=models/stdlib-code-22m-$fam-int4-g32-qat; M="$M,$fam:k=3:model=$B:draft_quantization=none,$fam:k=3:model=$B,$fam:k=3:model=$C:draft_quantization=none,$fam:k=3:model=$MA:draft_quantization=none,$fam:k=3:model=$MA:draft_quantization=int4,$fam:k=3:model=$Q,$fam:k=3:model=$Q:draft_quantization=none"; done; for p in humaneval mtbench; do specdecode bench --prompts $p --methods "none$M,none" --quantization int4 --temperature 0,1 --num-prompts 8 --max-tokens 128 --repeats 2 --out benchmarks/results/qat_matched/$p; specdecode bench --prompts $p --methods none,eagle3:k=3,mtp:k=3 --temperature 0,1 --num-prompts 8 --max-tokens 128 --repeats 1 --out benchmarks/results/qat_matched/${p}_bf16; done'
# DeepSeek family (BENCHMARKS.md "DeepSeek family"): built-in MTP on the shipped DSA model, the
# IndexCache pattern search on it, and IndexCache speed on a random-weight V3.2-shaped model.
DS=models/stdlib-code-11m-dsv32
DEEPSEEK="for p in humaneval mtbench; do specdecode bench --model $DS --prompts \$p --methods none,mtp:k=1,mtp:k=2,mtp:k=3,mtp:k=3:tree_topk=2:tree_num_nodes=8,ngram:k=4,none --temperature 0,1 --num-prompts 8 --max-tokens 128 --repeats 2 --out benchmarks/results/deepseek/\$p; done; specdecode index-cache-search --model $DS --num-full 1 | tee benchmarks/results/deepseek/index_cache_search.txt; python benchmarks/index_cache_bench.py --out benchmarks/results/deepseek/index_cache_speed.json"
python - "$SPEC" "$MTBENCH" "$CONC" "$CALIB" "$EXACT" "$QAT_MISMATCH" "$QAT_MATCHED" "$DEEPSEEK" <<'PY'
import json, sys
keys = ["spec", "mtbench", "concurrency", "calibration", "exact", "qat_mismatch", "qat_matched", "deepseek"]
json.dump(dict(zip(keys, sys.argv[1:])), open("benchmarks/results/commands.json", "w"), indent=2)
PY
SECTIONS="${*:-engine spec mtbench concurrency calibration serve exact qat deepseek api}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
if want engine; then python benchmarks/engine_bench.py --out "$R/engine.json"; fi
if want spec; then eval "$SPEC"; fi
if want mtbench; then eval "$MTBENCH"; fi
if want concurrency; then eval "$CONC"; fi
if want calibration; then eval "$CALIB"; fi
if want exact; then eval "$EXACT"; fi
if want qat; then mkdir -p "$R/qat_mismatch"; eval "$QAT_MISMATCH"; eval "$QAT_MATCHED"; python benchmarks/qat_tables.py mismatch; python benchmarks/qat_tables.py matched; fi
if want deepseek; then mkdir -p "$R/deepseek"; eval "$DEEPSEEK"; fi
if want api; then bash benchmarks/api_bench.sh; fi
if want serve; then
    python -m specdecode.bench.loadgen --concurrency 1,4,16,64 --max-tokens 64 \
        --speculative-config '{"method": "draft_model", "num_speculative_tokens": 3}' --out "$R/serve"
fi
python benchmarks/render.py
