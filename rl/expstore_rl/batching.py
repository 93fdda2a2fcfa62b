"""From store rows to training tensors: padding, sharding over ranks, and micro-batches
packed by token budget.

A ``Rollouts`` holds one training batch as dense (B, T) tensors (right-padded; the
padding has loss_mask 0 and attention_mask 0). ``micro_batches`` cuts it into pieces
whose padded size rows x longest row stays within a token budget, so a batch of short
answers runs in few forward passes and a batch of long ones does not run out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from expstore_client import SampleBatch


@dataclass
class Rollouts:
    tokens: torch.Tensor          # (B, T) int64, right-padded with 0
    attention_mask: torch.Tensor  # (B, T) float, 1 on real tokens
    loss_mask: torch.Tensor       # (B, T) float, 1 on generated tokens
    logprobs: torch.Tensor        # (B, T) float, behaviour-policy logprobs (0 where loss_mask = 0)
    rewards: torch.Tensor         # (B,) trajectory reward (null -> 0)
    group_index: torch.Tensor     # (B,) int64, 0..G-1 by group_id (rows without one: a group each)
    policy_versions: torch.Tensor  # (B,) int64, oldest version that generated the row
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """per-row tensors the trainer adds (recomputed logprobs, advantages, ...), (B, T) or (B,)"""

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(-1).long()

    def select(self, index: torch.Tensor) -> "Rollouts":
        """Rows ``index``, cut to their longest row."""
        width = int(self.lengths[index].max()) if len(index) else 0
        return Rollouts(**{f.name: _take(getattr(self, f.name), index, width) for f in _tensor_fields()},
                        extras={k: _take(v, index, width) for k, v in self.extras.items()})

    def to(self, device: torch.device) -> "Rollouts":
        return Rollouts(**{f.name: getattr(self, f.name).to(device) for f in _tensor_fields()},
                        extras={k: v.to(device) for k, v in self.extras.items()})

    def shard(self, rank: int, world: int) -> "Rollouts":
        """This rank's rows: a contiguous 1/world slice (whole groups stay together when
        the batch holds world * k groups)."""
        per = -(-len(self) // world)
        return self.select(torch.arange(rank * per, min((rank + 1) * per, len(self))))


def _tensor_fields():
    return [f for f in fields(Rollouts) if f.name != "extras"]


def _take(x: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    x = x[index]
    return x[:, :width] if x.dim() == 2 else x


def from_sample_batch(batch: SampleBatch) -> Rollouts:
    """Pad a SampleBatch's token columns into a Rollouts (the one copy of the path)."""
    t = batch.to_torch(["tokens", "loss_mask", "logprobs"], pad_to="max")
    lengths = torch.from_numpy(batch.lengths("tokens").astype(np.int64))
    width = t["tokens"].shape[1]
    attention = (torch.arange(width)[None, :] < lengths[:, None]).float()
    reward = batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float32)
    group = batch.column("group_id").to_pylist()
    group = [g if g is not None else f"\0row{i}" for i, g in enumerate(group)]
    _, group_index = np.unique(np.array(group, dtype=object), return_inverse=True)
    return Rollouts(
        tokens=t["tokens"].long(), attention_mask=attention, loss_mask=t["loss_mask"].float(),
        logprobs=t["logprobs"].float(), rewards=torch.from_numpy(np.nan_to_num(reward, nan=0.0)),
        group_index=torch.from_numpy(group_index.astype(np.int64)),
        policy_versions=torch.from_numpy(np.asarray(batch.policy_versions, dtype=np.int64)))


def micro_batches(lengths: torch.Tensor, token_budget: int) -> list[torch.Tensor]:
    """Row indices of micro-batches with rows x longest row <= token_budget.

    Rows are sorted longest first and cut greedily, so each micro-batch is padded to its
    first row and similar lengths share a pass. A row longer than the budget gets a
    micro-batch of its own. O(B log B).
    """
    order = torch.argsort(lengths, descending=True, stable=True)
    out: list[torch.Tensor] = []
    start = 0
    for i in range(1, len(order) + 1):  # loop over rows, not tokens
        if i == len(order) or (i - start + 1) * int(lengths[order[start]]) > token_budget:
            out.append(order[start:i])
            start = i
    return out


def minibatches(n: int, num: int, generator: torch.Generator | None = None,
                group_index: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Split rows 0..n-1 into ``num`` shuffled minibatches (one optimizer step each).
    With group_index, whole groups are shuffled and kept together."""
    if group_index is None:
        return list(torch.randperm(n, generator=generator).chunk(num))
    present = torch.unique(group_index)
    groups = present[torch.randperm(len(present), generator=generator)].chunk(num)
    return [torch.nonzero(torch.isin(group_index, g)).flatten() for g in groups]


def concat(parts: list[Rollouts]) -> Rollouts:
    """Stack Rollouts (without extras) row-wise, padding to the widest; group indices
    stay distinct."""
    width = max(p.tokens.shape[1] for p in parts)
    offset, out = 0, []
    for p in parts:
        pad = width - p.tokens.shape[1]
        out.append(replace(p, **{f.name: torch.nn.functional.pad(getattr(p, f.name), (0, pad))
                                 for f in _tensor_fields() if getattr(p, f.name).dim() == 2},
                           group_index=p.group_index + offset))
        offset += int(p.group_index.max()) + 1 if len(p) else 0
    return Rollouts(**{f.name: torch.cat([getattr(p, f.name) for p in out]) for f in _tensor_fields()})
