"""End to end: server, two producers and the GRPO trainer on "reverse three digits"
raise the mean reward (a real server subprocess, real producer subprocesses); the same
loop on a model, environment and reward of your own."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from expstore_rl import metrics


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_demo_raises_the_reward(tmp_path):
    cmd = [sys.executable, "-m", "expstore_rl.demo", "--steps", "80", "--seed", "0", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = tmp_path / "grpo-reverse"
    rows = metrics.read(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 81))
    reward = np.array([r["rollout/reward_mean"] for r in rows])
    # Means of 20 steps: which rollouts each step trains on follows the processes' timing,
    # so the curve moves with the machine's load. Here: 0.25 -> 0.55 alone, 0.25 -> 0.47
    # beside two busy cores, 0.20 -> 0.43 beside a second test suite; without learning the
    # two means differ by noise (~0.04).
    first, last = reward[:20].mean(), reward[-20:].mean()
    assert last > first + 0.12, (first, last)
    assert max(r["charts/policy_version"] for r in rows) == 80
    assert (out / "metrics.png").stat().st_size > 0
    assert "mean reward" in proc.stdout


@pytest.mark.slow
def test_the_demo_runs_your_model_env_and_reward(tmp_path, hf_model_dir):
    here = Path(__file__).resolve().parent  # tests/rl/user_code.py
    cmd = [sys.executable, "-m", "expstore_rl.demo", "--model", str(hf_model_dir), "--env", "user_code:Countdown",
           "--reward", "user_code:marked", "--steps", "3", "--producers", "1", "--warmup-steps", "5",
           "--group-size", "2", "--groups-per-step", "2", "--console-port", "0", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = metrics.read(tmp_path / "grpo-user_code.Countdown" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["rollout/reward_mean"] for r in rows] == [0.25] * 3  # user_code.marked scored countdown rows
