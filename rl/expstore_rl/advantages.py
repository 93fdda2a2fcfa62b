"""Advantage estimators: GAE for PPO (with a critic), group-normalised for GRPO.

Tensors are (B, T) over the whole token sequence; ``mask`` (loss_mask) is 1 on tokens the
policy generated. GAE runs over generated tokens only: prompt and tool-observation tokens
are not actions, so the step after generated token t is the next generated token, however
many observation tokens lie between them (a multi-turn episode is one MDP over actions).
"""

from __future__ import annotations

import torch


def discounted_cumsum(x: torch.Tensor, discount: float, chunk: int = 256) -> torch.Tensor:
    """y_t = sum_{s >= t} discount^(s - t) x_s along the last dim, without a Python loop
    over positions: each chunk of ``chunk`` positions is one matmul with the triangular
    matrix of discount powers, and chunks are chained back to front by the carry y_b.
    O(B T chunk) work; exact in float64 (the result is cast back to x's dtype)."""
    T = x.shape[-1]
    powers = torch.arange(min(T, chunk), dtype=torch.float64, device=x.device)
    lag = powers[None, :] - powers[:, None]  # lag[t, s] = s - t
    weights = torch.where(lag >= 0, discount ** lag.clamp(min=0), torch.zeros((), dtype=torch.float64))
    xd = x.to(torch.float64)
    out = torch.empty_like(xd)
    carry = torch.zeros(xd.shape[:-1], dtype=torch.float64, device=x.device)  # y at the chunk's end
    for start in reversed(range(0, T, chunk)):
        end = min(start + chunk, T)
        n = end - start
        y = xd[..., start:end] @ weights[:n, :n].T  # (..., n)
        y = y + carry[..., None] * discount ** (n - powers[:n])
        out[..., start:end] = y
        carry = y[..., 0]
    return out.to(x.dtype)


def pack_left(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's masked positions to its front, in order: (packed, index) with
    packed = x.gather(-1, index); ``unpack`` undoes it."""
    index = torch.argsort((mask == 0).to(torch.int8), dim=-1, stable=True)
    return x.gather(-1, index), index


def unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(packed).scatter_(-1, index, packed)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over generated tokens.

    rewards: (B, T) per-token rewards (the trajectory reward on the last generated token,
    a per-token KL penalty if the KL is in the reward); values: (B, T) critic values
    V(s_t) of the state before token t. The episode ends after the last generated token
    (bootstrap value 0). Returns (advantages, returns), both 0 where mask = 0.
    """
    mask = mask.to(values.dtype)
    r, index = pack_left(rewards * mask, mask)
    v = (values * mask).gather(-1, index)
    m = mask.gather(-1, index)
    next_v = torch.nn.functional.pad(v[..., 1:] * m[..., 1:], (0, 1))
    delta = (r + gamma * next_v - v) * m
    adv = discounted_cumsum(delta, gamma * lam) * m
    adv = unpack(adv, index)
    return adv, (adv + values) * mask


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scale_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage per sequence (B,): reward minus its group's mean, divided by the
    group's (unbiased) standard deviation + eps when scale_std (Dr. GRPO drops the
    division: it up-weights near-unanimous groups and biases towards easy prompts).

    group_index: (B,) int, 0..G-1, the group of each row (rows need not be contiguous).
    A group whose rewards are all equal gets advantage exactly 0: it carries no signal.
    Statistics are taken in float64 and such groups are found by comparing their smallest
    and largest reward, since even a float64 mean of equal fractional values can miss them
    by an ulp, which the division by a std of about 0 + eps would blow up (0.95 x 16 gave
    +0.106 each in float32). Returned as float32.
    """
    rewards = rewards.to(torch.float64)
    G = int(group_index.max()) + 1 if len(group_index) else 0

    def per_group(values: torch.Tensor, reduce: str) -> torch.Tensor:  # (G,)
        start = {"sum": 0.0, "amin": torch.inf, "amax": -torch.inf}[reduce]
        out = torch.full((G,), start, dtype=torch.float64, device=rewards.device)
        return out.scatter_reduce(0, group_index, values, reduce)

    count = per_group(torch.ones_like(rewards), "sum")
    mean = per_group(rewards, "sum") / count
    constant = (per_group(rewards, "amin") == per_group(rewards, "amax"))[group_index]  # (B,)
    centred = torch.where(constant, 0.0, rewards - mean[group_index])
    if scale_std:
        var = per_group(centred ** 2, "sum") / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt()[group_index] + eps)
    return centred.to(torch.float32)
