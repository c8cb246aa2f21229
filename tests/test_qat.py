"""Drafters matched to a quantised target: `train-drafter --target-quantization / --qat /
--init-from`, the provenance they record, and how serving picks, quantises and warns."""

import json
import logging
import shutil

import pytest
import torch
from helpers import Interrupted, interrupt_after
from safetensors.torch import load_file

from specdecode import LLM, SamplingParams
from specdecode.defaults import default_model_dir, models_dir
from specdecode.errors import ConfigError
from specdecode.kernels import gemm_a8_cpu
from specdecode.models.quant import QuantizedLinear, QuantScheme
from specdecode.speculative.config import SpeculativeConfig
from specdecode.train.drafter import DrafterTrainConfig, train_drafter
from specdecode.train.qat import FakeQuantLinear, enable_qat, fake_quantize

INT4 = QuantScheme.parse("int4")


@pytest.mark.parametrize("spec", ["int8", "int4", "int4-g128"])
def test_fake_quantize_is_the_served_weight_with_an_identity_gradient(spec):
    scheme = QuantScheme.parse(spec)
    weight = torch.randn(48, 256, requires_grad=True)
    fake = fake_quantize(weight, scheme)
    served = QuantizedLinear.from_weight(weight.detach().to(torch.bfloat16).float(), None, scheme)  # the bf16 checkpoint
    assert torch.equal(fake, served.dequantize())
    assert not torch.equal(fake, weight)  # rounding happened
    grad_out = torch.randn_like(fake)
    (fake * grad_out).sum().backward()
    assert torch.equal(weight.grad, grad_out)  # straight through


def test_enable_qat_converts_what_serving_quantises_and_leaves_the_target_alone():
    shared = torch.nn.Linear(64, 32)
    drafter = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 64), "odd": torch.nn.Linear(40, 64), "shared": shared})
    target = torch.nn.ModuleDict({"head": shared})
    assert enable_qat(drafter, INT4, exclude=(target,)) == ["a"]  # 40 is no multiple of the group: served as is
    assert type(drafter["a"]) is FakeQuantLinear and type(drafter["odd"]) is torch.nn.Linear and type(shared) is torch.nn.Linear
    assert list(drafter["a"].state_dict()) == ["weight", "bias"]  # checkpoints keep their names
    x = torch.randn(3, 64)
    served = QuantizedLinear.from_weight(drafter["a"].weight.detach().to(torch.bfloat16).float(), drafter["a"].bias, INT4)
    torch.testing.assert_close(drafter["a"](x), served(x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method, extra", [("mtp", {}), ("dflash", {"block_size": 4, "dflash_layers": 1}),
                                           ("draft_model", {"num_layers": 1, "intermediate_size": 64})])
