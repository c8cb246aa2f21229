"""The proposer registry: a method name -> its proposer class.

A method registers with `@register("name")`; the speculator builds whatever
`speculative_config.method` names and never branches on it. Importing
`specdecode.speculative.propose.builtin` registers the built-in methods.
"""

from __future__ import annotations

PROPOSERS: dict[str, type] = {}


def register(name: str):
    def wrap(cls):
        PROPOSERS[name] = cls
        cls.method_name = name
        return cls

    return wrap
