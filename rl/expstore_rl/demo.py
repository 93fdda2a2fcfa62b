"""The whole loop on one CPU machine: an expstore server, two rollout producers and a
trainer, on a verifiable toy task with a tiny model built in code (no downloads).

    python -m expstore_rl.demo                      # GRPO on "reverse three digits"
    python -m expstore_rl.demo --algo ppo
    python -m expstore_rl.demo --env calculator     # multi-turn: the model must call a tool

1. start ``expstore-server`` (a subprocess, a free port on 127.0.0.1, a temporary data dir)
   with its web console (``--console-port``, 8080 or a free port if that one is taken):
   the printed URL shows the run live, its trajectories and the reward-hacking views;
2. build the policy and give it a short supervised warm-up on the environment's own
   solutions (tool calls included), so that RL starts from a small but non-zero reward
   (from a random init an exact-match reward is ~never seen); publish it as version 0;
3. create the table and start the producers (``python -m expstore_rl.producer``), which
   load version 0 and keep inserting groups, reloading each new version;
4. train in this process (GRPO or PPO) for ``--steps`` steps, publishing a version each;
5. stop everything, write ``<out>/metrics.jsonl`` and ``<out>/metrics.png``, and print the
   mean reward of the first and last steps.
"""

from __future__ import annotations

import argparse
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from . import grpo, launch, metrics, ppo, trainer, weights
from .batching import Rollouts
from .envs import ENVS
from .model import build_model
from .tokenizer import CharTokenizer

# Per environment: producer generation limits and warm-up strength. The reverse warm-up
# starts RL at reward ~0.25: from ~0.15 (30 steps) GRPO's entropy collapses first and the
# reward plateaus near 0.4 (docs/rl.md, "Demo").
ENV_SETTINGS = {
    "reverse": {"max_tokens": 6, "max_turns": 1, "warmup_steps": 45},
    "calculator": {"max_tokens": 16, "max_turns": 3, "warmup_steps": 100},
}


def warmup_examples(env_name: str, n: int, seed: int) -> Rollouts:
    """n prompts with their environment's solution, as the producers would tokenise them:
    <bos> prompt, then the solution with loss_mask 1 except inside <obs>...</obs> (tool
    output is not the policy's to learn)."""
    tok, env, rng = CharTokenizer(), ENVS[env_name](), random.Random(seed)
    rows = []
    for _ in range(n):
        task = env.sample_task(rng)
        prompt, answer = [tok.bos_id] + tok.encode(env.reset(task)), np.array(tok.encode(env.solution(task)))
        depth = np.cumsum(answer == tok.obs_id) - np.cumsum(np.r_[0, answer[:-1] == tok.obs_end_id])
        rows.append((prompt + answer.tolist(), [0] * len(prompt) + (depth == 0).astype(int).tolist()))
    width = max(len(t) for t, _ in rows)
    tokens = torch.tensor([t + [tok.pad_id] * (width - len(t)) for t, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    attention = (tokens != tok.pad_id).float()
    zeros = torch.zeros(n)
    return Rollouts(tokens, attention, mask, torch.zeros_like(mask), zeros, torch.arange(n), zeros.long())


def start_server(data_dir: Path, console_port: int = 0) -> tuple[subprocess.Popen, str, str | None]:
    """expstore-server on a free loopback port, with the web console on ``console_port``
    (0: none); returns once it prints its address (and the console's URL)."""
    cmd = [sys.executable, "-m", "expstore_server.main", "--port", "0", "--data-dir", str(data_dir)]
    if console_port:
        cmd += ["--http-port", str(console_port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("expstore-server listening on "):
        proc.kill()
        raise RuntimeError(f"expstore-server did not start: {line!r}")
    url = proc.stdout.readline().rsplit(" ", 1)[1].strip() if console_port else None
    return proc, line.rsplit(" ", 1)[1].strip(), url


def free_port(preferred: int) -> int:
    """``preferred`` if nothing listens on it on 127.0.0.1, else a free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m expstore_rl.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--algo", choices=["grpo", "ppo"], default="grpo")
    p.add_argument("--env", choices=sorted(ENV_SETTINGS), default="reverse")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=None, help="supervised steps before RL (default: per env)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--num-minibatches", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--kl-coef", type=float, default=1e-3, help="KL-to-reference loss weight (0: no reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--console-port", type=int, default=8080,
                   help="the web console's port (a free one if taken; 0: no console)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below
    out = Path(a.out) / f"{a.algo}-{a.env}"
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "metrics.jsonl", out / "metrics.png"):
        stale.unlink(missing_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="expstore-demo-") as tmp:
        weights_uri = f"file://{tmp}/weights"
        common = dict(weights_uri=weights_uri, out=str(out), steps=a.steps, seed=a.seed, lr=a.lr,
                      num_minibatches=a.num_minibatches, entropy_coef=a.entropy_coef,
                      kl_coef=a.kl_coef,
                      checkpoint_every=0, resume=False, table="rollouts",
                      archive=bool(a.console_port))  # the console shows every step's items
        batch = a.groups_per_step * a.group_size
        cfg = (grpo.GRPOConfig(**common, group_size=a.group_size, groups_per_step=a.groups_per_step)
               if a.algo == "grpo" else ppo.PPOConfig(**common, batch_size=batch))

        # 2. warm-up and version 0
        model = build_model(cfg.model_config(), cfg.seed)
        steps = ENV_SETTINGS[a.env]["warmup_steps"] if a.warmup_steps is None else a.warmup_steps
        loss = trainer.supervised_warmup(model, warmup_examples(a.env, 2048, a.seed), steps, seed=a.seed)
        weights.publish(model.state_dict(), model.config.to_dict(), weights_uri, 0)
        print(f"warm-up: {steps} supervised steps, loss {loss:.3f}; published v0", flush=True)

        # 1, 3, 4. server, table, producers; train here
        server, address, console = start_server(Path(tmp) / "data",
                                                free_port(a.console_port) if a.console_port else 0)
        try:
            cfg.target = address
            s = ENV_SETTINGS[a.env]
            flags = launch.build_parser().parse_args(
                ["--algo", a.algo, "--producers", str(a.producers), "--env", a.env, "--group-size", str(a.group_size),
                 "--max-tokens", str(s["max_tokens"]), "--max-turns", str(s["max_turns"]), "--logs", str(out)])
            launch.prepare(flags, cfg)
            print(f"server {address}, {a.producers} producers, training {a.algo} on {a.env}", flush=True)
            if console:
                print(f"console: {console}  (live: tables, trajectories, /manifest?table=rollouts&step=N, "
                      f"/hacking?table=rollouts)", flush=True)
            launch.run_local(flags, cfg)
        finally:
            launch.stop_processes([server])

    # 5. summary
    rows = metrics.read(out / "metrics.jsonl")
    rewards = [r["rollout/reward_mean"] for r in rows]
    k = max(1, min(10, len(rewards) // 5))
    summary = {"algo": a.algo, "env": a.env, "steps": len(rows), "reward_first": float(np.mean(rewards[:k])),
               "reward_last": float(np.mean(rewards[-k:])), "wall_seconds": time.perf_counter() - t_start,
               "out": str(out)}
    print(f"{a.algo} on {a.env}: mean reward {summary['reward_first']:.3f} (first {k} steps) -> "
          f"{summary['reward_last']:.3f} (last {k}) in {len(rows)} steps, {summary['wall_seconds']:.0f}s; "
          f"plot: {out / 'metrics.png'}", flush=True)
    return summary


if __name__ == "__main__":
    run()
