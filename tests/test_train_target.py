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
    args = parser.parse_args(["train-target"])
    defaults = PretrainConfig()
    assert {f.name: getattr(args, f.name) for f in dataclasses.fields(PretrainConfig)} == dataclasses.asdict(defaults)
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
    assert "(default: 1200)" in text
    for f in dataclasses.fields(PretrainConfig):
        assert f.metadata.get("help"), f"{f.name} has no help"