def test_matched_qat_training_resumes_serves_and_equals_the_quantised_target(native_model, work_dir, tmp_path,
                                                                              monkeypatch, method, extra):
    common = dict(method=method, target=native_model, batch_size=2, context=48, eval_windows=2, warmup_steps=1,
                  seed=0, max_steps=2, checkpoint_minutes=0.0, **extra)
    base_work = tmp_path / "base-work"
    shutil.copytree(work_dir, base_work)
    base = tmp_path / "base"
    train_drafter(DrafterTrainConfig(out_dir=base, work_dir=base_work, **common))  # the bf16 drafter to fine-tune
    matched = dict(common, target_quantization="int4", qat="int4", init_from=base)
    straight_work = tmp_path / "straight-work"
    shutil.copytree(work_dir, straight_work)
    straight = train_drafter(DrafterTrainConfig(out_dir=tmp_path / "straight", work_dir=straight_work, **matched))
    # Fine-tuning starts from the base drafter: before any step it predicts exactly as the base did
    # against the same (quantised) target, not as a fresh initialisation would.
    assert straight["before_training"] is not None and straight["init_from"] == "base"

    out = tmp_path / "matched"
    with monkeypatch.context() as m:
        interrupt_after(m, 1)
        with pytest.raises(Interrupted):
            train_drafter(DrafterTrainConfig(out_dir=out, work_dir=work_dir, **matched))
    report = train_drafter(DrafterTrainConfig(out_dir=out, work_dir=work_dir, **matched), resume=True)
    assert report["steps"] == 2 and report["before_training"] is None
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # resumed == uninterrupted
    assert not all(torch.equal(a[k], v) for k, v in load_file(base / "model.safetensors").items())  # it trained

    provenance = json.loads((out / "config.json").read_text())["specdecode"]
    assert (provenance["target_quantization"], provenance["qat"]) == ("int4-g32", "int4-g32")
    # Shipped as the tensors it is served with: every QAT layer stored int4 (models/quant.py).
    assert provenance["stored_quantization"] == "int4-g32" and any(k.endswith(".qweight") for k in b)
    assert (report["target_quantization"], report["qat"]) == ("int4-g32", "int4-g32")

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99]}, {"prompt_token_ids": [7, 8, 9, 10, 11]}]
    plain = LLM(native_model, dtype="float32", quantization="int4").generate(prompts, params)
    for draft_quantization in (None, "none"):
        spec = {"method": method, "model": str(out), "num_speculative_tokens": 3}
        if draft_quantization:
            spec["draft_quantization"] = draft_quantization
        llm = LLM(native_model, dtype="float32", quantization="int4", speculative_config=spec)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
        proposer = llm.speculator.proposer
        drafter = next(getattr(proposer, name) for name in ("drafter", "model") if hasattr(proposer, name))
        own = [m for m in drafter.modules() if isinstance(m, QuantizedLinear) and not m.is_view]
        # Unset: served at its QAT scheme (beside these float32 activations, where the w4a8 kernels are, its
        # int4 weights at w4a8); "none": the activation dtype (DFlash's head is the target's).
        assert (len(own) > 0) == (draft_quantization is None)
        assert all(m.scheme == (QuantScheme.parse("w4a8") if gemm_a8_cpu.available("cpu") else INT4) for m in own)


def test_init_from_refuses_a_drafter_of_another_shape(native_model, work_dir, tmp_path):
    common = dict(method="eagle3", target=native_model, batch_size=2, context=48, eval_windows=2, warmup_steps=1,
                  seed=0, max_steps=1, checkpoint_minutes=0.0)
    train_drafter(DrafterTrainConfig(out_dir=tmp_path / "small", work_dir=work_dir, draft_vocab_size=64, **common))
    with pytest.raises(ValueError, match="training_report.json"):
        train_drafter(DrafterTrainConfig(out_dir=tmp_path / "x", work_dir=tmp_path / "w2", draft_vocab_size=128,
                                         init_from=tmp_path / "small", **common))
    with pytest.raises(ValueError, match="not an exported drafter"):
        DrafterTrainConfig(method="eagle3", target=native_model, init_from=tmp_path / "nothing")


def test_matched_names_and_scheme_flags(native_model):
    cfg = DrafterTrainConfig(method="mtp", target=native_model, target_quantization="int4", qat="int4")
    assert (cfg.target_quantization, cfg.qat) == ("int4-g32", "int4-g32")  # canonical names, as recorded
    assert cfg.out_dir.name == f"{native_model.name}-mtp-int4-g32-qat"
    assert str(cfg.work_dir) == "runs/train-drafter-mtp-int4-g32-qat"
    other = DrafterTrainConfig(method="draft_model", target=native_model, target_quantization="int8", qat="int4-g64")
    assert other.out_dir.name == f"{native_model.name}-draft-int8-qat-int4-g64"
    with pytest.raises(ConfigError, match="int3"):
        DrafterTrainConfig(method="mtp", target=native_model, qat="int3")
    with pytest.raises(ConfigError, match="draft_quantization"):
        SpeculativeConfig.parse({"method": "mtp", "draft_quantization": "int3"})
    with pytest.raises(ConfigError, match="draft_quantization"):
        SpeculativeConfig.parse({"method": "mtp", "draft_quantization": 4})


def _fake_shipped(root, name, source, target_quantization, qat):
    shutil.copytree(source, root / name)
    config = json.loads((root / name / "config.json").read_text())
    config["specdecode"].update(target_quantization=target_quantization, qat=qat)
    (root / name / "config.json").write_text(json.dumps(config))


