"""Launch a training run against an expstore service: ``--producers`` rollout producers
and one trainer, as local processes or, with ``--ray``, as Ray actors.

    python -m expstore_rl.launch --producers 4 -- --target 127.0.0.1:50051 \\
        --weights-uri file:///tmp/weights --steps 500            # local processes
    python -m expstore_rl.launch --ray --ray-address auto --producers 64 \\
        --producer-gpus 1 --engine vllm -- --target expstore.rl:50051 \\
        --weights-uri s3://bucket/weights --steps 5000           # on a Ray cluster

The store stays outside Ray (a server, or shards: deploy/); the actors find it by the
trainer's ``--target`` ("host:port", or "host:port,host:port,..." for shards). Flags
before ``--`` are the launcher's and the producers'; flags after it are the trainer's
(``python -m expstore_rl.grpo --help``).
The bearer token (one for both roles) comes from EXPSTORE_TOKEN, or the trainer's
``--token``; producers receive it in their environment or as an actor argument, never
on a command line, which every local user can read.
What both sides must agree on (server, table, weights location, model directory
``--model``, sampling parameters, group size) is taken from the trainer's config and
handed to the producers, and the launcher makes the table and version 0 before either
starts, so no producer races the trainer to them. ``--env`` and ``--reward`` may name
your own code (``module:Class``, ``module:function``: plugins.py); they are imported here
first, so a typo stops the launch before anything starts.

Without ``--ray-address`` a single-node Ray is started here, on 127.0.0.1 only
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: otherwise Ray binds to the machine's other
address). When the trainer finishes, the producers are asked to stop: each stores the
groups it has in flight as partial rollouts (continued by the next run's producers) and
returns its metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from . import grpo, hf, plugins, ppo, trainer, weights
from .distributed import Dist

ALGOS = {"grpo": (grpo.GRPOConfig, grpo.train), "ppo": (ppo.PPOConfig, ppo.train)}


def build_parser() -> argparse.ArgumentParser:
    from .envs import ENVS
    p = argparse.ArgumentParser(prog="python -m expstore_rl.launch", description=__doc__.split("\n\n")[0],
                                epilog="Trainer flags follow `--`.")
    p.add_argument("--algo", choices=sorted(ALGOS), default="grpo")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--env", default="reverse", help=f"a built-in environment ({', '.join(sorted(ENVS))}) or module:Class")
    p.add_argument("--reward", default=None, help="the producers' reward: a name in expstore_rl.rewards or module:function")
    p.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    p.add_argument("--max-tokens", type=int, default=8, help="generated tokens per turn")
    p.add_argument("--max-turns", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=4, help="groups in flight per producer")
    p.add_argument("--group-size", type=int, default=1, help="answers per prompt for PPO (GRPO: the trainer's)")
    p.add_argument("--num-groups", type=int, default=None,
                   help="groups per producer (default: until the trainer finishes)")
    p.add_argument("--logs", default=None, help="local mode: a log file per producer in this dir")
    p.add_argument("--ray", action="store_true", help="run the producers and the trainer as Ray actors")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster ('auto'); default: start one here")
    p.add_argument("--producer-cpus", type=float, default=1.0)
    p.add_argument("--producer-gpus", type=float, default=0.0)
    p.add_argument("--trainer-cpus", type=float, default=1.0)
    p.add_argument("--trainer-gpus", type=float, default=0.0)
    return p


def producer_argv(a: argparse.Namespace, cfg: trainer.TrainConfig, index: int) -> list[str]:
    """Flags of ``python -m expstore_rl.producer`` for producer ``index``: the trainer's
    store, weights, model and sampling distribution; a seed of its own. Never the token: any
    local user can read a command line (/proc/PID/cmdline); producers get the trainer's
    token in their environment (``start_producer``) or as an actor argument."""
    argv = ["--server", cfg.target, "--table", cfg.table, "--weights-uri", cfg.weights_uri,
            "--env", a.env, "--engine", a.engine, "--group-size", str(getattr(cfg, "group_size", a.group_size)),
            "--seed", str(cfg.seed + 1 + index), "--max-tokens", str(a.max_tokens), "--max-turns", str(a.max_turns),
            "--concurrency", str(a.concurrency), "--temperature", str(cfg.temperature),
            "--top-k", str(cfg.top_k), "--top-p", str(cfg.top_p), "--log-every", "0"]
    argv += ["--model", cfg.model] if cfg.model else []
    argv += ["--reward", a.reward] if a.reward else []
    return argv + (["--num-groups", str(a.num_groups)] if a.num_groups is not None else [])


def prepare(a: argparse.Namespace, cfg: trainer.TrainConfig) -> None:
    """The table (if missing) and a published version 0 (if none; with ``--model``'s
    tokenizer files): what producers and trainer both need before they start."""
    from expstore_client import connect

    group_size = getattr(cfg, "group_size", None)
    batch = cfg.groups_per_step * group_size if group_size else cfg.batch_size
    with connect(cfg.target, cfg.token or None) as client:
        trainer.create_table(client, cfg, batch, group_size)
    if weights.latest_version(cfg.weights_uri) is None:
        policy, _ = trainer.initial_policy(cfg)
        trainer.publish(policy, cfg, 0, Dist())


class ProducerActor:
    """A producer in a Ray actor: ``run`` produces until ``stop`` (called on another of
    the actor's threads: the groups in flight are stored as partial) or ``num_groups``,
    then returns the producer's metrics."""

    def __init__(self, argv: list[str], token: str | None = None) -> None:
        import torch

        from .producer import from_args
        torch.set_num_threads(1)
        self.producer, self.num_groups = from_args(argv, token)
        self.stopping = threading.Event()

    def run(self) -> dict:
        return self.producer.run(self.num_groups, self.stopping)

    def stop(self) -> None:
        self.stopping.set()


class TrainerActor:
    """The trainer (single process), in a Ray actor or in this process; ``run`` returns
    where it ended."""

    def run(self, algo: str, cfg: trainer.TrainConfig) -> dict:
        state = ALGOS[algo][1](cfg)
        return {"steps": state.step, "policy_version": state.version}


def run_ray(a: argparse.Namespace, cfg: trainer.TrainConfig) -> dict[str, Any]:
    if a.ray_address is None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before `import ray`
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=a.ray_address or "local", include_dashboard=False)
    actors = []
    try:
        producer_cls = ray.remote(max_concurrency=2)(ProducerActor)  # run() and stop() at once
        producers = [producer_cls.options(num_cpus=a.producer_cpus, num_gpus=a.producer_gpus)
                     .remote(producer_argv(a, cfg, i), cfg.token or None) for i in range(a.producers)]
        trained = ray.remote(TrainerActor).options(num_cpus=a.trainer_cpus, num_gpus=a.trainer_gpus).remote()
        actors = producers + [trained]
        runs = [p.run.remote() for p in producers]
        result = ray.get(trained.run.remote(a.algo, cfg))
        ray.get([p.stop.remote() for p in producers])
        return {"trainer": result, "producers": ray.get(runs)}
    finally:
        for actor in actors:  # on a shared cluster nothing outlives the run, failed or not
            ray.kill(actor)
        if started:
            ray.shutdown()


