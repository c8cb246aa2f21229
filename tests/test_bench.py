"""The benchmark harness on a tiny model: records, tables, plots, peers, method specs."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdecode.bench import harness, methods, report, timing
from specdecode.bench.harness import BenchConfig, run_bench
from specdecode.bench.methods import MethodSpec, parse_methods
from specdecode.bench.timing import measure_interleaved, rounds_of, speedup_interval
from specdecode.config import EngineConfig
from specdecode.errors import ConfigError


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def fibonacci(n):", "class Stack:", "import os"]) + "\n")
    return path


def test_methods_parse_and_fail_early():
    specs = parse_methods('none,ngram:k=4:prompt_lookup_max=3,{"method": "draft_model", "num_speculative_tokens": 2}')
    assert [s.config for s in specs] == [None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                                         {"method": "draft_model", "num_speculative_tokens": 2}]
    assert MethodSpec.parse("draft_model:k=4:verify_pruning=dcut").config["verify_pruning"] == "dcut"
    with pytest.raises(ConfigError):
        parse_methods("nonsense:k=2")
    with pytest.raises(ConfigError, match="--peers sglang"):
        BenchConfig(methods=specs, peers=["sglang"])


def test_run_bench_records_everything(native_model, native_drafter, prompt_file, tmp_path):
    out = tmp_path / "out"
    methods = parse_methods(f"ngram:k=2,draft_model:k=2:model={native_drafter}")
    result = run_bench(BenchConfig(methods=methods, model=str(native_model), prompts=str(prompt_file), num_prompts=3,
                                   max_tokens=8, concurrency=[1, 2], temperatures=[0.0, 1.0], dtype="float32",
                                   out_dir=out))
    runs = result["runs"]
    assert len(runs) == 2 * 2 * 3  # temperatures x concurrency x (baseline + 2 methods)
    assert result["machine"]["dtype"] == "float32" and result["num_prompts"] == 3
    for r in runs:
        assert r["output_tokens"] == 3 * 8 and r["tokens_per_second"] > 0
        # Batch 1: the decode rate leaves the prefill and first token out; batched requests overlap, so none.
        assert (r["decode_tokens_per_second"] > 0) if r["concurrency"] == 1 else "decode_tokens_per_second" not in r
        # Prompt processing: the plain engine's, at batch 1 only (a speculative engine's first step is the same).
        assert (r["prefill_tokens_per_second"] > 0) if r["concurrency"] == 1 and r["method"] == "none" else (
            "prefill_tokens_per_second" not in r)
        if r["method"] == "none":
            assert r["speedup"] == 1.0
        else:
            assert 0 <= r["acceptance_rate"] <= 1 and r["mean_acceptance_length"] >= 1
            assert len(r["per_position_acceptance"]) <= 2 and r["num_draft_tokens"] >= r["num_accepted_tokens"]
        if r["temperature"] == 0:
            assert r["outputs_equal_to_plain"] == "3/3"  # float32: lossless means identical
    assert json.loads((out / "results.json").read_text()) == result
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == 2 + len(runs) and "ngram:k=2" in table  # header, rule, one row per run
    if importlib.util.find_spec("matplotlib"):
        assert (out / "speedup.png").is_file() and (out / "speedup_vs_concurrency.png").is_file()


def test_run_bench_with_exact_off_and_on_in_one_run(native_model, native_drafter, prompt_file, tmp_path):
    methods = parse_methods(f"ngram:k=2,draft_model:k=2:model={native_drafter}")
    result = run_bench(BenchConfig(methods=methods, model=str(native_model), prompts=str(prompt_file), num_prompts=3,
                                   max_tokens=8, concurrency=[2], temperatures=[0.0, 1.0], dtype="float32",
                                   exact=[False, True], out_dir=tmp_path / "out"))
    runs = result["runs"]
    assert len(runs) == 2 * 2 * 3  # temperatures x exact modes x (baseline + 2 methods)
    assert result["machine"]["exact"] is False  # the first engine's
    for r in runs:
        if r["exact"]:  # greedy and seeded sampling alike: exact mode reproduces its plain decoding
            assert r["outputs_equal_to_plain"] == "3/3"
        if r["exact"] and r["method"] == "none":
            assert r["vs_exact_off"] > 0 and len(r["vs_exact_off_interval"]) == 2
    assert "| ngram:k=2 | on |" in (tmp_path / "out" / "results.md").read_text()
    with pytest.raises(ConfigError, match="exact modes"):
        BenchConfig(methods=methods, exact=[True, True])


def test_harness_keeps_the_names_it_had():
    """cli.py and older scripts import these from specdecode.bench.harness: the same objects."""
    for module, names in [(methods, ["MethodSpec", "parse_methods"]), (report, ["markdown_table", "write_plots"]),
                          (timing, ["ROUND_PROMPTS", "Measured", "rounds_of", "measure_interleaved", "speedup_interval"])]:
        for name in names:
            assert getattr(harness, name) is getattr(module, name), name


def test_repeats_and_rounds_are_timed_and_paired(native_model, prompt_file, tmp_path, monkeypatch):
    calls = []

    def spy(baseline, method, **kwargs):  # the unrounded round times run_bench resamples
        calls.append((list(baseline), list(method)))
        return speedup_interval(baseline, method, **kwargs)

    monkeypatch.setattr(harness, "speedup_interval", spy)
    result = run_bench(BenchConfig(methods=parse_methods("ngram:k=2"), model=str(native_model), prompts=str(prompt_file),
                                   num_prompts=2, max_tokens=4, dtype="float32", repeats=3, out_dir=tmp_path))
    plain, ngram = result["runs"]
    for r in result["runs"]:
        assert len(r["round_seconds"]) == 3 and r["wall_seconds"] == pytest.approx(sum(r["round_seconds"]) / 3, abs=1e-3)
    # The interval resamples the two engines' own rounds, paired in the order they ran ...
    [(baseline, method)] = calls
    assert [round(w, 4) for w in baseline] == plain["round_seconds"]
    assert [round(w, 4) for w in method] == ngram["round_seconds"]
    lo, hi = speedup_interval(baseline, method)
    assert ngram["speedup_interval"] == [round(lo, 3), round(hi, 3)]
    # ... so both ends are ratios of paired sums: weighted means of the per-round ratios. (The
    # observed ratio of sums is not asserted inside: a percentile interval does not promise it,
    # and the recorded rounds and interval are rounded.)
    ratios = [b / m for b, m in zip(baseline, method)]
    assert min(ratios) * (1 - 1e-12) <= lo <= hi <= max(ratios) * (1 + 1e-12)
    with pytest.raises(ConfigError, match="--repeats 0"):
        BenchConfig(methods=[], repeats=0)


def test_speedup_interval_resamples_rounds_in_pairs():
    # Every round 2x faster, rounds of very different lengths: any resample of whole pairs is
    # exactly 2; resampling baseline and method rounds apart, or pairing a round's baseline
    # with another round's method time, spreads the interval far from 2.
    method = [0.1, 3.0, 0.4, 12.0, 0.7]
    assert speedup_interval([2 * m for m in method], method) == pytest.approx((2.0, 2.0), rel=1e-12)
    # Per-round ratios 2, 1 and 0.5: a 90% interval strictly inside [0.5, 2] (each all-one-round
    # resample is 1/27 of them), not a single point.
    lo, hi = speedup_interval([1.0, 10.0, 100.0], [0.5, 10.0, 200.0])
    assert 0.5 < lo < hi < 2.0


def test_speedup_interval_lies_within_the_per_round_ratios():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    times = st.floats(1e-3, 1e3, allow_nan=False)

    @settings(max_examples=30, deadline=None)
    @given(st.lists(st.tuples(times, times), min_size=1, max_size=8))
    def check(rounds):
        baseline, method = [b for b, _ in rounds], [m for _, m in rounds]
        lo, hi = speedup_interval(baseline, method)
        ratios = [b / m for b, m in rounds]
        assert min(ratios) * (1 - 1e-12) <= lo <= hi <= max(ratios) * (1 + 1e-12)

    check()


def test_a_second_none_is_a_control_engine(native_model, prompt_file, tmp_path):
    result = run_bench(BenchConfig(methods=parse_methods("none,ngram:k=2,none"), model=str(native_model),
                                   prompts=str(prompt_file), num_prompts=2, max_tokens=4, dtype="float32", out_dir=tmp_path))
    labels = [r["method"] for r in result["runs"]]
    assert labels == ["none", "ngram:k=2", "none (second engine)"]
    control = result["runs"][2]
    assert control["num_draft_tokens"] == 0 and control["outputs_equal_to_plain"] == "2/2" and "speedup_interval" in control


def test_rounds_are_whole_batches():
    assert [len(r) for r in rounds_of(64, 1)] == [8] * 8
    assert [len(r) for r in rounds_of(64, 16)] == [16] * 4
    assert [len(r) for r in rounds_of(20, 64)] == [20]
    assert [len(r) for r in rounds_of(20, 3)] == [9, 9, 2]
    assert speedup_interval([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == (2.0, 2.0)


def test_repeats_are_interleaved_across_methods():
    """Each round runs every method once, starting one later each round: a slow phase of the
    machine never falls on one method's runs only."""
    log = []

    class Engine:
        def __init__(self, name):
            self.name, self.stats = name, None
            self.config = EngineConfig(model="m")  # eager: one warm-up

        def generate(self, prompts, params):
            log.append(self.name)
            metrics = SimpleNamespace(time_to_first_token=1.0, e2e_latency=3.0)
            return [SimpleNamespace(text=self.name, metrics=metrics)]

    engines = [Engine("a"), Engine("b"), Engine("c")]
    measured = measure_interleaved(engines, ["p"], [None], repeats=3)
    assert log[:6] == ["a", "a", "b", "b", "c", "c"]  # a warm-up and every prompt's prefill, each
    assert log[6:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(m.round_seconds) for m in measured] == [3, 3, 3]
    assert [[o.text for o in m.outputs] for m in measured] == [["a"], ["b"], ["c"]]
    # Each round's decode time: its requests' first-to-last-token seconds (here 3 - 1).
    assert all(m.decode_seconds == [2.0, 2.0, 2.0] for m in measured)


