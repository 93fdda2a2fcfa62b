"""Producers against a real expstore-server: whole groups, logprobs the trainer can
recompute, and weights reloaded when a newer version is published."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expstore_rl import rewards, weights
from expstore_rl.engines import SamplingParams, TorchEngine
from expstore_rl.envs import ReverseDigits
from expstore_rl.model import ModelConfig, build_model, token_logprobs
from expstore_rl.producer import Producer, ProducerConfig, build_parser

torch.set_num_threads(1)
PARAMS = SamplingParams(max_tokens=4, temperature=0.8, top_k=8)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "rl.md"


def documented() -> set[str]:
    section = DOCS.read_text().split("## Producers", 1)[1].split("\n## ", 1)[0]
    section = re.sub(r"```.*?```", "", section, flags=re.S)  # code blocks
    return set(re.findall(r"`([^`]+)`", section))


def rows_of(client, table, n):
    return client.sample(table, n).data.to_pylist()


def assert_recomputable(model, row):
    t = torch.tensor([row["tokens"]])
    with torch.no_grad():
        lp = token_logprobs(model(t).logits, t, PARAMS.temperature, PARAMS.top_k)[0]
    mask = torch.tensor(row["loss_mask"], dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(row["logprobs"])[mask], lp[mask], rtol=0, atol=1e-5)


def test_inserts_whole_groups_for_the_group_sampler(client, shared_server, table_name):
    client.create_table(table_name, sampler={"type": "group", "group_size": 4})
    model = build_model(ModelConfig(), seed=0)
    producer = Producer(shared_server.address, table_name, TorchEngine(model), ReverseDigits, group_size=4,
                        params=PARAMS, reward_fn=rewards.combine(exact_match=1.0, length_penalty=0.01))
    stats = producer.run(num_groups=3)
    assert stats["producer/groups"] == 3 and stats["producer/trajectories"] == 12
    assert client.describe(table_name).num_items == 12
    names = {re.sub(r"^producer/finish/.+", "producer/finish/<reason>", k) for k in stats}
    assert names - documented() == set()
    group = rows_of(client, table_name, 4)
    assert len({r["group_id"] for r in group}) == 1 and {r["group_size"] for r in group} == {4}
    assert len({r["prompt_id"] for r in group}) == 1 and len({r["traj_id"] for r in group}) == 4
    for r in group:
        assert r["task"] == "reverse" and r["policy_version"] == 0
        assert set(dict(r["reward_components"])) == {"env", "exact_match", "length_penalty"}
        assert r["reward"] == pytest.approx(rewards.combine(exact_match=1.0, length_penalty=0.01)(r).value)
        meta = json.loads(r["metadata"])
        assert meta["sampling"]["top_k"] == 8 and meta["seed"] is not None
        assert_recomputable(model, r)


def test_reloads_a_newly_published_version(client, shared_server, table_name, tmp_path):
    client.create_table(table_name, sampler="fifo")
    uri = f"file://{tmp_path}/weights"
    old = build_model(ModelConfig(), seed=0)
    engine = TorchEngine(build_model(ModelConfig(), seed=0))
    producer = Producer(shared_server.address, table_name, engine, ReverseDigits, group_size=2, weights_uri=uri,
                        params=PARAMS, config=ProducerConfig(weights_poll_s=0.0))
    producer.run(num_groups=1)
    assert engine.version == 0
    newer = build_model(ModelConfig(), seed=1)
    weights.publish(newer.state_dict(), newer.config.to_dict(), uri, 1)
    stats = producer.run(num_groups=1)
    assert stats["producer/weight_reloads"] == 1 and engine.version == 1
    rows = rows_of(client, table_name, 4)  # fifo: each item once
    assert sorted(r["policy_version"] for r in rows) == [0, 0, 1, 1]
    for r in rows:
        assert_recomputable(newer if r["policy_version"] == 1 else old, r)


def test_every_flag_is_documented():
    flags = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert flags - {"--help"} - documented() == set()


@pytest.mark.slow
def test_cli(client, shared_server, table_name):
    client.create_table(table_name, sampler={"type": "group", "group_size": 2})
    out = subprocess.run([sys.executable, "-m", "expstore_rl.producer", "--server", shared_server.address,
                          "--table", table_name, "--env", "calculator", "--group-size", "2", "--num-groups", "2",
                          "--max-tokens", "6", "--temperature", "0.9"],
                         capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["producer/trajectories"] == 4
    assert client.describe(table_name).num_items == 4


def test_every_launcher_flag_is_documented():
    from expstore_rl import launch

    section = DOCS.read_text().split("## Launching a run", 1)[1].split("\n## ", 1)[0]
    section = re.sub(r"```.*?```", "", section, flags=re.S)  # code blocks
    flags = {o for a in launch.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert flags - {"--help"} - set(re.findall(r"`([^`]+)`", section)) == set()
