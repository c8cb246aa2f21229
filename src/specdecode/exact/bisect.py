"""Per-op bisection: where does a token's computation differ between two ways of running it?

Exact mode promises that a token's logits are bitwise the same whether the target computes
it alone (plain decoding), as one of the k + 1 tokens of a verify forward, or next to other
sequences in a ragged batch. When they are not, this tool finds the first module whose output
row differs: it records every module's input and output (forward hooks) in a reference run,
one token per forward, and in a candidate run, all tokens in one forward, and compares them
row by row in execution order. The first differing module whose input still matched is the
op to make invariant.

    python -m specdecode.exact.bisect --dtype bfloat16 --width 8 --batch 3 [--quantization int8] [--exact]

Runs eager (module hooks do not see inside compiled graphs). Used by tests/test_exact.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch
from torch import nn

from specdecode.engine.ragged import ForwardEntry
from specdecode.engine.runner import Runner


@dataclasses.dataclass(slots=True)
class OpRecord:
    name: str  # module path, e.g. "model.layers.0.self_attn.o_proj"
    input: torch.Tensor | None  # [rows, features] the module's first tensor input, as token rows
    output: torch.Tensor  # [rows, features] its output (split views concatenated)


def _as_rows(value) -> torch.Tensor | None:
    """A module's input or output as token rows [B * T, features] (None when not a tensor)."""
    if isinstance(value, (tuple, list)):
        parts = [v for v in value if isinstance(v, torch.Tensor)]
        if not parts:
            return None
        value = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts], dim=-1)
    elif hasattr(value, "hidden"):  # ForwardOutput
        value = value.hidden
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    return value.detach().reshape(-1, value.shape[-1]).clone()


@contextlib.contextmanager
def record_ops(model: nn.Module):
    """Collect an OpRecord for every module call under `model` while the block runs."""
    records: list[OpRecord] = []
    handles = []

    def hook(name):
        def fn(module, args, output):
            out = _as_rows(output)
            if out is not None:
                records.append(OpRecord(name, _as_rows(args[0]) if args else None, out))
        return fn

    from specdecode.exact.rows import RowTiled

    inner = tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, RowTiled))
    for name, module in model.named_modules():
        if name and not (inner and name.startswith(inner)):  # a row-tiled layer is compared whole, not per chunk
            handles.append(module.register_forward_hook(hook(name)))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()


@dataclasses.dataclass(slots=True)
class Divergence:
    name: str  # first module whose output row differs
    input_matched: bool  # its input rows were identical: this module itself is the source
    rows: list[int]  # which compared tokens differ there
    max_abs_diff: float

    def __str__(self) -> str:
        where = "the op itself" if self.input_matched else "its input already differed"
        return f"{self.name}: tokens {self.rows} differ (max |diff| {self.max_abs_diff:.3g}); {where}"


def first_divergence(reference: list[list[OpRecord]], candidate: list[OpRecord],
                     candidate_rows: list[int]) -> Divergence | None:
    """reference[j]: the ops of token j computed alone (row 0); candidate: one forward holding
    token j at row candidate_rows[j]. Modules are matched by name and call order."""
    def aligned(records):
        seen: dict[str, int] = {}
        out = {}
        for r in records:
            n = seen.get(r.name, 0)
            seen[r.name] = n + 1
            out[(r.name, n)] = r
        return out

    refs = [aligned(r) for r in reference]
    for index, cand in enumerate(candidate):
        key = (cand.name, sum(1 for c in candidate[:index] if c.name == cand.name))
        differing, input_ok, worst = [], True, 0.0
        for j, row in enumerate(candidate_rows):
            ref = refs[j].get(key)
            if ref is None or ref.output.shape[-1] != cand.output.shape[-1] or row >= cand.output.shape[0]:
                continue
            if not torch.equal(ref.output[0], cand.output[row]):
                differing.append(j)
                worst = max(worst, (ref.output[0].float() - cand.output[row].float()).abs().max().item())
                if ref.input is not None and cand.input is not None and ref.input.shape[-1] == cand.input.shape[-1]:
                    input_ok = input_ok and torch.equal(ref.input[0], cand.input[row])
        if differing:
            return Divergence(cand.name, input_ok, differing, worst)
    return None


