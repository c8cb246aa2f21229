"""Load generator for the OpenAI-compatible server: throughput and latency vs concurrency.

    python -m specdecode.bench.loadgen --concurrency 1,4,16,64 --out bench_out/serve
      [--speculative-config JSON ...]   # each config is served in turn, plus plain decoding

For each server configuration the harness starts `specdecode serve` in-process on a free
127.0.0.1 port, then for each concurrency c keeps c streaming requests in flight (c
asyncio workers over a shared prompt list) and records, per request, time to first token
and time per output token (from the streamed chunks), and overall output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from specdecode.bench.prompts import load_prompts
from specdecode.bench.report import pyplot, save
from specdecode.server.serve import BackgroundServer


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if "usage" in chunk:
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens, "e2e": end - start}


async def run_level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    queue = list(prompts)
    results = []

    async def worker(client):
        while queue:
            prompt = queue.pop()
            results.append(await one_request(client, prompt, max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, prompts[0], 4)  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - start
    return {
        "concurrency": concurrency, "requests": len(results), "wall_seconds": round(wall, 3),
        "output_tokens_per_second": round(sum(r["tokens"] for r in results) / wall, 2),
        "ttft_median_ms": round(statistics.median(r["ttft"] for r in results) * 1000, 2),
        "tpot_median_ms": round(statistics.median(r["tpot"] for r in results) * 1000, 2),
        "tpot_p90_ms": round(sorted(r["tpot"] for r in results)[int(0.9 * (len(results) - 1))] * 1000, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--speculative-config", action="append", default=[], help="served in turn after plain decoding")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="bench_out/serve")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    all_prompts = load_prompts("humaneval")
    configs = [None] + [json.loads(c) for c in args.speculative_config]
    rows = []
    for config in configs:
        server = BackgroundServer(model=args.model, speculative_config=config, dtype=args.dtype,
                                  max_num_seqs=max(levels), served_model_name="default", log_interval=1e9)
        url = server.url
        try:
            for c in levels:
                n = args.requests_per_level or max(8, 2 * c)
                prompts = [all_prompts[i % len(all_prompts)] for i in range(n)]
                row = {"config": config["method"] if config else "none", **asyncio.run(run_level(url, prompts, c, args.max_tokens))}
                print(row, flush=True)
                rows.append(row)
        finally:
            server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| server | concurrency | output tok/s | TTFT median (ms) | TPOT median (ms) | TPOT p90 (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['config']} | {r['concurrency']} | {r['output_tokens_per_second']:.1f} | {r['ttft_median_ms']:.0f} | "
              f"{r['tpot_median_ms']:.1f} | {r['tpot_p90_ms']:.1f} |" for r in rows]
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    _plot(rows, out / "serve_throughput.png")
    print("\n".join(lines))


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == name]
        a.plot([r["concurrency"] for r in sel], [r["output_tokens_per_second"] for r in sel], marker="o", label=name)
        b.plot([r["concurrency"] for r in sel], [r["tpot_median_ms"] for r in sel], marker="o", label=name)
    for ax, title in ((a, "output tokens/s"), (b, "median time per output token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.legend()
    save(fig, path)


if __name__ == "__main__":
    main()
