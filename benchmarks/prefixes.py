"""Shared prompt prefixes (expstore/prefixes.py): bytes per GRPO group, and their cost.

Engine only (in process, no gRPC). GRPO groups of 16 rows with a 2,048-token prompt and
512-token answers (``synthetic.trajectories(shared_prompts=True)``: int32 tokens, uint8
loss_mask, float32 logprobs), each group one ``Table.insert``, into the same table kinds
with ``share_prefixes`` off (the baseline) and on, in this one run:

- a memory table (``tiers = "memory"``): its ``memory_bytes`` per group;
- a durable table (``tiers = "ssd"``, durability wal) with a large memory cache: its
  ``ssd_bytes`` per group (IPC bytes written, before RocksDB's LZ4) and ``memory_bytes``;
- the same durable table with ``memory_bytes = 1``: every sample reads SSD blocks.

Timed per call with perf_counter (p50, p99, in ms): ``Table.insert`` of one group, and
``Table.sample(256)`` (uniform) of whole rows, from each; the off and on tables' calls
alternate, so that other load weighs on both alike. Prints JSON.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from time import perf_counter

import numpy as np

from expstore.catalog import Catalog
from expstore.spec import SamplerSpec, TableSpec
from expstore.synthetic import trajectories
from expstore.table import Table

GROUP, PROMPT, ANSWER, SAMPLE = 16, 2048, 512, 256
KINDS = ("memory table", "durable, cached", "durable, cold (memory_bytes=1)")


def _ms(times: list[float]) -> dict:
    ms = np.array(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def _table(kind: str, share: bool, root: Path) -> tuple[Table, Catalog | None]:
    spec = dict(name=f"t{int(share)}", share_prefixes=share, sampler=SamplerSpec("uniform"))
    if kind == "memory table":
        return Table(TableSpec(tiers="memory", memory_bytes=8 << 30, **spec), seed=0), None
    store = Catalog(root / f"{KINDS.index(kind)}-{int(share)}", seed=0)
    cold = kind.startswith("durable, cold")
    return store.create_table(TableSpec(tiers="ssd", memory_bytes=1 if cold else 8 << 30, **spec)), store


def measure(kind: str, groups: list, samples: int, root: Path) -> dict:
    """Both tables of a kind, off and on, their calls interleaved (insert a group into
    one, then the other; sample one, then the other), so that other load on the machine
    weighs on both alike."""
    tables = {share: _table(kind, share, root) for share in (False, True)}
    times = {share: {"insert": [], "sample": []} for share in tables}
    try:
        for g in groups:
            for share, (table, _) in tables.items():
                t0 = perf_counter()
                table.insert(g)
                times[share]["insert"].append(perf_counter() - t0)
        for i in range(samples + 1):
            for share, (table, _) in tables.items():
                t0 = perf_counter()
                table.sample(SAMPLE)
                if i:  # the first is a warm-up
                    times[share]["sample"].append(perf_counter() - t0)
        out = {}
        for share, (table, _) in tables.items():
            s = table.stats()
            out[str(share).lower()] = r = {"memory_bytes_per_group": s["memory_bytes"] / len(groups),
                                           "insert": _ms(times[share]["insert"][1:]),
                                           "sample": _ms(times[share]["sample"])}
            if "ssd_bytes" in s:
                r["ssd_bytes_per_group"] = s["ssd_bytes"] / len(groups)
        return out
    finally:
        for _, store in tables.values():
            if store is not None:
                store.close()


def run(quick: bool = False) -> dict:
    n_groups, samples = (24, 10) if quick else (96, 60)
    groups = [trajectories(GROUP, tokens=PROMPT + ANSWER, prompt_tokens=PROMPT, groups=1, shared_prompts=True,
                           seed=g, id_prefix=f"g{g}") for g in range(n_groups)]
    root = Path(tempfile.mkdtemp(prefix="bench-prefixes-"))
    try:
        results = {kind: measure(kind, groups, samples, root) for kind in KINDS}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"groups": n_groups, "group": {"rows": GROUP, "prompt_tokens": PROMPT, "answer_tokens": ANSWER,
                                          "arrow_bytes": groups[0].nbytes}, "kinds": results}


def render(r: dict) -> str:
    g = r["group"]
    lines = [f"Shared prompt prefixes: GRPO groups of {g['rows']} rows, {g['prompt_tokens']}-token prompt, "
             f"{g['answer_tokens']}-token answers ({g['arrow_bytes']} Arrow bytes a group as sent), "
             f"{r['groups']} groups; share_prefixes false (baseline) / true, same run",
             f"{'table':<32} {'bytes/group off':>16} {'on':>10} {'ratio':>6} "
             f"{'insert p50 off/on ms':>21} {'sample(256) p50 off/on ms':>26}"]
    for kind, by in r["kinds"].items():
        off, on = by["false"], by["true"]
        key = "ssd_bytes_per_group" if "ssd_bytes_per_group" in off else "memory_bytes_per_group"
        label = f"{kind} ({'SSD' if key.startswith('ssd') else 'memory'})"
        lines.append(f"{label:<32} {off[key]:>16.0f} {on[key]:>10.0f} {off[key] / on[key]:>5.2f}x "
                     f"{off['insert']['p50_ms']:>10.2f}/{on['insert']['p50_ms']:<10.2f} "
                     f"{off['sample']['p50_ms']:>12.2f}/{on['sample']['p50_ms']:<12.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    result = run(quick="--quick" in sys.argv)
    print(render(result), file=sys.stderr)
    print(json.dumps(result))
