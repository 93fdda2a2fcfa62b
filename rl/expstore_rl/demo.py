"""The whole loop on one CPU machine: an expstore server, two rollout producers and a
trainer, on a verifiable toy task with a tiny model built in code (no downloads).

    python -m expstore_rl.demo                      # GRPO on "reverse three digits"
    python -m expstore_rl.demo --algo ppo
    python -m expstore_rl.demo --env calculator     # multi-turn: the model must call a tool
    python -m expstore_rl.demo --model ./my-model --env mypkg.envs:MyEnv --reward mypkg.rewards:score

1. start ``expstore-server`` (a subprocess, a free port on 127.0.0.1, a temporary data dir)
   with its web console (``--console-port``, 8080 or a free port if that one is taken):
   the printed URL shows the run live, its trajectories and the reward-hacking views;
2. build the policy (the toy model, or ``--model``) and give it a short supervised
   warm-up on the environment's own solutions (tool calls included; ``warmup_examples``),
   so that RL starts from a small but non-zero reward (from a random init an exact-match
   reward is ~never seen); publish it as version 0;
3. create the table and start the producers (``python -m expstore_rl.producer``), which
   load version 0 and keep inserting groups, reloading each new version;
4. train in this process (GRPO or PPO) for ``--steps`` steps, publishing a version each;
5. stop everything, write ``<out>/metrics.jsonl`` and ``<out>/metrics.png``, and print the
   mean reward of the first and last steps.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from . import chat, grpo, launch, metrics, plugins, ppo, trainer
from .batching import Rollouts
from .distributed import Dist
from .losses import aggregate
from .model import token_logprobs
from .tokenizer import CharTokenizer

# Per environment: producer generation limits and warm-up strength. The reverse warm-up
# starts RL at reward ~0.25: from ~0.15 (30 steps) GRPO's entropy collapses first and the
# reward plateaus near 0.4 (docs/rl.md, "Demo").
ENV_SETTINGS = {
    "reverse": {"max_tokens": 6, "max_turns": 1, "warmup_steps": 45},
    "calculator": {"max_tokens": 16, "max_turns": 3, "warmup_steps": 100},
}
DEFAULT_SETTINGS = {"max_tokens": 16, "max_turns": 3, "warmup_steps": 100}
"""For an environment of your own (``--env module:Class``)."""
_OBS = re.compile(r"<obs>(.*?)</obs>", re.S)


def solution_ids(tok: chat.ChatFormat, prompt, solution: str, tools: bool) -> tuple[list[int], list[int]]:
    """(tokens, loss_mask) of a prompt and its solution as the producers would store
    them had the policy generated it: ``solution`` is the text of the policy's turns with
    each observation between them written ``<obs>...</obs>`` and an optional final
    ``<eos>`` (envs/base.py); turns get loss_mask 1 and the format's turn ends,
    observations the format's framing and loss_mask 0 (not the policy's to learn)."""
    ids = tok.prompt_ids(prompt)
    mask = [0] * len(ids)
    parts = _OBS.split(solution)  # turn, observation, turn, ..., turn
    for k, part in enumerate(parts):
        if k % 2:
            new, m = tok.observation_ids(part, "tool" if tools else "user", ids[-1]), 0
        else:
            final = k == len(parts) - 1
            new, m = tok.turn_ids(part.removesuffix("<eos>") if final else part, final), 1
        ids, mask = ids + new, mask + [m] * len(new)
    return ids, mask


def warmup_examples(env: str, n: int, seed: int, tok: chat.ChatFormat | None = None) -> Rollouts:
    """n prompts of environment ``env`` (a built-in name or module:Class) with its
    solutions (``solution_ids``), in ``tok``'s format (default: CharTokenizer)."""
    tok, make, rng = tok or CharTokenizer(), plugins.env_factory(env), random.Random(seed)
    rows = []
    for _ in range(n):
        e = make()
        task = e.sample_task(rng)
        rows.append(solution_ids(tok, e.reset(task), e.solution(task), bool(e.tools)))
    width = max(len(t) for t, _ in rows)
    tokens = torch.tensor([t + [tok.pad_id] * (width - len(t)) for t, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    attention = (torch.arange(width)[None] < torch.tensor([len(t) for t, _ in rows])[:, None]).float()
    zeros = torch.zeros(n)
    return Rollouts(tokens, attention, mask, torch.zeros_like(mask), zeros, torch.arange(n), zeros.long())


def supervised_warmup(model: torch.nn.Module, examples: Rollouts, steps: int, lr: float = 3e-3,
                      batch: int = 64, seed: int = 0) -> float:
    """Teacher-forced cross-entropy on the loss_mask tokens of ``examples`` (prompt +
    correct answer, ``warmup_examples``): a few steps give the fresh model the answer
    format, so that RL starts from a non-zero reward. Returns the last loss."""
    opt = trainer.make_optimizer(model, lr, 0.0)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    model.train()
    for _ in range(steps):
        mb = examples.select(torch.randint(len(examples), (batch,), generator=gen))
        logp = token_logprobs(model(input_ids=mb.tokens).logits, mb.tokens)  # (b, t)
        loss = -aggregate(logp, mb.loss_mask, "token-mean")
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


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
        proc.wait()  # its data dir is free again
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
    p.add_argument("--env", default="reverse", help="reverse, calculator, or an environment of yours: module:Class")
    p.add_argument("--reward", default=None, help="the producers' reward: a name in expstore_rl.rewards or module:function")
    p.add_argument("--model", default="", help="a Hugging Face causal LM directory (default: the toy model)")
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
    try:
        plugins.env_factory(a.env)
        if a.reward:
            plugins.reward(a.reward)
    except ValueError as e:
        p.error(str(e))
    settings = ENV_SETTINGS.get(a.env, DEFAULT_SETTINGS)
    out = Path(a.out) / f"{a.algo}-{a.env.replace(':', '.')}"
    out.mkdir(parents=True, exist_ok=True)
    for stale in (out / "metrics.jsonl", out / "metrics.png"):
        stale.unlink(missing_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="expstore-demo-") as tmp:
        weights_uri = f"file://{tmp}/weights"
        common = dict(model=str(Path(a.model).absolute()) if a.model else "", weights_uri=weights_uri, out=str(out),
                      steps=a.steps, seed=a.seed, lr=a.lr,
                      num_minibatches=a.num_minibatches, entropy_coef=a.entropy_coef,
                      kl_coef=a.kl_coef,
                      checkpoint_every=0, resume=False, table="rollouts",
                      archive=bool(a.console_port))  # the console shows every step's items
        batch = a.groups_per_step * a.group_size
        cfg = (grpo.GRPOConfig(**common, group_size=a.group_size, groups_per_step=a.groups_per_step)
               if a.algo == "grpo" else ppo.PPOConfig(**common, batch_size=batch))

        # 2. warm-up and version 0
        model = trainer.build_policy(cfg)
        tok = chat.HFChat.from_pretrained(a.model) if a.model else CharTokenizer()
        steps = settings["warmup_steps"] if a.warmup_steps is None else a.warmup_steps
        loss = supervised_warmup(model, warmup_examples(a.env, 2048, a.seed, tok), steps, seed=a.seed)
        trainer.publish(model, cfg, 0, Dist())
        print(f"warm-up: {steps} supervised steps, loss {loss:.3f}; published v0", flush=True)

        # 1, 3, 4. server, table, producers; train here
        try:
            server, address, console = start_server(Path(tmp) / "data",
                                                    free_port(a.console_port) if a.console_port else 0)
        except RuntimeError:
            if not a.console_port:
                raise
            # another process took the console's port between free_port and the server's bind
            server, address, console = start_server(Path(tmp) / "data", free_port(0))
        try:
            cfg.target = address
            s = settings
            flags = launch.build_parser().parse_args(
                ["--algo", a.algo, "--producers", str(a.producers), "--env", a.env, "--group-size", str(a.group_size),
                 "--max-tokens", str(s["max_tokens"]), "--max-turns", str(s["max_turns"]), "--logs", str(out)]
                + (["--reward", a.reward] if a.reward else []))
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