def test_peers_timed_on_one_phase_are_compared_with_our_rate_of_that_phase():
    baseline = ({"tokens_per_second": 100.0, "decode_tokens_per_second": 125.0, "prefill_tokens_per_second": 4000.0}, [])
    llama = {"method": "llama.cpp F16", "tokens": 128, "wall_seconds": 1.0, "outputs": None, "timing": "decode"}
    pp = {"method": "llama.cpp F16 pp", "tokens": 150, "wall_seconds": 0.05, "outputs": None, "timing": "prefill"}
    vllm = {"method": "vllm", "tokens": 128, "wall_seconds": 1.0, "outputs": None}
    assert harness.peer_record("llama.cpp-bin", llama, 0.0, 8, baseline)["speedup"] == pytest.approx(128 / 125)
    assert harness.peer_record("llama.cpp-bin", llama, 0.0, 8, baseline)["decode_tokens_per_second"] == 128
    record = harness.peer_record("llama.cpp-bin", pp, 0.0, 8, baseline)
    assert record["speedup"] == pytest.approx(3000 / 4000) and record["prefill_tokens_per_second"] == 3000
    assert "decode_tokens_per_second" not in record
    assert harness.peer_record("vllm", vllm, 0.0, 8, baseline)["speedup"] == pytest.approx(128 / 100)
    # Without our rate of that phase (a run whose baseline has none), the wall-time rate.
    assert harness.peer_record("llama.cpp-bin", pp, 0.0, 8, ({"tokens_per_second": 100.0}, []))["speedup"] == 30


