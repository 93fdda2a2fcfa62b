"""The README's quick start and its CLI examples run as written, against a real server."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from expstore_client import Client

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start(address: str) -> None:
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code.replace("127.0.0.1:50051", address), "README.md", "exec"), {})


def readme_command(prefix: str) -> list[str]:
    """The README's shell line that starts with ``prefix``, as argv (its comment dropped)."""
    line = next(line for line in README.read_text().splitlines() if line.startswith(prefix))
    return shlex.split(line, comments=True)


def expstore(argv: list[str], address: str, cwd: Path) -> subprocess.CompletedProcess:
    """``expstore ...`` as the README writes it; the server comes from $EXPSTORE_SERVER."""
    assert argv[0] == "expstore"
    return subprocess.run([sys.executable, "-m", "expstore_server.cli", *argv[1:]], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "EXPSTORE_SERVER": address}, timeout=300)


def test_quick_start_runs(server_factory, capsys):
    server = server_factory()
    quick_start(server.address)
    assert capsys.readouterr().out.strip() == "256.0"  # the items of "rollouts"


def test_the_audit_example_reports_each_quick_start_row_it_cannot_score(server_factory, tmp_path, capsys):
    # the quick start's synthetic rows hold token ids up to 50,000 and no answer: exact_match
    # cannot score them, and every row must say why (it was an IndexError each)
    server = server_factory()
    quick_start(server.address)
    argv = readme_command("expstore audit")
    assert argv == ["expstore", "audit", "rollouts", "--reward", "expstore_rl.rewards:exact_match", "--max-mismatch", "0"]
    p = expstore(argv, server.address, tmp_path)
    assert p.returncode == 1 and p.stderr == "", p.stdout + p.stderr  # failures > --max-mismatch 0
    assert "items 256: ok 0, mismatch 0, error 256, timeout 0, unscored 0" in p.stdout, p.stdout
    errors = [line for line in p.stdout.splitlines() if re.match(r"\s+\d+\s+error\s", line)]
    assert len(errors) == 10 and all("is not in the CharTokenizer vocabulary (ids 0-50)" in e for e in errors), errors


def producer_row(i: int, digits: str, generated: str) -> dict:
    """A row as expstore_rl's producers write it for the reverse-digits task: CharTokenizer
    ids, the answer in metadata, the environment's reward."""
    from expstore_rl.envs import ReverseDigits
    from expstore_rl.tokenizer import CharTokenizer

    tok, env = CharTokenizer(), ReverseDigits()
    task = {"prompt_id": f"reverse-{digits}", "digits": digits, "answer": digits[::-1]}
    prompt = [tok.bos_id] + tok.encode(env.reset(task))
    answer = tok.encode(generated)
    reward = env.step(generated)[1]
    return {"traj_id": f"t{i}", "prompt_id": task["prompt_id"], "task": env.name, "tokens": prompt + answer,
            "loss_mask": [0] * len(prompt) + [1] * len(answer), "logprobs": [0.0] * len(prompt) + [-0.5] * len(answer),
            "policy_version": 0, "reward": reward, "finish_reason": "stop",
            "turns": [{"role": "user", "start": 0, "end": len(prompt)},
                      {"role": "assistant", "start": len(prompt), "end": len(prompt) + len(answer)}],
            "metadata": json.dumps({"answer": task["answer"], "task": task})}


def test_the_audit_example_reproduces_the_rewards_of_producer_rows(server_factory, tmp_path):
    server = server_factory()
    rows = [producer_row(i, digits, generated) for i, (digits, generated) in
            enumerate([("123", "321<eos>"), ("907", "709<eos>"), ("123", "312<eos>"), ("450", "54<eos>")])]
    assert [r["reward"] for r in rows] == [1.0, 1.0, 0.0, 0.0]
    with Client(server.address) as client:
        client.create_table("rollouts")
        client.insert("rollouts", rows)
    p = expstore(readme_command("expstore audit"), server.address, tmp_path)
    assert p.returncode == 0 and "items 4: ok 4, mismatch 0, error 0" in p.stdout, p.stdout + p.stderr
