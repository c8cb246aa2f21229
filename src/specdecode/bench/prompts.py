"""Prompt sets for benchmarks: `humaneval` (164 code prompts), `mtbench` (80 MT-Bench first turns),
both shipped with their licenses in specdecode/data, or a JSONL file path (a `prompt` per line)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from specdecode.errors import ConfigError

BUILTIN = {"humaneval": "humaneval.jsonl", "mtbench": "mtbench.jsonl"}


def load_prompts(name_or_path: str, num_prompts: int | None = None) -> list[str]:
    """Prompts in file order; `num_prompts` keeps the first n (all when None)."""
    if name_or_path in BUILTIN:
        text = (resources.files("specdecode") / "data" / BUILTIN[name_or_path]).read_text()
        source = name_or_path
    else:
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"prompt set {name_or_path!r} is neither a built-in set ({', '.join(BUILTIN)}) nor a file")
        text, source = path.read_text(), str(path)
    prompts = []
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source} line {line_no} is not JSON: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ConfigError(f"{source} line {line_no}: each line must be an object with a string 'prompt' field")
        prompts.append(row["prompt"])
    if not prompts:
        raise ConfigError(f"{source} holds no prompts")
    return prompts[:num_prompts] if num_prompts else prompts
