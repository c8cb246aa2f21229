"""Exact mode: speculation changes nothing but speed, bit for bit, in the served dtype.

- the keyed noise is a pure function of (seed, position, token), the same from the C++ kernel
  and the tensor reference, and Exp(1)-distributed;
- the invariant attention gives a row the same bits alone, in a wider forward and in a batch;
- the row probe finds a kernel that depends on the row count (and the real one that does);
- the bisection tool finds where plain decoding and verification differ without exact mode, and
  nothing with it, on the default model in bf16 and int8;
- every method, chain and tree, reproduces plain decoding token for token, greedy, seeded T=1
  and seeded top-p, in ragged batches, on the default model and its drafters (bf16 and int8);
- keyed (coupled) verification keeps the target distribution over random keys, and a rule
  that trusts the drafter's own race does not (negative control).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode import LLM, SamplingParams
from specdecode.bench.prompts import load_prompts
from specdecode.errors import ConfigError
from specdecode.exact.bisect import bisect_width
from specdecode.kernels.exact_cpu import exact_attention
from specdecode.exact.noise import keyed_exponential, keyed_uniform, seed_key
from specdecode.exact.rows import probe_row_tiling
from specdecode.models.llama import RowTiling
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.proposer import Draft
from specdecode.speculative.verify.chain import verify

# ---- keyed noise ---------------------------------------------------------------------------


def test_keyed_noise_is_a_function_of_seed_position_and_token_only():
    keys = torch.tensor([seed_key(s) for s in (0, 1, 2**40 + 3)])
    positions = torch.tensor([7, 7, 123456])
    noise = keyed_exponential(keys, positions, 1000)
    # the same (key, position) in another batch, at another row, gives the same row
    again = keyed_exponential(torch.tensor([seed_key(5), seed_key(2**40 + 3)]), torch.tensor([7, 123456]), 1000)
    assert torch.equal(noise[2], again[1])
    assert not torch.equal(noise[0], noise[1])  # another seed
    assert not torch.equal(noise[0], keyed_exponential(keys[:1], positions[:1] + 1, 1000)[0])  # another position
    # C++ kernel and tensor reference agree (the log differs by at most a few ulp)
    torch.testing.assert_close(torch.exp(-noise), keyed_uniform(keys, positions, 1000), rtol=2e-6, atol=0)
    big = keyed_exponential(torch.tensor([seed_key(s) for s in range(64)]), torch.arange(64), 4096)
    assert abs(big.mean().item() - 1) < 0.01 and abs(big.var().item() - 1) < 0.03  # Exp(1): mean 1, variance 1


# ---- invariant kernels ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_attention_rows_do_not_depend_on_width_batch_or_key_columns(dtype):
    torch.manual_seed(0)
    H, KVH, D, C, W = 8, 4, 64, 700, 9
    cache_k, cache_v = torch.randn(3, C, KVH, D, dtype=dtype), torch.randn(3, C, KVH, D, dtype=dtype)
    for n in (5, 200, 600):
        q = torch.randn(1, W, H, D, dtype=dtype)
        mask = torch.arange(n + W + 40)[None, :] <= (n + torch.arange(W))[:, None]  # [W, S], 40 hidden columns
        wide = exact_attention(q, cache_k, cache_v, torch.tensor([1]), mask[None], D ** -0.5)
        for j in range(W):  # each token alone, seeing exactly its own keys
            alone = exact_attention(q[:, j:j + 1], cache_k, cache_v, torch.tensor([1]), mask[None, j:j + 1, :n + j + 1],
                                    D ** -0.5)
            assert torch.equal(alone[0, 0], wide[0, j])
        other = torch.randn(1, W, H, D, dtype=dtype)
        batched = exact_attention(torch.cat([other, q]), cache_k, cache_v, torch.tensor([2, 1]),
                                  torch.cat([mask[None], mask[None]]), D ** -0.5)
        assert torch.equal(batched[1], wide[0])
        k, v = cache_k[1:2, :n + W].transpose(1, 2), cache_v[1:2, :n + W].transpose(1, 2)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[None, None, :, :n + W],
                                             enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(wide.float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 8e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_attention_reads_a_head_major_cache_as_its_row_major_copy(dtype):
    """The KV cache is head-major storage seen as [slots, columns, KVH, D] (models/llama.py KVCache)."""
    torch.manual_seed(0)
    H, KVH, D, C, W, n = 8, 4, 64, 300, 5, 200
    cache_k = torch.randn(3, KVH, C, D, dtype=dtype).transpose(1, 2)
    cache_v = torch.randn(3, KVH, C, D, dtype=dtype).transpose(1, 2)
    q = torch.randn(2, W, H, D, dtype=dtype)
    mask = (torch.arange(n + W)[None, :] <= (n + torch.arange(W))[:, None])[None].repeat(2, 1, 1)
    slots = torch.tensor([2, 0])
    strided = exact_attention(q, cache_k, cache_v, slots, mask, D ** -0.5)
    assert torch.equal(strided, exact_attention(q, cache_k.contiguous(), cache_v.contiguous(), slots, mask, D ** -0.5))
    k, v = cache_k[2:3, :n + W].transpose(1, 2), cache_v[2:3, :n + W].transpose(1, 2)
    ref = F.scaled_dot_product_attention(q[:1].transpose(1, 2), k, v, attn_mask=mask[:1, None],
                                         enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(strided[:1].float(), ref.float(), atol=1e-5 if dtype == torch.float32 else 8e-3, rtol=0)


def test_row_probe_finds_kernels_that_depend_on_the_row_count_or_position():
    weight = torch.randn(16, 32)

    def per_row(x, w):  # one matrix-vector product per row: the same computation whatever the row count
        return torch.stack([w @ row for row in x])

    def split(x, w):  # the same sums in another order
        return per_row(x[:, :16], w[:, :16]) + per_row(x[:, 16:], w[:, 16:])

    def invariant(x):
        return per_row(x, weight)

    def single_row_kernel(x):  # like oneDNN's bf16 matrix-vector path: one row alone is summed differently
        return split(x, weight) if x.shape[0] == 1 else per_row(x, weight)

    def by_count(x):  # another order for calls of more than 5 rows: calls padded to 8 rows are invariant
        return per_row(x, weight) if x.shape[0] <= 5 else split(x, weight)

    def by_size(x):  # one order for multiples of 8 rows only: only fixed-size calls of 8 are invariant
        return per_row(x, weight) if x.shape[0] % 8 == 0 else split(x, weight)

    def by_position(x):  # odd rows in another order: nothing but one row per call is invariant
        return torch.stack([(split if j % 2 else per_row)(row[None], weight)[0] for j, row in enumerate(x)])

    assert probe_row_tiling(invariant, 32, 16, torch.float32, "cpu") == RowTiling(64)
    assert probe_row_tiling(single_row_kernel, 32, 16, torch.float32, "cpu") == RowTiling(64, min_rows=2)
    assert probe_row_tiling(by_count, 32, 16, torch.float32, "cpu") == RowTiling(64, min_rows=8)
    assert probe_row_tiling(by_size, 32, 16, torch.float32, "cpu") == RowTiling(8, min_rows=8)
    assert probe_row_tiling(by_position, 32, 16, torch.float32, "cpu") == RowTiling(1)


def test_the_default_models_layers_get_tilings_under_which_their_rows_are_invariant():
    """The tilings depend on the CPU's oneDNN kernels (AMD Zen 4: only the 1408 -> 512 down projection
    needs padding, one-row calls to two; Intel with AMX: fixed tiles of 8 for every bf16 layer), so
    what is checked is what they are for: a row's output does not depend on the rows beside it."""
    from specdecode.defaults import default_model_dir
    from specdecode.exact.rows import make_rows_invariant
    from specdecode.models.loader import load_model
    from specdecode.models.quant import QuantizedLinear, QuantScheme

    # float32: where the CPU has AVX2 + FMA, the bf16 checkpoint's layers keep bf16 weights (Bf16WeightLinear).
    for dtype, scheme in ((torch.bfloat16, None), (torch.bfloat16, QuantScheme.parse("int8")), (torch.float32, None)):
        model = load_model(default_model_dir(), dtype, "cpu", scheme)
        make_rows_invariant(model, dtype, "cpu")
        layers = model.model.layers[0]
        for layer in (layers.self_attn.qkv, layers.mlp.down_proj, model.lm_head):
            x = torch.randn(17, layer.in_features, generator=torch.Generator().manual_seed(3)).to(dtype)

            def rows(t):
                out = layer(t)
                return torch.cat(out, dim=-1) if isinstance(out, (tuple, list)) else out

            with torch.inference_mode():
                alone = torch.cat([rows(x[i:i + 1]) for i in range(len(x))])
                for m in (2, 3, 5, 8, 9, 16, 17):
                    assert torch.equal(rows(x[:m]), alone[:m]), (scheme, layer, m)


