"""`specdecode train-drafter` end to end on a tiny target: train, interrupt, resume, export, serve;
the CLI's defaults are the config's."""

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import Interrupted, interrupt_after
from safetensors.torch import load_file

from specdecode import LLM, SamplingParams
from specdecode.cli import build_parser
from specdecode.train.drafter import DrafterTrainConfig, train_drafter


@pytest.mark.parametrize("method, extra", [("eagle3", {"draft_vocab_size": 128}), ("medusa", {}),
                                           ("dspark", {"block_size": 4, "dflash_layers": 1, "markov_rank": 8})])
def test_train_resume_export_and_serve(native_model, work_dir, tmp_path, monkeypatch, method, extra):
    out = tmp_path / "drafter"
    common = dict(method=method, target=native_model, batch_size=2, context=48, eval_windows=2, warmup_steps=1,
                  seed=0, max_steps=4, checkpoint_minutes=0.0, **extra)
    straight_work = tmp_path / "straight-work"
    shutil.copytree(work_dir, straight_work)
    straight = train_drafter(DrafterTrainConfig(out_dir=tmp_path / "straight", work_dir=straight_work, **common))

    with monkeypatch.context() as m:
        interrupt_after(m, 2)  # half way, same max_steps: the same cosine schedule as the straight run
        with pytest.raises(Interrupted):
            train_drafter(DrafterTrainConfig(out_dir=out, work_dir=work_dir, **common))
    assert torch.load(work_dir / "checkpoint.pt", weights_only=True)["step"] == 2
    report = train_drafter(DrafterTrainConfig(out_dir=out, work_dir=work_dir, **common), resume=True)
    assert report["steps"] == 4 and report["tokens_seen"] == 4 * 2 * 48  # continued, not restarted
    assert 0.0 <= report["val_top1_agreement"] <= 1.0 and report["before_training"] is None  # resumed run

    # Bit for bit the uninterrupted run (DSpark: the same random anchors too).
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa = torch.load(straight_work / "checkpoint.pt", weights_only=True)["model"]
    sb = torch.load(work_dir / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for key in ("val_top1_agreement", "val_one_minus_tv", "val_kl", "confidence_temperatures"):
        assert report.get(key) == straight.get(key)

    config = json.loads((out / "config.json").read_text())
    assert config["specdecode"]["method"] == method and config["specdecode"]["target"] == native_model.name
    assert json.loads((out / "training_report.json").read_text())["steps"] == 4
    if method == "dspark":
        assert len(report["confidence_temperatures"]) == 3  # calibrated per draft position
    llm = LLM(native_model, dtype="float32", speculative_config={"method": method, "model": str(out),
                                                                 "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(native_model, dtype="float32").generate([{"prompt_token_ids": [5, 17, 99]}], params)
    assert llm.generate([{"prompt_token_ids": [5, 17, 99]}], params)[0].token_ids == plain[0].token_ids


def test_cli_defaults_are_the_config_defaults(native_model):
    parser = build_parser()
    args = parser.parse_args(["train-drafter", "--method", "eagle", "--target", str(native_model)])
    from_cli = DrafterTrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DrafterTrainConfig)})
    assert from_cli == DrafterTrainConfig(method="eagle", target=native_model)
    assert from_cli.out_dir == native_model.parent / f"{native_model.name}-eagle"
    assert str(from_cli.work_dir) == "runs/train-drafter-eagle"
    assert DrafterTrainConfig(method="draft_model", target=native_model).out_dir.name == f"{native_model.name}-draft"
    args = parser.parse_args(["train-drafter", "--method", "draft_model", "--layers", "3", "--out", "o",
                              "--work-dir", "w", "--block-size", "16", "--data", "generated", "--resume"])
    assert (args.num_layers, str(args.out_dir), str(args.work_dir), args.block_size, args.data, args.resume) == (
        3, "o", "w", 16, "generated", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["train-drafter"])  # --method is required

