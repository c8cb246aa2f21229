"""`specdecode train-target` on a tiny corpus: an interrupted run resumed with --resume ends
bit for bit where an uninterrupted run ends; the export is the HF folder; the CLI's defaults
are the config's."""

import dataclasses
import itertools
import json
import shutil

import pytest
import torch
from helpers import TEXT, Interrupted, interrupt_after
from safetensors.torch import load_file

from specdecode.cli import build_parser
from specdecode.train import corpus
from specdecode.train.pretrain import PretrainConfig, train


@pytest.fixture()
def tiny_corpus(monkeypatch):
    """Four small 'stdlib' files, one of them in the validation split (chosen by its path hash)."""
    val_name = next(f"v{i}.py" for i in itertools.count() if corpus.is_validation(f"v{i}.py"))
    train_names = [n for n in (f"t{i}.py" for i in range(20)) if not corpus.is_validation(n)][:3]
    files = [corpus.SourceFile(n, TEXT.replace("Stack", f"Stack{i}") * 2) for i, n in enumerate(train_names)]
    files.append(corpus.SourceFile(val_name, TEXT * 2))
    monkeypatch.setattr(corpus, "iter_stdlib_files", lambda root=None: list(files))


def tiny_config(tmp_path, name: str, **overrides) -> PretrainConfig:
    kw = dict(out_dir=tmp_path / name / "out", work_dir=tmp_path / name / "work", vocab_size=320, hidden_size=32,
              intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, context=32, batch_size=2,
              max_steps=6, warmup_steps=2, eval_batches=2, checkpoint_minutes=0.0, device="cpu")
    return PretrainConfig(**{**kw, **overrides})


