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


def test_peers_timed_on_decode_only_are_compared_with_our_decode_rate():
    baseline = ({"tokens_per_second": 100.0, "decode_tokens_per_second": 125.0}, [])
    llama = {"method": "llama.cpp F16", "tokens": 128, "wall_seconds": 1.0, "outputs": None, "timing": "decode"}
    vllm = {"method": "vllm", "tokens": 128, "wall_seconds": 1.0, "outputs": None}
    assert harness.peer_record("llama.cpp-bin", llama, 0.0, 8, baseline)["speedup"] == pytest.approx(128 / 125)
    assert harness.peer_record("llama.cpp-bin", llama, 0.0, 8, baseline)["decode_tokens_per_second"] == 128
    assert harness.peer_record("vllm", vllm, 0.0, 8, baseline)["speedup"] == pytest.approx(128 / 100)


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


def test_a_peers_error_names_this_machines_paths_by_their_variables(tmp_path, monkeypatch):
    from specdecode.bench.harness import portable

    monkeypatch.setenv("SPECDECODE_LLAMA_CPP_BIN", str(tmp_path / "llama" / "bin"))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    error = (f"Command '['{tmp_path}/llama/bin/llama-bench', '-m', '{tmp_path}/cache/gguf/m-Q8_0.gguf']' "
             "died with <Signals.SIGSEGV: 11>.")
    assert portable(error) == ("Command '['$SPECDECODE_LLAMA_CPP_BIN/llama-bench', '-m', "
                               "'$SPECDECODE_CACHE/gguf/m-Q8_0.gguf']' died with <Signals.SIGSEGV: 11>.")
    assert portable("no path here") == "no path here"
