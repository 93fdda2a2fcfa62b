"""Losses against values computed by hand."""

import math

import pytest
import torch

from expstore_rl.losses import aggregate, entropy, importance_weights, kl, normaliser, policy_loss, value_loss

MASK = torch.tensor([[0.0, 1, 1, 0], [0, 1, 0, 0]])
X = torch.tensor([[100.0, 1, 3, 100], [100, 5, 100, 100]])  # 100s are masked out


def test_token_mean_and_seq_mean():
    assert aggregate(X, MASK, "token-mean").item() == pytest.approx((1 + 3 + 5) / 3)
    assert aggregate(X, MASK, "seq-mean").item() == pytest.approx(((1 + 3) / 2 + 5) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean"])
def test_micro_batches_with_the_batch_normaliser_add_up_to_the_batch(mode):
    norm = normaliser(MASK, mode)
    parts = sum(aggregate(X[i:i + 1], MASK[i:i + 1], mode, norm) for i in range(2))
    assert parts.item() == pytest.approx(aggregate(X, MASK, mode).item())


def test_clipped_surrogate_with_separate_low_and_high_clip():
    prox = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, diag = policy_loss(logp, prox, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.3, agg="token-mean")
    # r=1.5,A=+1: min(1.5, 1.3) = 1.3;  r=1.5,A=-1: min(-1.5, -1.3) = -1.5
    # r=0.5,A=+1: min(0.5, 0.8) = 0.5;  r=0.5,A=-1: min(-0.5, -0.8) = -0.8
    assert loss.item() == pytest.approx(-(1.3 - 1.5 + 0.5 - 0.8) / 4)
    assert diag["clipped"].tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_surrogate_gradient_is_weighted_by_the_importance_weights():
    logp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = policy_loss(logp, logp.detach(), torch.ones(1, 1), torch.ones(1, 2), is_weights=w)
    loss.backward()
    assert logp.grad.tolist() == [[-1.0, -0.25]]  # -w * A / n_tokens at ratio 1


def test_masked_tokens_do_not_count():
    logp = torch.tensor([[0.0, -1.0]])
    loss, _ = policy_loss(logp, torch.tensor([[5.0, -1.0]]), torch.tensor([[1e6, 2.0]]), torch.tensor([[0.0, 1.0]]))
    assert loss.item() == pytest.approx(-2.0)


def test_importance_weights_are_truncated_at_the_cap():
    prox = torch.log(torch.tensor([[0.9, 0.5, 0.1]]))
    behaviour = torch.log(torch.tensor([[0.3, 0.5, 0.4]]))
    w = importance_weights(prox, behaviour, cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 1.0, 0.25])
    assert importance_weights(prox, behaviour, cap=0).tolist() == [[1.0, 1.0, 1.0]]


def test_kl_estimators():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-0.5, -1.0])
    assert kl(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 1 + 0.5, 0.0])
    with pytest.raises(ValueError):
        kl(logp, ref, "k9")


def test_k3_is_unbiased_for_the_kl():
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    exact = (p * (p / q).log()).sum()
    expected_k3 = (p * kl(p.log(), q.log(), "k3")).sum()
    assert expected_k3.item() == pytest.approx(exact.item(), rel=1e-5)


def test_clipped_value_loss():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.5, 0.0]]), torch.tensor([[2.0, 0.1]])
    loss = value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: max(0.01, 0.01) = 0.01
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.01) / 2)
    assert value_loss(values, old, returns, torch.ones(1, 2), clip=0).item() == pytest.approx(0.5 * (1 + 0.01) / 2)


def test_entropy_of_uniform_and_of_a_masked_distribution():
    assert entropy(torch.zeros(1, 1, 8)).item() == pytest.approx(math.log(8))
    masked = torch.tensor([[[0.0, 0.0, -1e9, -1e9]]])  # top-k = 2 as model.process_logits masks
    assert entropy(masked).item() == pytest.approx(math.log(2))


def test_a_token_masked_out_by_top_k_gives_a_finite_loss_and_finite_gradients():
    # top-k/top-p give a token outside the kept set a logprob of about -1e9 (model.MASKED).
    # Token 0: outside the proximal policy's top-k, back in the current one (ratio e^(1e9)).
    # Token 1: outside the behaviour policy's, inside the proximal one's (weight e^(1e9)).
    # Token 2: outside the current policy's (KL against the reference e^(1e9)).
    masked = -1e9
    logp = torch.tensor([[-2.0, -1.0, masked]], requires_grad=True)
    proximal = torch.tensor([[masked, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.5, masked, -1.0]])
    ref = torch.tensor([[-1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    for advantage in (1.0, -1.0):
        w = importance_weights(proximal, behaviour, cap=2.0)
        loss, diag = policy_loss(logp, proximal, torch.full((1, 1), advantage), mask, is_weights=w)
        for estimator in ("k1", "k3"):
            loss = loss + 0.1 * aggregate(kl(logp, ref, estimator), mask, "token-mean")
            assert torch.isfinite(kl(behaviour, proximal, estimator)).all()
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and torch.isfinite(diag["ratio"]).all()
        assert w.tolist() == [[pytest.approx(math.exp(-20.0)), 2.0, 1.0]]
        logp.grad = None
