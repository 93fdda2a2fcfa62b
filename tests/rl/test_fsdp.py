"""GRPO and PPO steps under FSDP2 on 2 gloo processes (torchrun, 127.0.0.1) equal the same
steps in one process (PPO: policy and critic both sharded), for the toy model and for a
Hugging Face model directory (``--model``). This file is also the torchrun worker
(``__main__`` below)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import pytest

from expstore_rl import distributed, grpo, ppo, weights
from expstore_rl.batching import Rollouts
from expstore_rl.trainer import Sampled

TINY = dict(hidden=64, heads=2, layers=2, intermediate=128)  # head_dim 32


class FakeSource:
    """Stands in for the store: batch k depends only on the policy version k it follows,
    so a resumed run sees the batches an uninterrupted one would. Rows look like the toy
    task: a 4-token prompt, 2-6 generated tokens, groups of ``group_size``, a reward
    that prefers the token 8 after the prompt, stale behaviour logprobs."""

    def __init__(self, batch: int = 16, group_size: int = 4, width: int = 10, prompt: int = 4) -> None:
        self.batch, self.group_size, self.width, self.prompt = batch, group_size, width, prompt
        self.version = 0

    stream = False  # sampled, like the store's default mode: no cuts

    def start(self, step: int, resumed: bool) -> None:
        pass

    def set_policy_version(self, version: int) -> None:
        self.version = version

    def next(self, step: int) -> Sampled:
        g = torch.Generator().manual_seed(1000 + self.version)
        B, T, P = self.batch, self.width, self.prompt
        lengths = torch.randint(P + 2, T + 1, (B,), generator=g)
        attention = (torch.arange(T)[None] < lengths[:, None]).float()
        mask = attention.clone()
        mask[:, :P] = 0
        tokens = torch.randint(7, 17, (B, T), generator=g) * attention.long()
        logprobs = -torch.rand(B, T, generator=g) * 3 * mask
        rewards = (tokens[:, P] == 8).float() + 0.1 * torch.rand(B, generator=g)
        rows = Rollouts(tokens, attention, mask, logprobs, rewards, torch.arange(B) // self.group_size,
                        torch.full((B,), max(0, self.version - 1)))
        return Sampled(rows, 0.0)


COMMON = dict(steps=2, token_budget=24, kl_coef=0.1, entropy_coef=0.01, checkpoint_every=0, lr=1e-3, **TINY)


def config(root: Path, **overrides) -> grpo.GRPOConfig:
    return grpo.GRPOConfig(**{**COMMON, "weights_uri": f"file://{root}/weights", "out": str(root / "run"),
                              "group_size": 4, "groups_per_step": 4, **overrides})


def ppo_config(root: Path) -> ppo.PPOConfig:
    return ppo.PPOConfig(**{**COMMON, "weights_uri": f"file://{root}/weights", "out": str(root / "run"),
                            "batch_size": 16})


def run(algo: str, root: Path, model: str = "") -> None:
    if algo == "grpo":
        grpo.train(config(root, model=model), FakeSource())
    else:
        ppo.train(ppo_config(root), FakeSource())


@pytest.mark.parametrize("algo,own_model", [("grpo", False), ("ppo", False), ("grpo", True)],
                         ids=["grpo", "ppo", "grpo-own-model"])
def test_two_process_fsdp_step_equals_the_single_process_step(tmp_path, algo, own_model, request):
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    model = str(request.getfixturevalue("hf_model_dir")) if own_model else ""
    run(algo, single, model)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, algo, str(sharded), model]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    a = weights.load_state_dict(f"file://{single}/weights", 2)
    b = weights.load_state_dict(f"file://{sharded}/weights", 2)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=2e-5, rtol=1e-4), k
    moved = max(float((a[k] - weights.load_state_dict(f"file://{single}/weights", 0)[k]).abs().max()) for k in a)
    assert moved > 1e-4  # the step did change the weights
    m1, m2 = ([json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
              for root in (single, sharded))
    keys = ["losses/policy", "losses/kl", "policy/entropy", "offpolicy/is_weight_mean", "optim/grad_norm"]
    for key in keys + (["losses/value", "ppo/return_mean", "ppo/explained_variance", "optim/critic_grad_norm"] if algo == "ppo" else []):
        assert abs(m1[-1][key] - m2[-1][key]) <= 1e-4 * max(1.0, abs(m1[-1][key])), key
    assert (sharded / "run" / "checkpoints" / "latest").exists()  # DCP save under FSDP
    if own_model:  # rank 0 published whole model directories
        assert (sharded / "weights" / "v2" / "tokenizer.json").read_bytes() == Path(model, "tokenizer.json").read_bytes()


if __name__ == "__main__":  # the torchrun worker: <algo> <root> <model or "">
    run(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    distributed.close()
