"""prepare_for_inference: bf16 weights packed for oneDNN change no number, only the layout."""

from __future__ import annotations

import pytest
import torch

from specdecode.models import inference
from specdecode.models.inference import FusedMember, PackedLinear, can_pack, swap_linears
from specdecode.models.llama import FusedLinear, fuse_projections
from specdecode.models.loader import load_model

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16 on this CPU build")


def test_a_bf16_model_is_packed_and_computes_exactly_what_the_plain_layout_does(native_model, monkeypatch):
    packed = load_model(native_model, torch.bfloat16)
    assert isinstance(packed.lm_head, PackedLinear)
    attn = packed.model.layers[0].self_attn
    assert isinstance(attn.qkv, PackedLinear) and isinstance(attn.k_proj, FusedMember)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    monkeypatch.setattr(inference, "can_pack", lambda dtype, device: False)
    plain = load_model(native_model, torch.bfloat16)
    assert isinstance(plain.model.layers[0].self_attn.qkv, FusedLinear)
    ids = torch.randint(3, 300, (2, 9))
    positions = torch.arange(9).expand(2, -1)
    with torch.inference_mode():
        a = packed.compute_logits(packed(ids, positions).hidden)
        b = plain.compute_logits(plain(ids, positions).hidden)
    assert torch.equal(a, b)


def test_a_member_of_a_packed_fused_projection_returns_its_part():
    torch.manual_seed(0)
    q, k = torch.nn.Linear(32, 16, bias=False).bfloat16(), torch.nn.Linear(32, 8, bias=False).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    expected_q, expected_k = q(x), k(x)
    holder = torch.nn.Module()
    holder.q_proj, holder.k_proj, holder.v_proj = q, k, torch.nn.Linear(32, 8, bias=False).bfloat16()
    holder.qkv = FusedLinear(holder.q_proj, holder.k_proj, holder.v_proj)
    swap_linears(holder, PackedLinear)
    assert torch.equal(holder.k_proj(x), expected_k) and torch.equal(holder.qkv(x)[0], expected_q)
    assert len([m for m in holder.modules() if isinstance(m, PackedLinear)]) == 1  # members hold no copy


def test_fuse_then_pack_keeps_a_plain_module_working():
    module = fuse_projections(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU()).bfloat16())
    x = torch.randn(2, 16).bfloat16()
    expected = module(x)
    swap_linears(module, PackedLinear)
    assert isinstance(module[0], PackedLinear) and torch.equal(module(x), expected)

