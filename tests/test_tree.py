"""Tree drafts: masks, positions, lossless verification and KV compaction."""

import random

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.sampling import SamplingBatch
from specdecode.speculative.propose.proposer import Draft, ProposerBase
from specdecode.speculative.propose.registry import PROPOSERS, register
from specdecode.speculative.verify.tree import node_depths, tree_attention_mask, verify_tree


def test_mask_and_depths():
    parents = [-1, -1, 0, 2, 1]
    assert node_depths(parents) == [1, 1, 2, 3, 2]
    mask = tree_attention_mask(parents)
    assert mask[4].tolist() == [True, True, False, True, True, False]  # node 3 sees root, 0, 2, itself
    assert mask[5].tolist() == [True, False, True, False, False, True]  # node 4 sees root, 1, itself


def test_greedy_tree_walk_follows_the_target():
    V = 7
    logits = torch.full((1, 5, V), -5.0)
    # Target argmax: after root -> 3, after node 1 (token 3) -> 4, after node 3 (token 4) -> 6.
    logits[0, 0, 3] = logits[0, 2, 4] = logits[0, 4, 6] = 5.0
    tokens = torch.tensor([[2, 3, 5, 4]])  # node 0: 2 (wrong), node 1: 3, node 2: 5 (child of 1), node 3: 4 (child of 1)
    parents = torch.tensor([[-1, -1, 1, 1]])
    batch = SamplingBatch.build([SamplingParams(temperature=0)], [None], "cpu")
    verified, path = verify_tree(tokens, parents, logits, batch, max_depth=2)
    assert verified.num_accepted.tolist() == [2]
    assert path.tolist() == [[1, 3]]
    assert verified.token_ids.tolist() == [[3, 4, 6]]


def test_sampled_tree_walk_is_the_target_distribution():
    V, N = 5, 100_000
    g = torch.Generator().manual_seed(0)
    root_logits, child_logits = torch.randn(V, generator=g), torch.randn(V, generator=g)
    # Root has children 1 and 3; node for token 1 has child 0; the distribution after it is child_logits.
    tokens = torch.tensor([[1, 3, 0]]).expand(N, 3)
    parents = torch.tensor([[-1, -1, 0]]).expand(N, 3)
    logits = torch.stack([root_logits, child_logits, root_logits, child_logits]).expand(N, 4, V)
    batch = SamplingBatch.build([SamplingParams(temperature=1.0)] * N, [None] * N, "cpu")
    verified, _ = verify_tree(tokens, parents, logits, batch, max_depth=2)
    p_root = torch.softmax(root_logits, -1)
    first = torch.bincount(verified.token_ids[:, 0], minlength=V).double() / N
    assert 0.5 * (first - p_root).abs().sum() < 0.01
    after_one = verified.token_ids[verified.token_ids[:, 0] == 1, 1]
    second = torch.bincount(after_one, minlength=V).double() / len(after_one)
    assert 0.5 * (second - torch.softmax(child_logits, -1)).abs().sum() < 0.02
    # Acceptance of the first level is p(1) + p(3).
    assert (verified.num_accepted >= 1).double().mean().item() == pytest.approx((p_root[1] + p_root[3]).item(), abs=0.01)


@register("test_oracle_tree")
class OracleTreeProposer(ProposerBase):
    """Test-only: a tree around the target's own greedy continuation plus random siblings,
    with the true branch sometimes cut or corrupted, nodes in shuffled (topological) order."""

    max_tree_depth = 3

    def __init__(self, ctx):
        super().__init__(ctx)
        self.target, self.vocab = ctx.target, ctx.target.config.vocab_size
        self.rng = random.Random(0)

    @torch.no_grad()
    def _greedy(self, ids: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            x = torch.tensor([ids + out])
            h = self.target(x, torch.arange(x.shape[1])[None]).hidden
            out.append(int(self.target.compute_logits(h[0, -1]).argmax()))
        return out

    def propose(self, seqs, max_tokens, sampling, stop=None):
        rows = []
        for seq, limit in zip(seqs, max_tokens):
            depth = min(self.max_tree_depth, limit)
            truth = self._greedy(seq.token_ids, depth)
            if depth and self.rng.random() < 0.3:
                truth[self.rng.randrange(depth)] = self.rng.randrange(self.vocab)  # corrupt one level
            nodes = []  # (token, parent index)
            parent = -1
            for d in range(depth):
                for _ in range(self.rng.randrange(3)):  # decoy siblings
                    nodes.append((self.rng.randrange(self.vocab), parent))
                nodes.append((truth[d], parent))
                parent = len(nodes) - 1
            rows.append(nodes)
        width = max(1, max(len(r) for r in rows))
        tokens = torch.full((len(seqs), width), -1)
        parents = torch.full((len(seqs), width), -2)
        for b, nodes in enumerate(rows):
            for i, (t, p) in enumerate(nodes):
                tokens[b, i], parents[b, i] = t, p
        return Draft(tokens, torch.tensor([len(r) for r in rows]), parents=parents)


def test_tree_speculation_equals_plain_decoding(native_model):
    assert "test_oracle_tree" in PROPOSERS
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 99], [8, 200, 31, 77, 150], [42], [100, 101, 102])]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = LLM(native_model, dtype="float32", max_num_seqs=4).generate(prompts, params)
    spec = LLM(native_model, dtype="float32", max_num_seqs=4,
               speculative_config={"method": "test_oracle_tree", "num_speculative_tokens": 3}).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    assert accepted > 0.5 * sum(o.metrics.num_draft_tokens for o in spec)  # the true branch is found
    assert max(o.metrics.mean_acceptance_length for o in spec) > 2


def test_cache_after_committing_a_tree_path_equals_sequential_decode(native_model):
    from specdecode.engine.ragged import ForwardEntry
    from specdecode.engine.runner import Runner
    from specdecode.models.loader import load_model
    from specdecode.speculative.verify.kv import compact_accepted

    model = load_model(native_model, torch.float32)
    cpu = torch.device("cpu")
    tree_runner = Runner(model, num_slots=2, max_len=64, dtype=torch.float32, device=cpu)
    prefix = [5, 17, 99, 42]
    tree_runner.forward([ForwardEntry(1, prefix[:-1], start=0)])
    # Root = prefix[-1]; nodes: 0:(7, root) 1:(9, root) 2:(11, node 1) 3:(13, node 0) 4:(15, node 2)
    parents, tokens = [-1, -1, 1, 0, 2], [7, 9, 11, 13, 15]
    depths = node_depths(parents)
    start = len(prefix) - 1
    tree_runner.forward([ForwardEntry(1, [prefix[-1]] + tokens, start=start, num_logits=6,
                                      positions=[start + d for d in [0] + depths], tree_mask=tree_attention_mask(parents))])
    path = torch.tensor([[1, 2, 4]])  # accept 9 -> 11 -> 15
    compact_accepted(tree_runner.kv_cache, torch.tensor([1]), torch.tensor([start]), path, torch.tensor([3]))
    seq_runner = Runner(model, num_slots=2, max_len=64, dtype=torch.float32, device=cpu)
    seq_runner.forward([ForwardEntry(1, prefix + [9, 11, 15], start=0)])
    n = len(prefix) + 3
    for a, b in zip(tree_runner.kv_cache.k + tree_runner.kv_cache.v, seq_runner.kv_cache.k + seq_runner.kv_cache.v):
        torch.testing.assert_close(a[1, :n], b[1, :n], atol=1e-5, rtol=1e-5)
