"""GAE against a plain loop; group-normalised advantages by hand."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expstore_rl.advantages import discounted_cumsum, gae, group_advantages


def gae_loop(rewards, values, mask, gamma, lam):
    """The textbook recursion, one generated token at a time (observations skipped)."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        steps = [t for t in range(T) if mask[b, t]]
        last, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t], next_value = last, values[b, t]
    return adv


@pytest.mark.parametrize("chunk", [3, 256])
def test_discounted_cumsum_matches_a_loop(chunk):
    x = torch.randn(3, 10, dtype=torch.float64)
    expected = torch.zeros_like(x)
    acc = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(10)):
        acc = x[:, t] + 0.9 * acc
        expected[:, t] = acc
    assert torch.allclose(discounted_cumsum(x, 0.9, chunk=chunk), expected)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_a_plain_loop_over_generated_tokens(gamma, lam):
    g = torch.Generator().manual_seed(0)
    # prompt, generated, a tool observation in the middle, generated again, padding
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 0, 1, 0, 1, 1]],
                        dtype=torch.float64)
    rewards = torch.randn(3, 9, generator=g, dtype=torch.float64) * mask
    values = torch.randn(3, 9, generator=g, dtype=torch.float64)
    adv, returns = gae(rewards, values, mask, gamma, lam)
    expected = gae_loop(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, expected)
    assert torch.allclose(returns, (expected + values) * mask)
    assert (adv[mask == 0] == 0).all()


def test_gae_with_lambda_one_and_zero_values_is_the_return_to_go():
    mask = torch.tensor([[0.0, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 0, 0, 1]])
    adv, _ = gae(rewards, torch.zeros(1, 4), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[0.0, 1.0, 1.0, 1.0]]


def test_group_advantages_with_and_without_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    centred = group_advantages(rewards, groups, scale_std=False)
    assert centred.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -1.0, 1.0])
    std0 = torch.tensor([1.0, 0, 0, 0]).std().item()  # unbiased: 0.5
    scaled = group_advantages(rewards, groups, scale_std=True, eps=0.0)
    assert scaled.tolist() == pytest.approx([0.75 / std0, -0.25 / std0, -0.25 / std0, -0.25 / std0,
                                             -1.0 / 2 ** 0.5, 1.0 / 2 ** 0.5])


def test_group_advantages_do_not_need_contiguous_groups_and_zero_variance_gives_zero():
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 1, 0, 2, 2])
    adv = group_advantages(rewards, groups, scale_std=True)
    assert adv[0] == pytest.approx(-adv[2].item()) and adv[0] > 0
    assert adv[1] == 0 and (adv[3:] == 0).all()  # a group of one; a unanimous group


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 128), min_size=1, max_size=4),
       values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=4, max_size=4),
       scale_std=st.booleans(), interleave=st.booleans())
def test_a_group_of_equal_rewards_gets_advantage_exactly_zero(sizes, values, scale_std, interleave):
    # fractional rewards such as 0.95 x 16 or 7.77 x 64 left a float32 mean off by an ulp,
    # which the division by a std of about 0 + eps turned into +0.1 to +0.8 for every row
    groups = torch.cat([torch.full((n,), g) for g, n in enumerate(sizes)])
    rewards = torch.tensor(values, dtype=torch.float32)[groups]
    if interleave:  # rows of a group need not be contiguous
        order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(len(groups)))
        groups, rewards = groups[order], rewards[order]
    adv = group_advantages(rewards, groups, scale_std=scale_std)
    assert adv.dtype == torch.float32 and (adv == 0).all(), adv.unique()


def test_equal_groups_are_zero_beside_a_group_with_signal():
    rewards = torch.tensor([0.95] * 16 + [7.77] * 64 + [0.1, 0.3])
    groups = torch.tensor([0] * 16 + [1] * 64 + [2, 2])
    adv = group_advantages(rewards, groups)
    assert (adv[:80] == 0).all()
    assert adv[80:].tolist() == pytest.approx([-2 ** -0.5, 2 ** -0.5], rel=1e-4)