def test_interrupted_and_resumed_equals_uninterrupted(tiny_corpus, tmp_path, monkeypatch):
    straight = tiny_config(tmp_path, "straight")
    report = train(straight)
    assert report["steps"] == 6 and report["tokens_seen"] == 6 * 2 * 32

    resumed = tiny_config(tmp_path, "resumed")
    resumed.work_dir.mkdir(parents=True)
    for name in ("tokenizer", "tokens.npz"):  # the same tokenizer and token cache as the straight run
        copy = shutil.copytree if (straight.work_dir / name).is_dir() else shutil.copy
        copy(straight.work_dir / name, resumed.work_dir / name)
    with monkeypatch.context() as m:
        interrupt_after(m, 3)  # half way: the cosine schedule (max_steps 6) is the same in both runs
        with pytest.raises(Interrupted):
            train(resumed)
    assert torch.load(resumed.work_dir / "checkpoint.pt", weights_only=True)["step"] == 3
    resumed_report = train(resumed, resume=True)

    assert resumed_report["steps"] == 6 and resumed_report["val_loss"] == report["val_loss"]
    a = torch.load(straight.work_dir / "checkpoint.pt", weights_only=True)
    b = torch.load(resumed.work_dir / "checkpoint.pt", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # float32 weights, bit for bit
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a["data_rng"], b["data_rng"])
    exported_a, exported_b = load_file(straight.out_dir / "model.safetensors"), load_file(resumed.out_dir / "model.safetensors")
    assert exported_a.keys() == exported_b.keys()
    assert all(torch.equal(exported_a[k], exported_b[k]) for k in exported_a)

    # The export: HF layout, bf16, the tied LM head not stored.
    assert sorted(p.name for p in straight.out_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "training_report.json"]
    assert "lm_head.weight" not in exported_a and all(v.dtype == torch.bfloat16 for v in exported_a.values())
    config = json.loads((straight.out_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] and "specdecode" not in config
    assert json.loads((straight.out_dir / "generation_config.json").read_text()) == {
        "eos_token_id": 0, "pad_token_id": 1, "do_sample": False}
    assert json.loads((straight.out_dir / "training_report.json").read_text())["steps"] == 6


def test_cli_defaults_are_the_config_defaults():
    parser = build_parser()
    from specdecode.cli import _config_from_args

    args = parser.parse_args(["train-target"])
    defaults = PretrainConfig()
    assert _config_from_args(PretrainConfig, args) == defaults
    # The shipped target (models/stdlib-code-22m) was built with these.
    assert (defaults.num_layers, defaults.max_steps, defaults.lr, defaults.warmup_steps) == (6, 1200, 1e-3, 50)
    args = parser.parse_args(["train-target", "--layers", "3", "--heads", "2", "--kv-heads", "1", "--out", "o",
                              "--work-dir", "w", "--max-steps", "7", "--lr", "0.01", "--resume"])
    assert (args.num_layers, args.num_heads, args.num_kv_heads, str(args.out_dir), str(args.work_dir),
            args.max_steps, args.lr, args.resume) == (3, 2, 1, "o", "w", 7, 0.01, True)


def test_cli_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-target", "--help"])
    text = capsys.readouterr().out
    for flag in ("--out", "--work-dir", "--layers", "--heads", "--kv-heads", "--max-steps", "--resume",
                 "--weight-decay", "--eval-batches"):
        assert flag in text
    assert "llama: 1200; deepseek_v32: 800" in text
    for f in dataclasses.fields(PretrainConfig):
        assert f.metadata.get("help"), f"{f.name} has no help"


def tiny_deepseek_config(tmp_path, name: str, **overrides):
    from specdecode.train.deepseek_target import DeepSeekPretrainConfig

    kw = dict(out_dir=tmp_path / name / "out", work_dir=tmp_path / name / "work", vocab_size=320, hidden_size=32,
              intermediate_size=64, num_layers=4, num_heads=2, num_kv_heads=2, context=32, batch_size=2,
              max_steps=6, warmup_steps=2, eval_batches=2, checkpoint_minutes=0.0, device="cpu", dtype="float32",
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
              num_experts=4, experts_per_token=2, moe_intermediate_size=16, index_topk=8, index_heads=2,
              index_head_dim=16, indexer_warmup_steps=3)
    return DeepSeekPretrainConfig(**{**kw, **overrides})


def test_deepseek_recipe_trains_resumes_and_exports_a_loadable_model(tiny_corpus, tmp_path, monkeypatch):
    """MLA + MoE + DSA + one MTP layer: losses fall, the indexer KL is trained, the export loads
    through LLM with its MTP layer, and an interrupted run resumes bit for bit (including the
    balancing bias and the dense-to-sparse switch at step 3)."""
    from specdecode.models.loader import load_model

    straight = tiny_deepseek_config(tmp_path, "straight")
    report = train(straight)
    for key in ("val_loss", "val_mtp_loss", "val_indexer_kl", "val_loss_dense_attention",
                "val_loss_index_cache_1/2", "val_loss_index_cache_1/4", "adjacent_layer_topk_overlap"):
        assert key in report, key
    assert report["index_cache_patterns"] == {"1/2": "FSFS", "1/4": "FSSS"}
    assert len(report["adjacent_layer_topk_overlap"]) == 3
    model = load_model(straight.out_dir, torch.float32)
    assert model.config.model_type == "deepseek_v32" and model.config.num_nextn_predict_layers == 1
    assert len(model.model.layers) == 5
    biases = [m.e_score_correction_bias for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases)  # balancing moved the routing bias

    resumed = tiny_deepseek_config(tmp_path, "resumed")
    resumed.work_dir.mkdir(parents=True)
    for name in ("tokenizer", "tokens.npz"):
        copy = shutil.copytree if (straight.work_dir / name).is_dir() else shutil.copy
        copy(straight.work_dir / name, resumed.work_dir / name)
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        with pytest.raises(Interrupted):
            train(resumed)
    resumed_report = train(resumed, resume=True)
    assert resumed_report["val_loss"] == report["val_loss"]
    assert resumed_report["val_mtp_loss"] == report["val_mtp_loss"]


def test_train_target_arch_flags(tmp_path):
    args = build_parser().parse_args(["train-target", "--arch", "deepseek_v32", "--index-topk", "64"])
    from specdecode.cli import _config_from_args
    from specdecode.train.deepseek_target import DeepSeekPretrainConfig

    cfg = _config_from_args(DeepSeekPretrainConfig, args)
    assert cfg.index_topk == 64 and cfg.hidden_size == DeepSeekPretrainConfig().hidden_size
    llama = _config_from_args(PretrainConfig, build_parser().parse_args(["train-target"]))
    assert llama == PretrainConfig()
    from specdecode.errors import ConfigError

    parsed = build_parser().parse_args(["train-target", "--index-topk", "64"])
    with pytest.raises(ConfigError, match="--index-topk"):
        parsed.func(parsed)
