"""What ranks share under torchrun: figures reduced over every rank's rows, and files one
rank writes that the others read. Two gloo processes on 127.0.0.1; this file is also the
torchrun worker (``__main__`` below)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from expstore_rl import distributed, grpo, ppo, trainer, weights
from expstore_rl.distributed import Dist

TINY = dict(hidden=64, heads=2, layers=2, intermediate=128)


def torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def value_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, returns, mask) of 8 rows; the second half's returns are shifted and its
    critic is worse, so that neither half's figure is the whole batch's."""
    g = torch.Generator().manual_seed(7)
    returns = torch.randn(8, 6, generator=g)
    returns[4:] += 3.0
    values = returns + 0.1 * torch.randn(8, 6, generator=g)
    values[4:] += torch.randn(4, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    return values, returns, mask


def test_explained_variance_over_two_ranks_is_the_figure_over_all_their_rows(tmp_path):
    values, returns, mask = value_batch()
    whole = ppo.explained_variance(values, returns, mask, Dist())
    halves = [ppo.explained_variance(values[s], returns[s], mask[s], Dist()) for s in (slice(0, 4), slice(4, 8))]
    assert all(abs(h - whole) > 0.05 for h in halves)  # a rank's own figure would be wrong
    proc = torchrun("explained-variance", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and abs(got[0] - whole) < 1e-12
    # closed, no thread of the group outlives it into the interpreter's shutdown
    for r in range(2):
        assert not [t for t in json.loads((tmp_path / f"rank{r}.threads").read_text()) if "gloo" in t]


def test_explained_variance_is_zero_when_the_returns_do_not_vary():
    returns = torch.full((3, 4), 0.1)
    assert ppo.explained_variance(torch.zeros(3, 4), returns, torch.ones(3, 4), Dist()) == 0.0
    values, returns, mask = value_batch()
    assert ppo.explained_variance(returns, returns, mask, Dist()) == 1.0


def test_a_fresh_run_loads_its_kl_reference_after_rank_0_has_published_it(tmp_path):
    # rank 0 takes 3 s to write v0; rank 1 must wait for it before loading the reference
    proc = torchrun("fresh-start", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert weights.versions(f"file://{tmp_path}/weights") == [0]
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]


def explained_variance_worker(d: Dist, out: Path) -> None:
    values, returns, mask = value_batch()
    mine = slice(4 * d.rank, 4 * d.rank + 4)
    figure = ppo.explained_variance(values[mine], returns[mine], mask[mine], d)
    (out / f"rank{d.rank}.json").write_text(json.dumps(figure))


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


def thread_names() -> list[str]:
    """The names of this process's threads, native ones included (Linux)."""
    return [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]


if __name__ == "__main__":  # the torchrun worker: <what> <dir>
    d = distributed.init()
    {"explained-variance": explained_variance_worker, "fresh-start": fresh_start_worker}[sys.argv[1]](
        d, Path(sys.argv[2]))
    distributed.close(d)
    (Path(sys.argv[2]) / f"rank{d.rank}.threads").write_text(json.dumps(thread_names()))
