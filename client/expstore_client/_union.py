"""Sampling a sharded table as if it were one table holding the union of the shards.

One draw from the union picks shard k with probability m_k / M, where m_k is the
shard's *mass*, then an item inside the shard with the shard's own sampler. So a batch
is split across the shards by one random draw over the masses, each shard samples its
share, and the probability of item i over the union is ``P(i) = P_k(i) * m_k / M``:

- uniform: m_k = the shard's eligible items N_k (``sampler_eligible``):
  P(i) = 1/N_k * N_k/N = 1/N. The split is multinomial (draws with replacement).
- prioritized(alpha, beta): m_k = the shard's sum of ``priority ** alpha``
  (``sampler.total_priority``): P(i) = p_i^alpha / T_k * T_k/T = p_i^alpha / T, as one sum
  tree over the union. When every shard's sum is 0, m_k = N_k (the single table's uniform
  fallback). The importance weights ``(N P(i)) ** -beta / max_batch (N P(j)) ** -beta`` equal
  ``(P(i) / min_batch P) ** -beta`` (N cancels), so they are recomputed over the merged
  batch from the union's P(i): the weights one table would return.
- group (uniform order): m_k = the shard's complete groups G_k. A batch is
  ``batch_size / group_size`` DISTINCT groups, so the split is multivariate
  hypergeometric (a uniform subset of the union's groups); P = 1/G_k * G_k/G = 1/G.
- task_weights over any of these: m_k = the shard's items (complete groups for a group
  sampler) of the tasks with a weight > 0, and each shard mixes its share by task. Exact
  when the shards hold the tasks in equal proportions (hash placement makes that
  likely); the shards' weights pass through.

The masses come from Stats, cached for a short TTL. The P(i) reported is the probability
of the draw actually made with those masses, so importance weights correct for the
sampling that happened even while the cache lags; with a fresh cache they are the
single table's. When a shard fails (down), its share is drawn again over the others, so
the batch is distributed over the union of the shards that answered.

Samplers that order items globally (fifo, lifo, max_heap, min_heap, group order fifo)
have no proportional form: the sharded client refuses to sample them (stream instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .batch import SampleBatch

PROPORTIONAL = ("uniform", "prioritized", "group")


@dataclass(frozen=True)
class UnionSampler:
    """How a table's sampler is spread over shards (see the module docstring)."""

    table: str
    type: str
    beta: float = 0.0
    group_size: int = 1
    task_weights: Mapping[str, float] | None = None

    @classmethod
    def of(cls, table: str, sampler: Mapping[str, Any]) -> "UnionSampler":
        """From a table's sampler config (``TableInfo.config["sampler"]``)."""
        kind = sampler.get("type", "uniform")
        if kind not in PROPORTIONAL or (kind == "group" and sampler.get("group_order", "uniform") != "uniform"):
            order = f" with group_order {sampler.get('group_order')!r}" if kind == "group" else ""
            raise ValueError(f"table {table!r}: the {kind!r} sampler{order} orders items across the whole table, "
                             f"which shards cannot sample as one; stream() the table, or sample one shard "
                             f"(ShardedClient.shard(name))")
        return cls(table, kind, beta=float(sampler.get("beta", 0.0)) if kind == "prioritized" else 0.0,
                   group_size=int(sampler.get("group_size", 1)) if kind == "group" else 1,
                   task_weights=dict(sampler["task_weights"]) if sampler.get("task_weights") else None)

    # -- masses ---------------------------------------------------------------------

    def masses(self, stats: list[Mapping[str, float] | None]) -> np.ndarray:
        """Each shard's mass from its table stats (None: the shard is down: 0)."""
        if self.task_weights is not None:
            unit = "complete_groups" if self.type == "group" else "items"
            return np.array([self._task_units(s, unit) if s else 0.0 for s in stats])
        if self.type == "group":
            return np.array([s.get("sampler.complete_groups", 0.0) if s else 0.0 for s in stats])
        counts = np.array([s.get("sampler_eligible", 0.0) if s else 0.0 for s in stats])
        if self.type == "prioritized":
            priority = np.array([s.get("sampler.total_priority", 0.0) if s else 0.0 for s in stats])
            return priority if priority.sum() > 0 else counts
        return counts

    def _task_units(self, stats: Mapping[str, float], unit: str) -> float:
        default = self.task_weights.get("*", 0.0)
        total = 0.0
        for key, value in stats.items():
            if key.startswith("sampler.task.") and key.endswith("." + unit):
                task = key[len("sampler.task."):-len(unit) - 1]
                total += value if self.task_weights.get(task, default) > 0 else 0.0
        return total

    # -- splitting a batch ----------------------------------------------------------

    def units(self, batch_size: int) -> int:
        """Draws of the batch: items, or whole groups for a group sampler."""
        if batch_size < 0:
            raise ValueError(f"table {self.table!r}: batch_size must be >= 0, got {batch_size}")
        if batch_size % self.group_size:
            raise ValueError(f"table {self.table!r}: the group sampler returns whole groups: batch_size="
                             f"{batch_size} is not a multiple of group_size={self.group_size}")
        return batch_size // self.group_size

    @staticmethod
    def draw_masses(masses: np.ndarray, up: np.ndarray) -> np.ndarray:
        """The masses a batch is drawn with: 0 for shards that are down; when the shards
        that are up hold nothing yet, equal, so that they all wait as one table would."""
        masses = np.where(up, masses, 0.0)
        return masses if masses.sum() > 0 else up.astype(float)

    def split(self, units: int, masses: np.ndarray, up: np.ndarray, taken: np.ndarray,
              rng: np.random.Generator) -> np.ndarray:
        """Units per shard for ``units`` more draws over the shards that are ``up``;
        ``taken``: the units they already serve in this batch (groups are distinct)."""
        draw = self.draw_masses(masses, up)
        if self.type != "group":
            return rng.multinomial(units, draw / draw.sum())
        room = np.maximum(np.floor(np.where(up, masses, 0.0)) - taken, 0).astype(np.int64)
        if units <= room.sum():
            return rng.multivariate_hypergeometric(room, units)
        # Fewer complete groups than asked for: every shard serves what it has and the
        # rest is spread by mass, where the shards wait for groups as one table would.
        return room + rng.multinomial(units - int(room.sum()), draw / draw.sum())

    # -- merging the shards' batches ------------------------------------------------

    def reweight(self, batch: SampleBatch, shard_of_row: np.ndarray, masses: np.ndarray) -> SampleBatch:
        """The merged batch with the union's probabilities and importance weights;
        ``masses``: the ``draw_masses`` of the shards that served it (0 for the others)."""
        probabilities = batch.probabilities * (masses[shard_of_row] / masses.sum())
        weights = batch.weights
        if self.task_weights is None:
            weights = np.ones(len(batch))
            if self.beta > 0 and len(batch):
                weights = (probabilities / probabilities.min()) ** -self.beta
        batch.probabilities, batch.weights = probabilities, weights
        return batch
