"""Policy-gradient losses over token tensors (B, T), shared by PPO and GRPO.

Every function takes a ``mask`` (B, T) that is 1 on the tokens the policy generated
(``loss_mask``) and 0 on prompt, tool-observation and padding tokens; masked positions
never contribute to a loss or a metric.

Aggregation divides by a *given* normaliser instead of the micro-batch's own count, so
that the losses of micro-batches (and of FSDP ranks) add up to the loss of the whole
batch: gradient accumulation is then exact, not an average of averages.

- ``token-mean``: sum over all generated tokens / number of generated tokens in the batch
  (long answers weigh more; DAPO's choice).
- ``seq-mean``: mean over sequences of each sequence's token mean (every sequence weighs
  the same; the original GRPO).

Every ratio of probabilities is exp of a log-ratio clamped to +-``LOG_RATIO_LIMIT``: under
top-k/top-p a token outside the kept set has logprob about -1e9 (``model.MASKED``), and
one policy may keep a token that another drops, so an unclamped exp overflows to inf, and
inf times the zero gradient of a clip is NaN in every parameter.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean")
KL_ESTIMATORS = ("k1", "k3")
LOG_RATIO_LIMIT = 20.0
"""|log p - log q| is clamped to this (verl's bound): e^20 ~ 5e8 is far beyond any clip or
importance cap, so only degenerate tokens are affected, and their gradient is 0."""


def log_ratio(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """log(p / q) per token, clamped to +-LOG_RATIO_LIMIT so that its exp stays finite."""
    return (logp - logq).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str, normaliser: float | None = None) -> torch.Tensor:
    """Reduce per-token values ``x`` (B, T) to a scalar.

    normaliser: the batch-wide count to divide by (generated tokens for token-mean,
    sequences for seq-mean); None uses this tensor's own count.
    """
    if mode == "token-mean":
        total = (x * mask).sum()
        n = mask.sum() if normaliser is None else normaliser
    elif mode == "seq-mean":
        per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
        total = (per_seq * (mask.sum(-1) > 0)).sum()
        n = (mask.sum(-1) > 0).sum() if normaliser is None else normaliser
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    return total / max(float(n), 1.0)


def normaliser(mask: torch.Tensor, mode: str) -> float:
    """The count ``aggregate`` divides by, for a whole batch's mask."""
    return float(mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum())


def importance_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                       cap: float) -> torch.Tensor:
    """Truncated importance weights min(pi_prox / mu, cap) per token (B, T).

    mu is the behaviour policy that generated the token (its logprob is stored with the
    trajectory, possibly several versions old); pi_prox is the trainer's policy before
    this update. Truncation bounds the variance that stale samples bring (truncated IS,
    as in IMPALA's rho-bar). cap <= 0 turns the correction off (all weights 1).
    """
    if cap <= 0:
        return torch.ones_like(proximal_logprobs)
    return torch.exp(log_ratio(proximal_logprobs, behaviour_logprobs)).clamp(max=cap)


def policy_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                is_weights: torch.Tensor | None = None, agg: str = "token-mean",
                norm: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), weighted by
    the (detached) importance weights: the decoupled PPO objective.

    r = pi_theta / pi_prox is the trust-region ratio within this update; the off-policy
    correction for stale samples is the separate weight pi_prox / mu, so clipping bounds
    how far one update moves, however old the sample. A clip_high above clip_low
    (DAPO's clip-higher) lets unlikely tokens with positive advantage grow faster.
    advantages: (B, T), or (B, 1) broadcast over tokens. Returns the loss and
    per-token diagnostics (ratio, clipped indicator) for metrics.
    """
    ratio = torch.exp(log_ratio(logprobs, proximal_logprobs))
    advantages = advantages.expand_as(ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, agg, norm)
    return loss, {"ratio": ratio.detach(), "clipped": (clipped < unclipped).float().detach()}


def kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled under pi_theta.

    k1 = log pi - log pi_ref: unbiased, can be negative, high variance.
    k3 = exp(ref - log pi) - (ref - log pi) - 1: unbiased, always >= 0, lower variance
    (Schulman, "Approximating KL divergence"). As a loss, k3's gradient is that of the
    reverse KL's second-order term; k1 is the usual choice inside the reward.
    """
    x = log_ratio(logprobs, ref_logprobs)  # clamped: a token one side masks out stays finite
    if estimator == "k1":
        return x
    if estimator == "k3":
        return torch.expm1(-x) + x
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               *, clip: float = 0.2, agg: str = "token-mean", norm: float | None = None) -> torch.Tensor:
    """PPO's clipped value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-clip) - R)^2):
    the critic may not move further than ``clip`` from its pre-update prediction per
    update, which keeps it from chasing one batch's noisy returns. clip <= 0: plain MSE."""
    unclipped = (values - returns) ** 2
    if clip <= 0:
        return 0.5 * aggregate(unclipped, mask, agg, norm)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
    return 0.5 * aggregate(torch.maximum(unclipped, clipped), mask, agg, norm)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (B, T) of softmax(logits) at each position, the bonus term that keeps
    exploration alive. logits: (B, T, V), already processed (temperature, top-k/top-p
    masks) so that it is the entropy of the distribution the producers sample from."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
