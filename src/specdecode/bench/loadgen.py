"""Load generator for the OpenAI-compatible server: throughput and latency vs concurrency,
and a soak test with random disconnects.

    python -m specdecode.bench.loadgen --concurrency 1,4,16,64 --out bench_out/serve
      [--speculative-config JSON ...]   # each config is served in turn, plus plain decoding

For each server configuration the harness starts `specdecode serve` in-process on a free
127.0.0.1 port, then for each concurrency c keeps c streaming requests in flight (c
asyncio workers over a shared prompt list) and records, per request, time to first token
and time per output token (from the streamed chunks), and overall output tokens/s.

    python -m specdecode.bench.loadgen --soak --clients 64 --duration 60 --out bench_out/soak
      [--disconnect-probability 0.2] [--speculative-config JSON] [--url URL --server-pid PID]

Soak: `--clients` streaming clients send requests back to back for `--duration` seconds; each
request goes away after a random number of chunks with the given probability. Recorded:
requests completed (finish_reason and [DONE]), errors (a non-200 answer, an error event, a
transport error, or a stream cut without [DONE]), disconnects, p50 / p99 of the time to first
token and of the time between streamed chunks, the server's queue gauges once idle, and the
server process's RSS (/proc/PID/status) before, at peak and after. The server is
`specdecode serve` in its own process on a free 127.0.0.1 port unless --url names a running
one (its output goes to server.log). Writes soak.json and soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
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


# ---- soak: many streaming clients, random disconnects ---------------------------------------

def rss_bytes(pid: int | None) -> int | None:
    """A process's resident set size (Linux /proc), or None where it cannot be read."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


async def soak_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                       leave_after: int | None) -> dict:
    """One streamed completion; `leave_after`: disconnect after that many content chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    chunks, finish, tokens, outcome, detail = 0, None, 0, "error", "stream cut without [DONE]"
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"outcome": "error", "detail": f"HTTP {r.status_code}: {r.text[:200]}", "gaps": []}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    if finish is not None:
                        outcome, detail = "completed", None
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    detail = f"error event: {chunk['error'].get('message')}"
                    continue
                tokens = chunk.get("usage", {}).get("completion_tokens", tokens)
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        first, last = first or now, now
                        chunks += 1
                if leave_after is not None and chunks >= leave_after and finish is None:
                    outcome, detail = "disconnected", None
                    break
    except httpx.HTTPError as e:
        detail = f"{type(e).__name__}: {e}"
    return {"outcome": outcome, "detail": detail, "ttft": None if first is None else first - start, "gaps": gaps,
            "tokens": tokens}


def _gauges(metrics_text: str) -> dict[str, float]:
    wanted = ("num_requests_running", "num_requests_waiting", "request_aborted_total", "request_failed_total")
    out = {}
    for line in metrics_text.splitlines():
        for name in wanted:
            if line.startswith(f"specdecode:{name}"):
                out[name] = out.get(name, 0) + int(float(line.split()[-1]))  # counts and gauges of requests
    return out


async def run_soak(url: str, prompts: list[str], clients: int, duration: float, disconnect_probability: float = 0.2,
                   max_tokens: tuple[int, int] = (16, 128), server_pid: int | None = None, seed: int = 0,
                   headers: dict | None = None) -> dict:
    """`clients` streaming clients for `duration` seconds against the server at `url` (see the
    module docstring); returns the summary row, with the per-request results under "results"."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await soak_request(client, model, prompts[0], 4, None)  # warm-up
        before = _gauges((await client.get("/metrics")).text)
        rss_before = peak = rss_bytes(server_pid)
        results: list[dict] = []
        deadline = time.perf_counter() + duration

        async def worker() -> None:
            while time.perf_counter() < deadline:
                n = rng.randint(*max_tokens)
                leave = rng.randint(1, max(1, n // 2)) if rng.random() < disconnect_probability else None
                results.append(await soak_request(client, model, rng.choice(prompts), n, leave))

        async def sample_rss() -> None:
            nonlocal peak
            while True:
                peak = max(filter(None, (peak, rss_bytes(server_pid))), default=None)
                await asyncio.sleep(0.5)

        sampler = asyncio.ensure_future(sample_rss())
        start = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(clients)])
        wall = time.perf_counter() - start
        settle = time.perf_counter() + 15  # the engine applies the last aborts between steps
        while True:
            after = _gauges((await client.get("/metrics")).text)
            if not (after.get("num_requests_running") or after.get("num_requests_waiting")) or time.perf_counter() > settle:
                break
            await asyncio.sleep(0.2)
        sampler.cancel()
    rss_after = rss_bytes(server_pid)
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    count = {k: sum(r["outcome"] == k for r in results) for k in ("completed", "error", "disconnected")}

    def ms(seconds):
        return None if seconds is None else round(seconds * 1000, 2)

    def mib(size):
        return None if size is None else round(size / 2 ** 20, 1)

    return {
        "clients": clients, "duration_seconds": round(wall, 2), "requests": len(results),
        "completed": count["completed"], "errors": count["error"], "disconnects": count["disconnected"],
        "output_tokens_per_second": round(sum(r["tokens"] for r in results if r["outcome"] == "completed") / wall, 1),
        "ttft_p50_ms": ms(percentile(ttft, 0.5)), "ttft_p99_ms": ms(percentile(ttft, 0.99)),
        "inter_chunk_p50_ms": ms(percentile(gaps, 0.5)), "inter_chunk_p99_ms": ms(percentile(gaps, 0.99)),
        "server_rss_before_mib": mib(rss_before), "server_rss_peak_mib": mib(peak), "server_rss_after_mib": mib(rss_after),
        "running_after": after.get("num_requests_running"), "waiting_after": after.get("num_requests_waiting"),
        "aborted_counted": after.get("request_aborted_total", 0) - before.get("request_aborted_total", 0),
        "failed_counted": after.get("request_failed_total", 0) - before.get("request_failed_total", 0),
        "error_examples": sorted({r["detail"] for r in results if r["outcome"] == "error"})[:5],
        "results": [{k: v for k, v in r.items() if k != "gaps"} for r in results],
    }


