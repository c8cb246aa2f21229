"""The `--methods` list of `specdecode bench`: one `MethodSpec` per method, checked when parsed."""

from __future__ import annotations

import dataclasses
import json

from specdecode.errors import ConfigError
from specdecode.speculative.config import SpeculativeConfig


@dataclasses.dataclass(slots=True)
class MethodSpec:
    label: str
    config: dict | None  # None = plain decoding

    @classmethod
    def parse(cls, text: str) -> "MethodSpec":
        """`none`, `ngram`, `draft_model:k=3`, `ngram:k=4:prompt_lookup_max=3` or a JSON object."""
        text = text.strip()
        if text == "none":
            return cls("none", None)
        if text.startswith("{"):
            config = json.loads(text)
            label = config.get("method", "?") + "".join(f" {k}={v}" for k, v in config.items() if k != "method")
            SpeculativeConfig.parse(config)
            return cls(label, config)
        name, _, args = text.partition(":")
        config: dict = {"method": name}
        for item in filter(None, args.split(":")):
            key, _, value = item.partition("=")
            key = {"k": "num_speculative_tokens"}.get(key, key)
            try:
                config[key] = json.loads(value)
            except json.JSONDecodeError:
                config[key] = value  # a bare string such as dcut
        SpeculativeConfig.parse(config)  # fail now, not after an hour of baseline
        return cls(text, config)


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated method specs; options of one method are separated by ':'."""
    parts, depth, current = [], 0, ""
    for ch in text:  # split on commas outside JSON braces
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    try:
        return [MethodSpec.parse(part) for part in parts if part.strip()]
    except json.JSONDecodeError as e:
        raise ConfigError(f"--methods: {e}") from None