# ---- the bisection tool on the default model ------------------------------------------------


@pytest.fixture(scope="module")
def code_tokens():
    from specdecode.defaults import default_model_dir
    from specdecode.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir())
    ids = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=")
    return ids, [tok.encode("class Stack:\n    def push(self, item):\n")]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_bisection_finds_the_divergence_without_exact_mode_and_none_with_it(code_tokens, quantization):
    from specdecode.defaults import default_model_dir
    from specdecode.engine.runner import Runner
    from specdecode.exact.rows import make_rows_invariant
    from specdecode.models.loader import load_model
    from specdecode.models.quant import QuantizedLinear, QuantScheme

    ids, others = code_tokens
    prompt, tokens = ids[:-9], ids[-9:]
    scheme = QuantScheme.parse(quantization)
    reports = {}
    for exact in (False, True):
        model = load_model(default_model_dir(), torch.bfloat16, "cpu", scheme)
        if exact:
            make_rows_invariant(model, torch.bfloat16, "cpu")
        else:  # as where the probe stopped the int kernels at 8 rows: 9 tokens take PyTorch's int kernels
            for layer in model.modules():
                if isinstance(layer, QuantizedLinear) and layer.few_rows is not None:
                    layer.few_rows = (*layer.few_rows[:-1], min(8, layer.few_rows[-1]))
        runner = Runner(model, 2, 256, torch.bfloat16, torch.device("cpu"), scheme, exact=exact)
        reports[exact] = bisect_width(runner, prompt, tokens, others)
    off, on = reports[False], reports[True]
    # a layer whose kernel picks its blocks by width (the 9 tokens' attention is row-independent since
    # the attention op serves them; PyTorch's matmuls are not)
    # (the divergence can stay inside the KV written and round away before the logits: either shows it)
    assert not (off.logits_equal and off.kv_equal) and off.divergence is not None
    assert off.divergence.name.startswith("model.layers.") and off.divergence.input_matched
    assert on.logits_equal and on.kv_equal and on.divergence is None