@dataclasses.dataclass(slots=True)
class BisectReport:
    divergence: Divergence | None  # None: every module agreed for every token
    logits_equal: bool  # the tokens' logits are bitwise equal
    kv_equal: bool  # the K/V the candidate forward wrote equals what one-token forwards wrote


def bisect_width(runner: Runner, prompt: list[int], tokens: list[int], others: list[list[int]] = ()) -> BisectReport:
    """Compare `tokens` (after `prompt`, in slot 0) decoded one per forward with the same tokens
    in one verify-shaped forward; `others` are prompts of other sequences (slots 1..) that share
    the candidate forward (a ragged batch: each brings its whole prompt)."""
    model = runner.model
    prefill = [ForwardEntry(0, prompt, start=0)] + [ForwardEntry(i + 1, p[:-1], start=0) for i, p in enumerate(others)]
    for entry in prefill:
        runner.forward([entry])
    n = len(prompt)
    reference, ref_logits = [], []
    for j, token in enumerate(tokens):
        with record_ops(model) as records:
            ref_logits.append(runner.forward([ForwardEntry(0, [token], start=n + j)]).logits[0, 0])
        reference.append(records)
    kv_ref = [(k[0, n:n + len(tokens)].clone(), v[0, n:n + len(tokens)].clone())
              for k, v in zip(runner.kv_cache.k, runner.kv_cache.v)]
    entries = [ForwardEntry(0, tokens, start=n, num_logits=len(tokens))]
    entries += [ForwardEntry(i + 1, p[-1:], start=len(p) - 1) for i, p in enumerate(others)]
    with record_ops(model) as candidate:
        logits = runner.forward(entries).logits[0, :len(tokens)]
    kv_equal = all(torch.equal(k[0, n:n + len(tokens)], rk) and torch.equal(v[0, n:n + len(tokens)], rv)
                   for k, v, (rk, rv) in zip(runner.kv_cache.k, runner.kv_cache.v, kv_ref))
    divergence = first_divergence(reference, candidate, list(range(len(tokens))))
    return BisectReport(divergence, torch.equal(torch.stack(ref_logits), logits), kv_equal)


def main(argv: list[str] | None = None) -> None:
    from specdecode.models.loader import load_model
    from specdecode.models.quant import QuantScheme
    from specdecode.defaults import default_model_dir
    from specdecode.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default=None, help="int8, int4, int4-g64, int4-g128")
    parser.add_argument("--width", type=int, default=8, help="tokens in the verify-shaped forward")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the candidate forward (1 = alone)")
    parser.add_argument("--exact", action="store_true", help="with exact mode's invariant kernels")
    args = parser.parse_args(argv)
    model_dir = args.model or default_model_dir()
    dtype = getattr(torch, args.dtype)
    quant = QuantScheme.parse(args.quantization) if args.quantization else None
    model = load_model(model_dir, dtype, "cpu", quant)
    if args.exact:
        from specdecode.exact.rows import make_rows_invariant

        make_rows_invariant(model, dtype, "cpu")
    runner = Runner(model, max(args.batch, 1), 512, dtype, torch.device("cpu"), quant, exact=args.exact)
    tok = Tokenizer(model_dir)
    text = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description="
    ids = tok.encode(text)
    prompt, tokens = ids[:-args.width], ids[-args.width:]
    others = [tok.encode("class Stack:\n" * (i + 1)) for i in range(args.batch - 1)]
    report = bisect_width(runner, prompt, tokens, others)
    print(f"logits equal: {report.logits_equal}; KV equal: {report.kv_equal}")
    print("first divergence:", report.divergence or "none")


if __name__ == "__main__":
    main()
