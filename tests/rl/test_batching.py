"""Store rows -> padded tensors, shards, micro-batches by token budget."""

import numpy as np
import pytest
import torch

from expstore.synthetic import trajectories
from expstore_client import SampleBatch
from expstore_rl.batching import Rollouts, concat, from_sample_batch, micro_batches, minibatches


def sample_batch(n=6, groups=3, seed=0) -> SampleBatch:
    data = trajectories(n, tokens=(9, 14), prompt_tokens=4, groups=groups, seed=seed,
                        reward=np.arange(n, dtype=np.float32))
    return SampleBatch(ids=np.arange(1, n + 1, dtype=np.uint64), data=data, priorities=np.ones(n),
                       times_sampled=np.ones(n, dtype=np.int64), policy_versions=np.arange(n, dtype=np.int64))


def test_from_sample_batch_pads_and_keeps_masks_and_groups():
    batch = sample_batch()
    r = from_sample_batch(batch)
    lengths = batch.lengths("tokens")
    assert r.tokens.shape == (6, lengths.max()) and r.tokens.dtype == torch.int64
    assert r.lengths.tolist() == lengths.tolist()
    for i, row in enumerate(batch.data.to_pylist()):
        n = len(row["tokens"])
        assert r.tokens[i, :n].tolist() == row["tokens"] and (r.tokens[i, n:] == 0).all()
        assert r.loss_mask[i, :n].tolist() == row["loss_mask"] and (r.loss_mask[i, n:] == 0).all()
        assert r.logprobs[i, :n].tolist() == pytest.approx(row["logprobs"])
    assert r.rewards.tolist() == list(range(6))
    assert r.policy_versions.tolist() == list(range(6))
    # round-robin groups: rows 0 and 3 share one, and so on
    assert r.group_index[0] == r.group_index[3] and len(set(r.group_index.tolist())) == 3


def test_micro_batches_stay_within_the_budget_and_cover_every_row_once():
    lengths = torch.tensor([5, 30, 12, 12, 7, 3, 30, 1])
    parts = micro_batches(lengths, token_budget=40)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    for p in parts:
        assert len(p) * int(lengths[p].max()) <= 40
    assert [len(p) for p in parts] == [1, 1, 3, 3]  # longest first: 30 | 30 | 12 12 7 | 5 3 1


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch():
    parts = micro_batches(torch.tensor([100, 2, 2]), token_budget=10)
    assert [p.tolist() for p in parts] == [[0], [1, 2]]


def test_select_cuts_to_the_longest_selected_row_and_carries_extras():
    r = from_sample_batch(sample_batch())
    r.extras["advantages"] = torch.arange(6.0)[:, None]
    shortest = int(torch.argmin(r.lengths))
    part = r.select(torch.tensor([shortest]))
    assert part.tokens.shape == (1, int(r.lengths[shortest]))
    assert part.extras["advantages"].tolist() == [[float(shortest)]]


def test_shards_are_contiguous_and_cover_the_batch():
    r = from_sample_batch(sample_batch(8, groups=4))
    shards = [r.shard(k, 2) for k in range(2)]
    assert torch.equal(torch.cat([s.rewards for s in shards]), r.rewards)


def test_minibatches_keep_groups_together():
    group_index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    parts = minibatches(8, 2, torch.Generator().manual_seed(0), group_index)
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    for p in parts:
        groups = group_index[p]
        assert all((group_index == g).sum() == (groups == g).sum() for g in groups.unique())


def test_concat_pads_and_keeps_groups_apart():
    a, b = from_sample_batch(sample_batch(4, 2, seed=1)), from_sample_batch(sample_batch(2, 1, seed=2))
    c = concat([a, b])
    assert len(c) == 6 and c.tokens.shape[1] == max(a.tokens.shape[1], b.tokens.shape[1])
    assert len(set(c.group_index.tolist())) == 3
    assert isinstance(c, Rollouts)
