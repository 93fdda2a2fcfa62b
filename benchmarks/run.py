"""``make bench``: run every benchmark, print the tables, write bench-results/latest.json.

``python -m benchmarks.run [--quick] [--only wire,memory,engine,concurrency,tiers,sharding,prefixes] [--json PATH]``

Each benchmark module runs in its own subprocess (``python -m benchmarks.X``, which
prints JSON), so every measurement starts from a fresh process, and the wire and memory
benchmarks run twice: with glibc's default malloc settings and with
``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824`` set for the
benchmark process and, by inheritance, every server it starts (raw ceiling and expstore).
``--quick`` is a 1-2 minute smoke run; the default full run takes at most ~10 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa

from . import agentic_scale, prefixes, report, sharding, tiers

GLIBC = {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "1073741824"}
ENVS = {"default": {}, "glibc": GLIBC}
JOBS = [("wire", "default"), ("wire", "glibc"), ("memory", "default"), ("memory", "glibc"),
        ("engine", "default"), ("concurrency", "default"), ("tiers", "default"), ("sharding", "default"),
        ("agentic_scale", "default"), ("prefixes", "default")]
ROOT = Path(__file__).resolve().parents[1]


def run_job(module: str, env_name: str, quick: bool, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in GLIBC}
    env.update(ENVS[env_name])
    cmd = [sys.executable, "-m", f"benchmarks.{module}"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 1-2 minute smoke run")
    p.add_argument("--only", help="comma-separated subset of: wire, memory, engine, concurrency, tiers, sharding, prefixes")
    p.add_argument("--json", type=Path, default=ROOT / "bench-results" / "latest.json")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    started = time.time()
    results: dict = {"meta": {
        "mode": "quick" if args.quick else "full", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
        "pyarrow": pa.__version__, "numpy": np.__version__, "machine": platform.platform(),
        "envs": {k: " ".join(f"{a}={b}" for a, b in v.items()) for k, v in ENVS.items()}}}
    for module, env_name in JOBS:
        if only and module not in only:
            continue
        label = f"{module} [{env_name}]"
        print(f"[{time.time() - started:5.0f} s] {label} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        try:
            out = run_job(module, env_name, args.quick, timeout=300 if args.quick else 600)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            print(f"         {label} FAILED: {e}", file=sys.stderr, flush=True)
            results.setdefault("failed", {})[label] = str(e)
            continue
        if module in ("wire", "memory"):
            results.setdefault(module, {})[env_name] = out
        else:
            results[module] = out
        print(f"         {label} done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    results["meta"]["elapsed_s"] = time.time() - started
    text = report.render(results)
    if "tiers" in results:
        text += "\n\n" + tiers.render(results["tiers"])
    if "sharding" in results:
        text += "\n\n" + sharding.render(results["sharding"])
    if "agentic_scale" in results:
        text += "\n\n" + agentic_scale.render(results["agentic_scale"])
    if "prefixes" in results:
        text += "\n\n" + prefixes.render(results["prefixes"])
    print(text)
    report.write_json(results, args.json)
    print(f"\nJSON: {args.json}")
    return 1 if results.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