def start_producer(argv: list[str], log: Path | None, token: str = "") -> subprocess.Popen:
    """``python -m expstore_rl.producer`` on one torch thread, its output to ``log``, the
    bearer token in its environment (EXPSTORE_TOKEN), never on its command line."""
    out = log.open("w") if log else subprocess.DEVNULL
    env = {k: v for k, v in os.environ.items() if k != "EXPSTORE_TOKEN"}
    env.update({"OMP_NUM_THREADS": "1"}, **({"EXPSTORE_TOKEN": token} if token else {}))
    try:
        return subprocess.Popen([sys.executable, "-m", "expstore_rl.producer", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    finally:
        if log:
            out.close()  # the child has its own copy


def run_local(a: argparse.Namespace, cfg: trainer.TrainConfig) -> dict[str, Any]:
    logs = Path(a.logs) if a.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    procs = [start_producer(producer_argv(a, cfg, i), logs / f"producer{i}.log" if logs else None, cfg.token)
             for i in range(a.producers)]
    try:
        return {"trainer": TrainerActor().run(a.algo, cfg)}
    finally:
        stop_processes(procs)


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM them all, then SIGKILL whichever has not exited within ``timeout``."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    a = build_parser().parse_args(argv[:cut])
    cfg = trainer.parse(ALGOS[a.algo][0], argv[cut + 1:])
    cfg.out = str(Path(cfg.out).absolute())  # actors may run elsewhere than this cwd
    if a.producers < 0:
        raise SystemExit("--producers must be >= 0")
    try:  # the producers' code, found here before any of them starts (they fail alone otherwise)
        plugins.env_factory(a.env)
        if a.reward:
            plugins.reward(a.reward)
        if cfg.model:
            hf.require_model_dir(cfg.model)
    except ValueError as e:
        raise SystemExit(f"python -m expstore_rl.launch: {e}") from None
    if cfg.model:
        cfg.model = str(Path(cfg.model).absolute())  # as out: actors may run elsewhere
    prepare(a, cfg)
    return (run_ray if a.ray else run_local)(a, cfg)


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