def test_prefill_is_timed_in_interleaved_rounds_of_one_token_requests():
    """Every prompt as token ids for one token, engines interleaved, no warm-up; the rate is prompt tokens over
    the rounds' seconds, and a second plain engine carries its ratio to the first (the noise floor)."""
    log = []

    class Engine:
        def __init__(self, name):
            self.name, self.stats = name, None

        def generate(self, prompts, params):
            log.append((self.name, [p["prompt_token_ids"] for p in prompts], {sp.max_tokens for sp in params}))
            return [SimpleNamespace(metrics=SimpleNamespace(time_to_first_token=None, e2e_latency=None))] * len(prompts)

    ids = [[1, 2, 3]] * 9  # two rounds at batch 1: 8 prompts, then 1
    measured = timing.measure_prefill([Engine("a"), Engine("b")], ids, repeats=1)
    assert [name for name, _, _ in log] == ["a", "b", "b", "a"] * timing.PREFILL_PASSES
    assert [len(p) for _, p, _ in log[:4]] == [8, 8, 1, 1] and all(m == {1} for _, _, m in log)
    first = harness._prefill_fields([1.0, 2.0] * 2, ids, baselines := {}, exact=False)
    assert first == {"prefill_tokens_per_second": 2 * 27 / 6.0}
    second = harness._prefill_fields([0.5, 1.0] * 2, ids, baselines, exact=False)
    assert second["prefill_speedup"] == 2.0 and second["prefill_speedup_interval"] == [2.0, 2.0]
    assert len(measured) == 2 and all(len(m.round_seconds) == 2 * timing.PREFILL_PASSES for m in measured)


