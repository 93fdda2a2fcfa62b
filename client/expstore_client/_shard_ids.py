"""Item ids across shards, and batches gathered from several shards.

A server numbers its items from 1 per table, so two shards hand out the same ids. The
sharded client returns *sharded ids*: ``shard << 48 | local_id`` (uint64), where
``shard`` is the shard's position in the sorted list of shard names. They stay plain
uint64 arrays (``SampleBatch.ids`` keeps its type, and trainer code passes them back
unchanged), they are independent of the order the servers were listed in, and they
hold for as long as the set of shards is the same.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from .batch import SampleBatch

LOCAL_BITS = 48
MAX_SHARDS = 1 << (64 - LOCAL_BITS)
_LOCAL_MASK = np.uint64((1 << LOCAL_BITS) - 1)


def encode(shard: int, local_ids: np.ndarray, shard_name: str = "") -> np.ndarray:
    """Sharded ids of one shard's item ids."""
    local = np.asarray(local_ids, dtype=np.uint64)
    if len(local) and int(local.max()) > int(_LOCAL_MASK):
        raise OverflowError(f"shard {shard_name or shard}: item id {int(local.max())} does not fit "
                            f"in the {LOCAL_BITS} bits of a sharded id")
    return (np.uint64(shard) << np.uint64(LOCAL_BITS)) | local


def decode(ids) -> tuple[np.ndarray, np.ndarray]:
    """(shard index, local id) of each sharded id."""
    ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
    return (ids >> np.uint64(LOCAL_BITS)).astype(np.int64), ids & _LOCAL_MASK


def by_shard(ids, num_shards: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """shard index -> (positions in ``ids``, local ids), for the shards the ids name."""
    shards, local = decode(ids)
    if len(shards) and int(shards.max()) >= num_shards:
        k = int(np.argmax(shards >= num_shards))
        raise ValueError(f"item id {int(local[k]) | int(shards[k]) << LOCAL_BITS} names shard {int(shards[k])}, "
                         f"but there are {num_shards} shards: not an id of this sharded client")
    order = np.argsort(shards, kind="stable")
    starts = np.searchsorted(shards[order], np.arange(num_shards + 1))
    return {k: (order[starts[k]:starts[k + 1]], local[order[starts[k]:starts[k + 1]]])
            for k in range(num_shards) if starts[k + 1] > starts[k]}


def concat(parts: Sequence[tuple[int, SampleBatch]], shard_names: list[str], with_weights: bool) -> SampleBatch:
    """One SampleBatch of (shard index, batch) parts, in that order, ids made sharded."""
    batches = [b for _, b in parts]

    def cat(name: str) -> np.ndarray | None:
        if not with_weights and name in ("probabilities", "weights"):
            return None
        return np.concatenate([getattr(b, name) for b in batches])

    data = batches[0].data if len(batches) == 1 else pa.concat_tables([b.data for b in batches])
    ids = np.concatenate([encode(k, b.ids, shard_names[k]) for k, b in parts])
    return SampleBatch(ids=ids, data=data, priorities=cat("priorities"), times_sampled=cat("times_sampled"),
                       policy_versions=cat("policy_versions"), probabilities=cat("probabilities"),
                       weights=cat("weights"))


def reorder(batch: SampleBatch, positions: np.ndarray) -> SampleBatch:
    """``batch`` whose row r came from position ``positions[r]`` of a request, put back
    in request order (``get`` asks each shard for its own ids)."""
    order = np.argsort(positions, kind="stable")
    return SampleBatch(ids=batch.ids[order], data=batch.data.take(pa.array(order)),
                       priorities=batch.priorities[order], times_sampled=batch.times_sampled[order],
                       policy_versions=batch.policy_versions[order])
