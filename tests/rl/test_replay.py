"""``expstore replay --tools expstore_rl.tools`` re-runs the tool calls that the agent
recorded (docs/cli.md): each entry of ``tools.TOOLS`` is a function of the arguments
string that returns the recorded ``tool_result``."""

from __future__ import annotations

import os
import subprocess
import sys

from expstore_client import Client
from expstore_rl import tools
from expstore_rl.envs import Calculator

from .test_agent import Scripted, rollout


def replay(address: str, item_id: int, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expstore_server.cli", "--server", address, "replay", "rollouts",
                           str(item_id), "--tools", "expstore_rl.tools"], capture_output=True, text=True, cwd=cwd,
                          env=os.environ, timeout=120)


def test_a_tool_is_a_function_of_its_arguments_that_returns_the_recorded_result():
    assert tools.TOOLS["calc"]("12*7").strip() == "84" and tools.TOOLS["calc"]("7/2").strip() == "7/2"


def test_replay_of_recorded_tool_calls_reproduces_them_and_shows_a_real_divergence(server_factory, tmp_path):
    rows = rollout(Scripted(["<tool>calc 12*7</tool>", "84<eos>"]), [Calculator(), Calculator()])
    assert [r["turns"][2]["tool_result"].strip() for r in rows] == ["84", "84"]  # recorded by the sandbox
    rows[1]["turns"][2]["tool_result"] = "85\n"  # as if the tool had answered otherwise when recorded
    server = server_factory()
    with Client(server.address) as client:
        client.create_table("rollouts")
        client.insert("rollouts", rows)
        stored = client.query_table("SELECT traj_id, item_id FROM rollouts").to_pylist()
    ids = {r["traj_id"]: r["item_id"] for r in stored}
    same = replay(server.address, ids[rows[0]["traj_id"]], tmp_path)
    assert same.returncode == 0 and "turn 2: calc(12*7) same" in same.stdout, same.stdout + same.stderr
    assert "all 1 tool calls reproduced" in same.stdout
    diverged = replay(server.address, ids[rows[1]["traj_id"]], tmp_path)
    assert diverged.returncode == 1 and "turn 2: calc(12*7) DIVERGED" in diverged.stdout, diverged.stdout
    assert "stored: '85\\n'" in diverged.stdout and "now:    '84\\n'" in diverged.stdout
    assert "first divergence: turn 2" in diverged.stdout