# ---- end to end: every method, the default model and its drafters ----------------------------

CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    "medusa": {"method": "medusa", "num_speculative_tokens": 3},
    "medusa-tree": {"method": "medusa", "num_speculative_tokens": 3, "tree_topk": 2},
    "eagle": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 4},
    "eagle3-tree": {"method": "eagle3", "num_speculative_tokens": 4, "tree_topk": 2},
    "mtp": {"method": "mtp", "num_speculative_tokens": 4},
    "mtp-tree": {"method": "mtp", "num_speculative_tokens": 4, "tree_topk": 2},
    "dflash": {"method": "dflash", "num_speculative_tokens": 7},
    "dspark": {"method": "dspark", "num_speculative_tokens": 7},
}


def _requests():
    prompts = load_prompts("humaneval", 5)  # different lengths: ragged batches of 3 slots
    n = len(prompts)
    params = ([SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * n
              + [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=10 + i) for i in range(n)]
              + [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=50 + i)
                 for i in range(n)])
    return prompts * 3, params


def _outputs(quantization, speculative_config=None):
    prompts, params = _requests()
    llm = LLM(exact=True, quantization=quantization, max_num_seqs=3, speculative_config=speculative_config)
    # One kernel per layer at every width: no dense copy for wide forwards (models/wide_kernels.py)
    assert all(getattr(m, "wide", None) is None for m in llm.model.modules())
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain_outputs():
    return {q: _outputs(q) for q in (None, "int8")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exact_speculation_reproduces_plain_decoding_bf16(plain_outputs, name):
    assert _outputs(None, CONFIGS[name]) == plain_outputs[None]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exact_speculation_reproduces_plain_decoding_int8(plain_outputs, name):
    assert _outputs("int8", CONFIGS[name]) == plain_outputs["int8"]


def test_a_request_alone_equals_it_in_a_batch_in_exact_mode(plain_outputs):
    prompts, params = _requests()
    llm = LLM(exact=True, max_num_seqs=1, speculative_config=CONFIGS["eagle3"])
    assert [llm.generate(p, sp)[0].token_ids for p, sp in zip(prompts[5:8], params[5:8])] == plain_outputs[None][5:8]


def test_exact_mode_refuses_what_it_cannot_keep():
    with pytest.raises(ConfigError, match="compile"):
        LLM(exact=True, compile=True)
    with pytest.raises(ConfigError, match="exact must be True or False"):
        LLM(exact="yes")


# ---- coupled verification keeps the target distribution -------------------------------------


def _first_tokens(p: torch.Tensor, q: torch.Tensor, trials: int, trust_drafter: bool) -> torch.Tensor:
    """First committed token of `trials` independent keyed requests: the drafter races q and the
    verifier checks the draft against the target's race on p (trust_drafter: accept the draft as is)."""
    V = p.shape[0]
    keys = torch.arange(trials) * 7919 + 1
    positions = torch.full((trials,), 3)
    noise = keyed_exponential(keys, positions, V)  # [trials, V]
    drafts = (q[None] / noise).argmax(-1)  # the drafter's race, on the same noise
    params = [SamplingParams(temperature=1.0, seed=int(k)) for k in keys]
    batch = SamplingBatch.build(params, [None] * trials, "cpu", noise_keys=keys.tolist(), positions=positions.tolist())
    if trust_drafter:
        return drafts
    logits = torch.log(p)[None, None].expand(trials, 2, V).clone()
    out = verify(Draft(drafts[:, None], torch.ones(trials, dtype=torch.long)), logits, batch)
    return out.token_ids[:, 0]


def test_coupled_verification_keeps_the_target_distribution_and_the_drafter_race_does_not():
    V, trials = 6, 30000
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.1, 0.1, 0.5, 0.1, 0.1, 0.1])  # a poor drafter

    def chi2(tokens: torch.Tensor) -> float:
        counts = torch.bincount(tokens, minlength=V).float()
        expected = p * trials
        return float(((counts - expected) ** 2 / expected).sum())

    # 5 degrees of freedom: chi2 < 20.5 with probability 0.999
    assert chi2(_first_tokens(p, q, trials, trust_drafter=False)) < 20.5
    assert chi2(_first_tokens(p, q, trials, trust_drafter=True)) > 1000  # negative control: that is q, not p
    # Gumbel coupling: the draft equals the target's token with probability >= (1 - TV) / (1 + TV)
    keys = torch.arange(trials) * 7919 + 1
    noise = keyed_exponential(keys, torch.full((trials,), 3), V)
    agree = ((q[None] / noise).argmax(-1) == (p[None] / noise).argmax(-1)).float().mean().item()
    tv = 0.5 * (p - q).abs().sum().item()
    assert agree >= (1 - tv) / (1 + tv) - 0.01
