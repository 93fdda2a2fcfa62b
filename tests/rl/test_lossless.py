"""Exactly-once training across crashes: a streaming trainer (``--stream``) killed with
SIGKILL, its server killed with SIGKILL, or both, resumes and trains every inserted row
exactly once, as the store's manifests of its steps show (each row in exactly one step's
manifest, none missing). Real server subprocesses; trainers as subprocesses where they
are killed, in this process where they are not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from expstore_client import Client
from expstore_rl import grpo, ppo, trainer

from integration._util import restartable_port, start_server  # tests/ is on sys.path (rootdir, prepend import mode)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TINY = ["--hidden", "64", "--heads", "2", "--layers", "1", "--intermediate", "64", "--max-positions", "16"]
STEPS, GROUP, GROUPS_PER_STEP = 6, 2, 2  # GRPO: 6 steps of 2 groups of 2 rows
PPO_BATCH = 4


def flags(target: str, root: Path, table: str, algo: str) -> list[str]:
    shape = (["--group-size", str(GROUP), "--groups-per-step", str(GROUPS_PER_STEP)] if algo == "grpo"
             else ["--batch-size", str(PPO_BATCH)])
    return ["--target", target, "--table", table, "--weights-uri", f"file://{root}/weights", "--out", str(root / "run"),
            "--steps", str(STEPS), "--checkpoint-every", "3", "--stream", "--max-staleness", "1000",
            "--sample-timeout", "120", "--store-retry-s", "120", "--token-budget", "64", *shape, *TINY]


def group_rows(g: int, n: int) -> list[dict]:
    """One GRPO group of n rows, as a producer would insert it: a 4-token prompt and 2-4
    generated tokens from the tiny model's vocabulary."""
    rng = np.random.default_rng(g)
    rows = []
    for i in range(n):
        gen = int(rng.integers(2, 5))
        tokens = [1] + rng.integers(7, 17, 3 + gen).tolist()
        rows.append({"traj_id": f"g{g}-{i}", "prompt_id": f"p{g}", "group_id": f"g{g}", "group_size": n,
                     "task": "reverse", "tokens": tokens, "loss_mask": [0] * 4 + [1] * gen,
                     "logprobs": [0.0] * 4 + (-rng.random(gen) - 0.1).tolist(), "policy_version": 0,
                     "reward": float(rng.random()), "finish_reason": "stop"})
    return rows


class Run:
    """The table a trainer reads, what was inserted into it, and the trainer's runs."""

    def __init__(self, tmp: Path, algo: str) -> None:
        self.root, self.algo, self.table = tmp, algo, f"{algo}_rollouts"
        self.server = start_server(tmp / "data", None, "--port", restartable_port())
        self.inserted: list[int] = []
        self.groups = 0
        size = GROUP if algo == "grpo" else 1
        batch = GROUP * GROUPS_PER_STEP if algo == "grpo" else PPO_BATCH
        self.cfg = trainer.parse(self.config_cls, self.flags())
        with Client(self.server.address) as c:
            trainer.create_table(c, self.cfg, batch, GROUP if algo == "grpo" else None)
        self.size, self.per_step = size, batch

    @property
    def config_cls(self):
        return grpo.GRPOConfig if self.algo == "grpo" else ppo.PPOConfig

    def flags(self) -> list[str]:
        return flags(self.server.address, self.root, self.table, self.algo)

    def insert_steps(self, steps: float) -> None:
        """Rows for ``steps`` more steps, a group (PPO: a row) per insert."""
        with Client(self.server.address) as c:
            for _ in range(round(steps * self.per_step / self.size)):
                self.inserted += c.insert(self.table, group_rows(self.groups, self.size)).item_ids.tolist()
                self.groups += 1

    def spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", f"expstore_rl.{self.algo}", *self.flags()],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})

    def train_here(self) -> trainer.LoopState:
        train = grpo.train if self.algo == "grpo" else ppo.train
        return train(trainer.parse(self.config_cls, self.flags()))

    def logged_steps(self) -> list[int]:
        path = self.root / "run" / "metrics.jsonl"
        return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_step(self, step: int, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + 300
        while not self.logged_steps() or max(self.logged_steps()) < step:
            assert proc is None or proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the trainer made no progress"
            time.sleep(0.02)

    def kill_server(self, same_port: bool) -> None:
        self.server.stop(signal.SIGKILL)
        port = ("--port", self.server.address.rsplit(":", 1)[1]) if same_port else ()
        self.server = start_server(self.server.data_dir, None, *port)

    def assert_every_row_trained_exactly_once(self) -> None:
        with Client(self.server.address) as c:
            trained = [i for step in range(1, STEPS + 1) for i in c.manifest(self.table, step)[0].tolist()]
        assert len(trained) == len(set(trained)), "a row was trained twice"
        assert sorted(trained) == sorted(self.inserted), "a row was never trained"

    def close(self) -> None:
        self.server.stop(signal.SIGKILL)


@pytest.fixture
def run(request, tmp_path):
    r = Run(tmp_path, request.param)
    yield r
    r.close()


@pytest.mark.parametrize("run", ["grpo", "ppo"], indirect=True)
def test_a_killed_trainer_resumes_at_its_checkpoints_cut(run):
    run.insert_steps(4.5)  # 4 steps, and half of step 5's rows: step 5 waits, half of it in flight
    proc = run.spawn()
    run.wait_for_step(4, proc)  # steps 1-4 committed, checkpoint 3: step 4 must be trained again
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run.insert_steps(1.5)
    state = run.train_here()
    assert state.step == STEPS
    assert run.logged_steps() == [1, 2, 3, 4, 4, 5, 6]  # step 4 again, from checkpoint 3
    run.assert_every_row_trained_exactly_once()


@pytest.mark.parametrize("run", ["ppo", "grpo"], indirect=True)
def test_a_trainer_rides_out_a_killed_server(run):
    run.insert_steps(4.5)
    result: list = []
    training = threading.Thread(target=lambda: result.append(run.train_here()))
    training.start()
    run.wait_for_step(2)
    run.kill_server(same_port=True)  # mid-step, wherever it is: the trainer retries its calls
    run.wait_for_step(4)
    time.sleep(0.5)  # step 5 waits for rows, half of them read: its read is lost with the server
    run.kill_server(same_port=True)
    run.insert_steps(1.5)
    training.join(300)
    assert result and result[0].step == STEPS
    assert run.logged_steps() == list(range(1, STEPS + 1))
    run.assert_every_row_trained_exactly_once()


@pytest.mark.parametrize("run", ["grpo"], indirect=True)
def test_trainer_and_server_killed_together(run):
    run.insert_steps(STEPS)
    proc = run.spawn()
    run.wait_for_step(1, proc)
    proc.send_signal(signal.SIGKILL)
    run.kill_server(same_port=False)
    proc.wait()
    state = run.train_here()  # against the restarted server, from checkpoint 0 or 3
    assert state.step == STEPS
    run.assert_every_row_trained_exactly_once()
