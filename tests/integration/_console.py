"""Helpers of the console tests: agent-like rows with known figures, a console subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from expstore_rl.tokenizer import CharTokenizer

TOKENIZER = "expstore_rl.tokenizer:CharTokenizer"
VERSIONS = 4
GROUPS = 3       # per version
GROUP_SIZE = 4
REWARDS_HELPER = '''
def stored(row):
    return row["reward"]
'''


def agent_rows(prefix: str = "t", task: str = "reverse") -> list[dict]:
    """VERSIONS x GROUPS groups of GROUP_SIZE trajectories, CharTokenizer ids: a prompt, a
    tool call (calc), its observation, an answer. Group 0 of each version has equal rewards
    (zero variance); the rows whose answer is wrong but whose stored reward is 1 are the
    mismatches an exact_match audit finds (item k % 5 == 4, answer wrong)."""
    tok = CharTokenizer()
    rows = []
    for v in range(VERSIONS):
        for g in range(GROUPS):
            for k in range(GROUP_SIZE):
                n = len(rows)
                answer = "321"
                said = answer if (k + g) % 2 == 0 or n % 5 == 4 else "123"
                padding = " " * (v * 2 + k)  # generated length grows with the version
                prompt = [tok.bos_id] + tok.encode("reverse 123")
                call = tok.encode(f"<tool>calc {k}+{g}</tool>")
                obs = tok.encode(f"<obs>{k + g}</obs>")
                final = tok.encode(padding + said) + [tok.eos_id]
                tokens = prompt + call + obs + final
                a, b, c = len(prompt), len(prompt) + len(call), len(prompt) + len(call) + len(obs)
                mask = [0] * a + [1] * len(call) + [0] * len(obs) + [1] * len(final)
                correct = 1.0 if said == answer else 0.0
                reward = 1.0 if g == 0 else (1.0 if n % 5 == 4 else correct)
                rows.append({
                    "traj_id": f"{prefix}-{n}", "prompt_id": f"p{v}-{g}", "group_id": f"{prefix}-v{v}-g{g}",
                    "group_size": GROUP_SIZE, "task": task, "tokens": tokens, "loss_mask": mask,
                    "logprobs": [0.0] * a + [-0.05 * (i % 7) for i in range(len(tokens) - a)],
                    "policy_version": v, "token_policy_version": [v] * len(tokens),
                    "turns": [{"role": "assistant", "start": a, "end": b},
                              {"role": "tool", "start": b, "end": c, "tool_name": "calc", "tool_args": f"{k}+{g}",
                               "tool_result": str(k + g), "tool_status": "error" if k == 3 else "ok",
                               "latency_ms": 1.5 + k},
                              {"role": "assistant", "start": c, "end": len(tokens)}],
                    "reward": reward, "step_rewards": [0.0, 0.0, reward],
                    "reward_components": {"correct": reward, "format": 0.5 * (k % 2)},
                    "finish_reason": "length" if k == 3 and v >= 2 else "stop",
                    "metadata": json.dumps({"answer": answer, "said": said}),
                })
    return rows


def generated(row: dict) -> int:
    return sum(row["loss_mask"])


@dataclass
class Console:
    proc: subprocess.Popen
    url: str
    stderr: list[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_console(server: str, *args: str, cwd: str | None = None, global_args: tuple[str, ...] = ()) -> Console:
    """``expstore console --http-port 0`` against ``server``; returns once it prints its URL."""
    cmd = [sys.executable, "-m", "expstore_server.cli", "--server", server, *global_args, "console",
           "--http-port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([cwd or "", os.environ.get("PYTHONPATH", "")])})
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    line = proc.stdout.readline()
    if not line.startswith("expstore console on "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"console did not start: {line!r} {''.join(stderr)}")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return Console(proc, line.rsplit(" ", 1)[1].strip(), stderr)