SOAK_COLUMNS = [("clients", "clients"), ("duration_seconds", "duration (s)"), ("requests", "requests"),
                ("completed", "completed"), ("errors", "errors"), ("disconnects", "disconnects"),
                ("output_tokens_per_second", "completed tok/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
                ("ttft_p99_ms", "TTFT p99 (ms)"), ("inter_chunk_p50_ms", "inter-chunk p50 (ms)"),
                ("inter_chunk_p99_ms", "inter-chunk p99 (ms)"), ("server_rss_before_mib", "RSS before (MiB)"),
                ("server_rss_peak_mib", "RSS peak (MiB)"), ("server_rss_after_mib", "RSS after (MiB)"),
                ("running_after", "running after"), ("aborted_counted", "aborted (metric)")]


def write_soak(row: dict, out: Path) -> str:
    """soak.json (with every request) and soak.md (the summary table); returns the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(row, indent=2) + "\n")
    table = "\n".join(["| " + " | ".join(title for _, title in SOAK_COLUMNS) + " |",
                       "| " + " | ".join("---" for _ in SOAK_COLUMNS) + " |",
                       "| " + " | ".join("-" if row[key] is None else str(row[key]) for key, _ in SOAK_COLUMNS) + " |"])
    if row["error_examples"]:
        table += "\n\nErrors, e.g.: " + "; ".join(row["error_examples"])
    (out / "soak.md").write_text(table + "\n")
    return table


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(log_dir: Path, model: str | None = None, dtype: str = "auto", max_num_seqs: int = 64,
                         speculative_config: str | None = None, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`specdecode serve` in its own process on a free 127.0.0.1 port, once /health answers;
    its output goes to log_dir/server.log."""
    port = _free_port()
    cmd = [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
           "--dtype", dtype, "--served-model-name", "default", *extra]
    if model:
        cmd += ["--model", model]
    if speculative_config:
        cmd += ["--speculative-config", speculative_config]
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "server.log", "wb") as log_file:  # the child keeps its own handle
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server_process(proc)
    raise RuntimeError(f"the server did not start ({log_dir}/server.log): {' '.join(cmd)}")


def stop_server_process(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def soak_main(args) -> None:
    prompts = load_prompts("humaneval")
    key = os.environ.get("SPECDECODE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    proc = None
    url, pid = args.url, args.server_pid
    if url is None:
        config = args.speculative_config[0] if args.speculative_config else None
        proc, url = start_server_process(Path(args.out), args.model, args.dtype, args.max_num_seqs, config)
        pid = proc.pid
    try:
        row = asyncio.run(run_soak(url, prompts, args.clients, args.duration, args.disconnect_probability,
                                   server_pid=pid, seed=args.seed, headers=headers))
    finally:
        if proc is not None:
            stop_server_process(proc)
    print(write_soak(row, Path(args.out)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--speculative-config", action="append", default=[],
                    help="served in turn after plain decoding (soak: the one served; default: serve's default)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, help="default: bench_out/serve, soak: bench_out/soak")
    soak = ap.add_argument_group("soak")
    soak.add_argument("--soak", action="store_true", help="run the soak test instead of the concurrency sweep")
    soak.add_argument("--clients", type=int, default=64)
    soak.add_argument("--duration", type=float, default=60.0, help="seconds")
    soak.add_argument("--disconnect-probability", type=float, default=0.2, help="share of requests that go away early")
    soak.add_argument("--max-num-seqs", type=int, default=64, help="the started server's --max-num-seqs")
    soak.add_argument("--url", default=None, help="a running server instead of starting one")
    soak.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for its RSS")
    soak.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.soak:
        args.out = args.out or "bench_out/soak"
        soak_main(args)
        return
    args.out = args.out or "bench_out/serve"
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
