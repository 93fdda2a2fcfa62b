"""What ranks share under torchrun: figures reduced over every rank's rows, and files one
rank writes that the others read. Two gloo processes on 127.0.0.1; this file is also the
torchrun worker (``__main__`` below)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from expstore_rl import distributed, grpo, trainer, weights
from expstore_rl.distributed import Dist

TINY = dict(hidden=64, heads=2, layers=2, intermediate=128)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_a_fresh_run_loads_its_kl_reference_after_rank_0_has_published_it(tmp_path):
    # rank 0 takes 3 s to write v0; rank 1 must wait for it before loading the reference
    proc = torchrun("fresh-start", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert weights.versions(f"file://{tmp_path}/weights") == [0]
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]


def fresh_start_worker(d: Dist, root: Path) -> None:
    if d.main:
        publish = weights.publish

        def slow_publish(*args, **kwargs):
            time.sleep(3.0)
            return publish(*args, **kwargs)

        weights.publish = slow_publish
    cfg = grpo.GRPOConfig(weights_uri=f"file://{root}/weights", out=str(root / "run"), kl_coef=0.1,
                          checkpoint_every=0, **TINY)
    policy, version = trainer.initial_policy(cfg)
    policy = distributed.shard(policy, d)
    pairs = {"policy": (policy, trainer.make_optimizer(policy, cfg.lr, cfg.weight_decay))}
    state = trainer.start(cfg, pairs, policy, version, None, d)
    reference = trainer.reference_model(cfg, state, d)
    assert state.version == 0 and reference is not None
    (root / f"rank{d.rank}.ok").write_text("")


if __name__ == "__main__":  # the torchrun worker: <what> <dir>
    d = distributed.init()
    {"fresh-start": fresh_start_worker}[sys.argv[1]](
        d, Path(sys.argv[2]))
    distributed.close()
