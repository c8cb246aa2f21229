#!/usr/bin/env bash
# Speculation with the API's features on, against the same requests without them (issue: API
# completeness): JSON-schema decoding, logprobs, at batch 1 and concurrency 16, for n-gram,
# EAGLE-3 and MTP; plus the grammar engines' per-token mask cost. Run on a quiet machine.
#   bash benchmarks/api_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results/api
METHODS=none,ngram:k=4,eagle3:k=3,mtp:k=3,none
SCHEMA='{"type": "object", "properties": {"name": {"type": "string"}, "summary": {"type": "string"}, "code": {"type": "string"}}, "required": ["name", "summary", "code"], "additionalProperties": false}'
for c in 1 16; do
    common=(--methods "$METHODS" --num-prompts 16 --max-tokens 128 --concurrency "$c" --repeats 2)
    specdecode bench "${common[@]}" --out "$R/plain_c$c"
    specdecode bench "${common[@]}" --sampling "{\"structured_outputs\": {\"json\": $SCHEMA}}" --out "$R/json_c$c"
    specdecode bench "${common[@]}" --sampling '{"logprobs": 5}' --out "$R/logprobs_c$c"
done
mkdir -p benchmarks/results/structured
python benchmarks/grammar_engines.py --repeats 7 > benchmarks/results/structured/grammar_engines.json