def test_serving_picks_the_drafter_matched_to_the_target_and_says_so(tmp_path, monkeypatch, caplog):
    # A models folder with the default target, its bf16 MTP drafter and two int8-matched ones.
    shutil.copytree(default_model_dir(), tmp_path / default_model_dir().name)
    mtp = models_dir() / f"{default_model_dir().name}-mtp"
    shutil.copytree(mtp, tmp_path / mtp.name)
    _fake_shipped(tmp_path, f"{mtp.name}-int8", mtp, "int8", None)
    _fake_shipped(tmp_path, f"{mtp.name}-int8-qat", mtp, "int8", "int8")
    monkeypatch.setenv("SPECDECODE_MODELS_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="specdecode.speculative.propose.resolve")

    llm = LLM(dtype="float32", quantization="int8", speculative_config={"method": "mtp"})
    assert f"using {mtp.name}-int8-qat" in caplog.text  # of two matched ones, the QAT one
    own = [m for m in llm.speculator.proposer.drafter.modules() if isinstance(m, QuantizedLinear)]
    assert own and all(m.scheme.name == "int8" for m in own)
    caplog.clear()
    LLM(dtype="float32", quantization="int4", speculative_config={"method": "mtp"})
    assert f"no mtp drafter matched to the int4-g32 target is shipped; using {mtp.name} " in caplog.text
    caplog.clear()
    LLM(dtype="float32", speculative_config={"method": "mtp", "model": str(tmp_path / f"{mtp.name}-int8")})
    assert "was trained against the int8 target; this target is full-precision" in caplog.text
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    caplog.clear()
    LLM(dtype="float32", speculative_config={"method": "mtp"})  # full-precision target: no mismatch to report
    assert "int8" not in caplog.text


def test_quant_quality_reports_the_quantised_targets_distance(native_model, capsys):
    from specdecode.bench.quant_quality import compare, main

    logits = torch.randn(5, 40)
    same = compare(logits, logits, torch.zeros(5, dtype=torch.long))
    assert same["agree"] == 5 and abs(same["tv"]) < 1e-6 and abs(same["kl"]) < 1e-6
    other = compare(logits, torch.randn(5, 40), torch.zeros(5, dtype=torch.long))
    assert 0 < other["tv"] < 5 and other["kl"] > 0
    assert main(["--model", str(native_model), "--schemes", "int8,int4-g32", "--max-windows", "2", "--window", "32"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["scheme"] for r in rows] == ["bf16", "int8", "int4-g32"]
    assert rows[0]["tv"] == 0 and rows[0]["kl"] == 0 and rows[0]["top1_agreement"] == 1
    assert all(0 < r["tv"] < 1 and r["kl"] > 0 for r in rows[1:])


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_shipped_matched_drafters_are_picked_for_int4_and_lossless(method, caplog):
    from specdecode.bench.prompts import load_prompts

    caplog.set_level(logging.INFO, logger="specdecode.speculative.propose.resolve")
    prompts = load_prompts("humaneval", 3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # Exact mode: the served bf16 int4 target, bit for bit the same alone and in verify forwards.
    plain = LLM(quantization="int4", exact=True).generate(prompts, params)
    llm = LLM(quantization="int4", exact=True, speculative_config={"method": method, "num_speculative_tokens": 3})
    name = f"{default_model_dir().name}-{method}-int4-g32-qat"
    assert f"using {name}, the {method} drafter trained against it" in caplog.text
    provenance = json.loads((models_dir() / name / "config.json").read_text())["specdecode"]
    assert (provenance["target_quantization"], provenance["qat"]) == ("int4-g32", "int4-g32")
    own = [m for m in llm.speculator.proposer.drafter.modules() if isinstance(m, QuantizedLinear)]
    # Served at its QAT scheme, or beside float32 activations its int4 weights at w4a8 where the kernels are.
    float32_a8 = llm.dtype == torch.float32 and gemm_a8_cpu.available("cpu")
    assert own and all(m.scheme == (QuantScheme.parse("w4a8") if float32_a8 else INT4) for m in own)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs) / sum(o.metrics.num_draft_tokens for o in outputs)
    assert accepted > 0.4


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_checkpoint_storing_its_layers_quantised_serves_exactly_the_latent_ones(trained_drafters, tmp_path, method):
    """store_quantized keeps what serving at that scheme multiplies by, bit for bit, at a third of
    the bytes; other precisions see the dense weights those tensors dequantise to."""
    from specdecode.models.checkpoint import read_checkpoint, store_quantized
    from specdecode.models.inference import prepare_for_inference
    from specdecode.speculative.propose.drafters.eagle.checkpoint import load_drafter

    latent = trained_drafters[method]
    packed = tmp_path / "packed"
    shutil.copytree(latent, packed)
    module = load_drafter(latent, torch.float32, "cpu")
    linears = {n: m.weight for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0}
    assert sorted(store_quantized(packed, linears, INT4)) == sorted(linears)
    assert (packed / "model.safetensors").stat().st_size < 0.5 * (latent / "model.safetensors").stat().st_size
    served = [prepare_for_inference(load_drafter(d, torch.bfloat16, "cpu"), d, torch.bfloat16, "cpu", INT4).state_dict()
              for d in (latent, packed)]
    assert served[0].keys() == served[1].keys() and all(torch.equal(served[0][k], served[1][k]) for k in served[0])
    _, dense = read_checkpoint(packed, "drafter")
    for name, weight in linears.items():
        expected = QuantizedLinear.from_weight(weight.to(torch.bfloat16).float(), None, INT4).dequantize()
        assert torch.equal(dense[f"{name}.weight"], expected)


@pytest.mark.parametrize("method", ["eagle3", "mtp", "draft_model"])
def test_a_full_precision_target_drafts_with_w4a8_drafters_where_the_kernels_are_built(lean_model, lean_drafters,
                                                                                        method):
    """Beside a full-precision bf16 or float32 target the drafter's own layers default to w4a8 (int8
    activations: faster drafting here); "none" keeps them in the activation dtype, a quantised target
    lends them its scheme (an int4 one beside float32 activations as w4a8: the same int4 weights), and
    the outputs are plain decoding's either way."""
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the w4a8 kernels need AVX-512 VNNI")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 4]}, {"prompt_token_ids": [7, 8, 9, 10, 11]}]

    def own_schemes(llm: LLM) -> set:
        proposer = llm.speculator.proposer
        drafter = next(getattr(proposer, name) for name in ("drafter", "model") if hasattr(proposer, name))
        return {m.scheme.name for m in drafter.modules() if isinstance(m, QuantizedLinear) and not m.is_view}

    for dtype, quantization, draft_quantization, schemes in (
            ("bfloat16", None, None, {"w4a8"}), ("bfloat16", None, "none", set()),
            ("float32", None, None, {"w4a8"}), ("float32", None, "none", set()), ("float32", "int8", None, {"int8"}),
            ("float32", "int4", None, {"w4a8"}), ("float32", "int4", "int4", {"int4-g32"}),
            ("bfloat16", "int4", None, {"int4-g32"})):
        spec = {"method": method, "model": str(lean_drafters[method]), "num_speculative_tokens": 3}
        if draft_quantization:
            spec["draft_quantization"] = draft_quantization
        llm = LLM(lean_model, dtype=dtype, quantization=quantization, speculative_config=spec)
        assert own_schemes(llm) == schemes
        plain = LLM(lean_model, dtype=dtype, quantization=quantization).generate(prompts, params)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("method", ["eagle", "medusa", "dflash", "dspark"])
def test_the_other_families_draft_w4a8_beside_a_full_precision_target(native_model, trained_drafters, method, dtype):
    """The default reaches every learned family's own layers (those whose inputs fit whole blocks
    of 32), and their outputs stay plain decoding's."""
    if not gemm_a8_cpu.available("cpu"):
        pytest.skip("the w4a8 kernels need AVX-512 VNNI")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 4]}, {"prompt_token_ids": [7, 8, 9, 10, 11]}]
    spec = {"method": method, "model": str(trained_drafters[method]), "num_speculative_tokens": 3}
    llm = LLM(native_model, dtype=dtype, speculative_config=spec)
    proposer = llm.speculator.proposer
    drafter = next(getattr(proposer, name) for name in ("drafter", "model", "heads") if hasattr(proposer, name))
    assert {m.scheme.name for m in drafter.modules() if isinstance(m, QuantizedLinear) and not m.is_view} == {"w4a8"}
    plain = LLM(native_model, dtype=dtype).generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
