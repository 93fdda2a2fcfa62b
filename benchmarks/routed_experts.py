"""Bytes per token of the ``routed_experts`` column (R3 router replay), in memory and as
the SSD tier stores it, for a 64-layer MoE with top-8 of 256 experts.

Rows: 32 rollouts of 2,048 tokens (65,536 tokens; the column holds 32 MiB raw). Two
routings: ``uniform`` (each token's 8 experts drawn without replacement, uniformly: the
incompressible worst case) and ``sticky`` (expert popularity per layer ~ Zipf(1.2), and
each token keeps the previous token's experts in a layer with probability 0.5, as
neighbouring tokens often do). Formats:

- ``declared``: the table's column, ``list<fixed_size_list<fixed_size_list<uint8, 8>, 64>>``
  (one offset per row);
- ``nested int64`` (baseline): the same ids as a client sends them without the column
  declared, ``list<list<list<int64>>>`` (offsets at every level, 8-byte ids).

For each: Arrow bytes per token (memory tier) and zstd bytes per token as the SSD tier
writes them (``codec.encode_block``, level 1), with encode and decode time per token.
Prints JSON on the last line; ``python -m benchmarks.routed_experts`` (about 4 minutes on a
shared 2-core machine, most of it drawing the routings).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pyarrow as pa

from expstore import codec
from expstore.spec import RoutedExpertsSpec
from expstore_client.tensors import tensor_list

LAYERS, TOP_K, EXPERTS = 64, 8, 256
ROWS, TOKENS = 32, 2048


def routing(kind: str, rng: np.random.Generator) -> list[np.ndarray]:
    """ROWS arrays of (TOKENS, LAYERS, TOP_K) expert ids."""
    out = []
    for _ in range(ROWS):
        if kind == "uniform":
            ids = np.argsort(rng.random((TOKENS, LAYERS, EXPERTS)), axis=-1)[..., :TOP_K]
        else:
            popularity = 1.0 / np.arange(1, EXPERTS + 1) ** 1.2
            ids = np.empty((TOKENS, LAYERS, TOP_K), np.int64)
            for layer in range(LAYERS):
                p = rng.permutation(popularity / popularity.sum())
                keys = rng.random((TOKENS, EXPERTS)) ** (1 / p)  # top-k without replacement ~ p
                ids[:, layer] = np.argsort(-keys, axis=-1)[:, :TOP_K]
            keep = rng.random((TOKENS, LAYERS)) < 0.5
            for t in range(1, TOKENS):
                ids[t, keep[t]] = ids[t - 1, keep[t]]
        out.append(ids.astype(np.int64))
    return out


def measure(column: pa.Array) -> dict:
    batch = pa.record_batch([column], names=["routed_experts"])
    tokens = ROWS * TOKENS
    start = time.perf_counter()
    block = codec.encode_block(batch)
    encoded = time.perf_counter() - start
    start = time.perf_counter()
    codec.decode_block(block, batch.schema, "bench")
    decoded = time.perf_counter() - start
    return {"arrow_bytes_per_token": round(batch.nbytes / tokens, 1),
            "stored_bytes_per_token": round(len(block) / tokens, 1),
            "encode_ns_per_token": round(encoded / tokens * 1e9), "decode_ns_per_token": round(decoded / tokens * 1e9)}


def main() -> None:
    spec = RoutedExpertsSpec(LAYERS, TOP_K, EXPERTS)
    rng = np.random.default_rng(0)
    results = {}
    for kind in ("uniform", "sticky"):
        rows = routing(kind, rng)
        declared = tensor_list(rows, spec.arrow_type)
        nested = pa.array([r.tolist() for r in rows[:4]], pa.list_(pa.list_(pa.list_(pa.int64()))))
        nested = pa.concat_arrays([nested] * (ROWS // 4))  # same bytes per token, 8x less Python
        results[kind] = {"declared": measure(declared), "nested int64": measure(nested)}
        print(f"{kind:8s} declared {results[kind]['declared']}\n{'':8s} nested   {results[kind]['nested int64']}",
              file=sys.stderr)
    print(json.dumps({"layers": LAYERS, "top_k": TOP_K, "num_experts": EXPERTS, "tokens": ROWS * TOKENS,
                      "results": results}))


if __name__ == "__main__":
    main()