def test_the_vllm_peer_runs_the_same_drafters_and_k(native_model, trained_drafters, native_drafter, monkeypatch,
                                                     tmp_path):
    """vLLM itself is not installed in CI: the mapping of our configs to its speculative_config,
    the speculators export it reads and the driver's counter reading are what is tested."""
    from specdecode.bench import vllm_driver
    from specdecode.bench.peers import run_vllm, vllm_variants

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    configs = [{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4},
               {"method": "draft_model", "model": str(native_drafter), "num_speculative_tokens": 4},
               {"method": "eagle3", "model": str(trained_drafters["eagle3"]), "num_speculative_tokens": 3},
               {"method": "eagle3", "model": str(trained_drafters["eagle3"]), "num_speculative_tokens": 3,
                "tree_topk": 2},  # a tree: not the same method in vLLM
               {"method": "mtp", "model": str(trained_drafters["mtp"]), "num_speculative_tokens": 3}]
    variants = vllm_variants(native_model, configs, lambda method: None)
    assert [v["label"] for v in variants] == ["vllm", "vllm ngram k=8", "vllm draft_model k=4", "vllm eagle3 k=3"]
    assert variants[1]["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 8,
                                                 "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert variants[2]["speculative_config"]["model"] == str(native_drafter)
    exported = Path(variants[3]["speculative_config"]["model"])
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["speculators_model_type"] == "eagle3"
    assert vllm_variants(native_model, configs[2:3], lambda m: None)[1]["speculative_config"]["model"] == str(exported)

    class Metric:
        def __init__(self, name, value):
            self.name, self.value = name, value

    class FakeLLM:
        def get_metrics(self):
            return [Metric("vllm:spec_decode_num_drafts", 3), Metric("vllm:spec_decode_num_accepted_tokens", 5),
                    Metric("vllm:num_requests_running", 1)]

    assert vllm_driver.spec_counters(FakeLLM()) == {"vllm:spec_decode_num_drafts": 3.0,
                                                    "vllm:spec_decode_num_draft_tokens": 0.0,
                                                    "vllm:spec_decode_num_accepted_tokens": 5.0}
    monkeypatch.delenv("SPECDECODE_VLLM_PYTHON", raising=False)
    with pytest.raises(ImportError, match="SPECDECODE_VLLM_PYTHON"):
        run_vllm(native_model, configs, [[1, 2, 3]], 4, lambda m: None, torch.bfloat16)


def test_our_plain_engine_is_timed_again_after_the_peers(native_model, prompt_file, tmp_path, monkeypatch):
    import specdecode.bench.peers as peers

    row = {"method": "llama.cpp F16 (llama-bench tg4 @ d5)", "tokens": 4, "wall_seconds": 0.01, "outputs": None,
           "timing": "decode"}
    monkeypatch.setattr(peers, "run_llama_cpp_native", lambda *args: [row])
    cfg = dict(model=str(native_model), prompts=str(prompt_file), num_prompts=2, max_tokens=4, dtype="float32")
    result = run_bench(BenchConfig(methods=parse_methods("none"), peers=["llama.cpp-bin"], out_dir=tmp_path, **cfg))
    assert [r["method"] for r in result["runs"]] == ["none", row["method"], "none (after peers)"]
    after = result["runs"][2]
    assert after["outputs_equal_to_plain"] == "2/2" and after["decode_tokens_per_second"] > 0
    lo, hi = after["speedup_interval"]
    assert lo <= hi and after["speedup"] > 0
    # No peer row, nothing to bracket: no second timing.
    monkeypatch.setattr(peers, "run_llama_cpp_native", lambda *args: (_ for _ in ()).throw(RuntimeError("no bin")))
    result = run_bench(BenchConfig(methods=parse_methods("none"), peers=["llama.cpp-bin"], out_dir=tmp_path, **cfg))
    assert [r["method"] for r in result["runs"]] == ["none"] and "llama.cpp-bin" in result["peer_errors"]


def test_a_peers_error_names_this_machines_paths_by_their_variables(tmp_path, monkeypatch):
    from specdecode.bench.harness import portable

    monkeypatch.setenv("SPECDECODE_LLAMA_CPP_BIN", str(tmp_path / "llama" / "bin"))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    error = (f"Command '['{tmp_path}/llama/bin/llama-bench', '-m', '{tmp_path}/cache/gguf/m-Q8_0.gguf']' "
             "died with <Signals.SIGSEGV: 11>.")
    assert portable(error) == ("Command '['$SPECDECODE_LLAMA_CPP_BIN/llama-bench', '-m', "
                               "'$SPECDECODE_CACHE/gguf/m-Q8_0.gguf']' died with <Signals.SIGSEGV: 11>.")
    assert portable("no path here") == "no path here"


def test_llama_cpps_own_binaries_give_a_decode_a_prefill_and_a_speculative_row(native_model, tmp_path, monkeypatch):
    """`run_llama_cpp_native` against stand-ins for llama.cpp's binaries (the real ones are a benchmark
    peer, not a test dependency): llama-bench's decode at the prompts' mean depth and its prompt
    processing of the mean prompt length, each a row timed on that phase."""
    from specdecode.bench.peers import run_llama_cpp_native

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    (bin_dir / "llama-bench").write_text(
        f"#!/bin/sh\necho \"$@\" >> {calls}\n"
        'case " $* " in *" -n 0 "*) echo \'[{"avg_ts": 3000.0, "stddev_ts": 40.0}]\';; '
        '*) echo \'[{"avg_ts": 500.0, "stddev_ts": 7.0}]\';; esac\n')
    (bin_dir / "llama-speculative-simple").write_text(
        "#!/bin/sh\necho 'decoded 8 tokens in 0.02 seconds'\necho 'n_drafted = 10'\necho 'n_accept = 6'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("SPECDECODE_LLAMA_CPP_BIN", str(bin_dir))
    rows = run_llama_cpp_native(native_model, None, ["a", "b"], [[1, 2, 3], [4, 5, 6, 7, 8]], 8, 3, 2, None)
    decode, prefill, lookup = rows
    assert decode["method"] == "llama.cpp F16 (llama-bench tg8 @ d4)" and decode["timing"] == "decode"
    assert decode["tokens"] / decode["wall_seconds"] == pytest.approx(500.0) and decode["spread"] == "+-7 tok/s"
    assert prefill["method"] == "llama.cpp F16 (llama-bench pp4)" and prefill["timing"] == "prefill"
    assert prefill["tokens"] == 4 and prefill["tokens"] / prefill["wall_seconds"] == pytest.approx(3000.0)
    assert lookup["method"] == "llama.cpp F16 prompt-lookup k=3" and lookup["tokens"] == 16
    assert lookup["acceptance_rate"] == 0.6 and lookup["wall_seconds"] == pytest.approx(0.04)
    tg, pp = calls.read_text().splitlines()
    assert "-p 0 -n 8 -d 4" in tg and "-p 4 -n 0" in pp and "-d" not in pp.split()
