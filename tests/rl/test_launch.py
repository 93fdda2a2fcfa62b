"""The launcher against real expstore-servers: producers and a GRPO trainer as Ray actors
on a local Ray bound to loopback, as local processes, and on a store of two shards."""

import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from expstore_client import Client
from expstore_rl import grpo, launch, producer, trainer, weights
import ray_start

pytestmark = pytest.mark.slow
TINY = ["--hidden", "64", "--heads", "2", "--layers", "1", "--intermediate", "64"]  # head_dim 32


def trainer_flags(address: str, root: Path, table: str) -> list[str]:
    return ["--target", address, "--table", table, "--weights-uri", f"file://{root}/weights",
            "--out", str(root / "run"), "--steps", "2", "--group-size", "2", "--groups-per-step", "2",
            "--checkpoint-every", "0", "--sample-timeout", "60", *TINY]


def produced(stats: dict) -> int:
    return stats.get("producer/trajectories", 0)


@pytest.fixture
def local_ray():
    with ray_start.local_ray(address="local", num_cpus=2, include_dashboard=False) as ray:
        yield ray


def test_ray_actors_produce_and_train_against_an_external_store(shared_server, client, table_name, tmp_path,
                                                                local_ray):
    assert {n["NodeManagerAddress"] for n in local_ray.nodes()} == {"127.0.0.1"}
    # 2 groups from each producer: the 4 the trainer's 2 steps of 2 groups take
    out = launch.run(["--ray", "--producers", "2", "--num-groups", "2", "--max-tokens", "4", "--producer-cpus", "0.5",
                      "--trainer-cpus", "1", "--", *trainer_flags(shared_server.address, tmp_path, table_name)])

    # the trainer trained 2 steps on the producers' groups and published v1, v2 after v0
    assert out["trainer"] == {"steps": 2, "policy_version": 2}
    assert weights.versions(f"file://{tmp_path}/weights") == [0, 1, 2]
    assert client.stats(table_name)[table_name]["policy_version"] == 2
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2

    # both actors produced their groups, and every row they counted reached the store
    assert [p["producer/groups"] for p in out["producers"]] == [2, 2]
    assert [produced(p) for p in out["producers"]] == [4, 4]
    assert client.stats(table_name)[table_name]["inserts"] == 8


def test_a_producer_actor_stops_and_stores_the_groups_in_flight_as_partial(shared_server, client, table_name, tmp_path):
    flags = launch.build_parser().parse_args(["--max-tokens", "4", "--concurrency", "2"])
    cfg = trainer.parse(grpo.GRPOConfig, trainer_flags(shared_server.address, tmp_path, table_name))
    launch.prepare(flags, cfg)
    actor = launch.ProducerActor(launch.producer_argv(flags, cfg, 0))  # the class Ray runs, here in-process
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(actor.run)
        deadline = time.monotonic() + 60
        while client.stats(table_name)[table_name]["inserts"] < 4:  # 2 groups of 2 are in
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.05)
        actor.stop()
        stats = running.result(timeout=60)  # returns: it starts no group after stop()
    assert stats["producer/groups"] >= 2 and produced(stats) == 2 * stats["producer/groups"]
    assert client.stats(table_name)[table_name]["inserts"] == produced(stats)
    partial = table_name + "_partial"  # the groups in flight were stored as partial, whole
    assert client.stats(partial)[partial]["inserts"] == 2 * stats.get("producer/aborted_groups", 0)


def test_local_processes_run_the_same_loop(shared_server, client, table_name, tmp_path):
    out = launch.run(["--producers", "1", "--max-tokens", "4", "--logs", str(tmp_path / "logs"), "--",
                      *trainer_flags(shared_server.address, tmp_path, table_name)])
    assert out["trainer"] == {"steps": 2, "policy_version": 2}
    assert client.stats(table_name)[table_name]["inserts"] >= 4
    assert (tmp_path / "logs" / "producer0.log").exists()


def test_a_sharded_store_takes_whole_groups_on_every_shard(server_factory, tmp_path):
    shards = [server_factory(), server_factory()]
    target = ",".join(s.address for s in shards)
    flags = trainer_flags(target, tmp_path, "rollouts")
    out = launch.run(["--producers", "1", "--max-tokens", "4", "--", *flags, "--sample-order", "uniform"])
    assert out["trainer"] == {"steps": 2, "policy_version": 2}
    for shard in shards:
        with Client(shard.address) as client:
            stats = client.stats("rollouts")["rollouts"]
            assert stats["policy_version"] == 2  # the trainer moved every shard's version
            assert stats["inserts"] > 0 and stats["inserts"] % 2 == 0  # groups of 2, never split
    with pytest.raises(ValueError, match="orders items across the whole table"):  # newest-first needs one store
        launch.run(["--producers", "0", "--", *trainer_flags(target, tmp_path / "lifo", "newest")])


def test_the_token_never_appears_on_a_command_line(server_factory, tmp_path):
    secret = f"launch-secret-{uuid.uuid4().hex}"
    server = server_factory(f'[auth]\ntokens = [{{name = "rl", token = "{secret}", roles = ["admin"]}}]\n')
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:  # what any local user may read: every process's command line
        while not done.is_set():
            for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
                try:
                    if secret.encode() in cmdline.read_bytes():
                        seen.append(cmdline.read_bytes().decode(errors="replace"))
                except OSError:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:  # the token reaches the producer (its rows are inserted), through its environment
        out = launch.run(["--producers", "1", "--max-tokens", "4", "--",
                          *trainer_flags(server.address, tmp_path, "secured"), "--token", secret])
    finally:
        done.set()
        watcher.join()
    assert out["trainer"] == {"steps": 2, "policy_version": 2}
    assert seen == []
    with Client(server.address, secret) as client:
        assert client.stats("secured")["secured"]["inserts"] >= 4


def test_producer_and_trainer_read_the_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("EXPSTORE_TOKEN", "from-env")
    cfg = trainer.parse(grpo.GRPOConfig, [])
    assert cfg.token == "from-env" and trainer.parse(grpo.GRPOConfig, ["--token", "flag"]).token == "flag"
    assert producer.build_parser().parse_args(["--table", "t"]).token == "from-env"
    assert "from-env" not in launch.producer_argv(launch.build_parser().parse_args([]), cfg, 0)


def test_your_model_env_and_reward_through_the_launcher_which_makes_the_table_first(
        shared_server, client, table_name, tmp_path, hf_model_dir, monkeypatch):
    code = Path(__file__).resolve().parent  # tests/rl/user_code.py, on the path as a user's package would be
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(code), os.environ.get("PYTHONPATH", "")]))
    uri, seen, start = f"file://{tmp_path}/weights", [], launch.start_producer

    def start_producer(argv, log, token=""):  # what a producer finds when it starts
        seen.append((client.describe(table_name).name, weights.versions(uri), argv[argv.index("--model") + 1]))
        return start(argv, log, token)

    monkeypatch.setattr(launch, "start_producer", start_producer)
    out = launch.run(["--producers", "1", "--env", "user_code:Countdown", "--reward", "user_code:marked",
                      "--max-tokens", "4", "--max-turns", "3", "--logs", str(tmp_path / "logs"), "--",
                      *trainer_flags(shared_server.address, tmp_path, table_name), "--model", str(hf_model_dir)])
    assert out["trainer"] == {"steps": 2, "policy_version": 2}
    assert seen == [(table_name, [0], str(hf_model_dir))]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/reward_mean"] for r in rows] == [0.25, 0.25]  # user_code.marked scored countdown rows
    v2 = Path(weights.local_path(uri, 2))
    assert (v2 / "tokenizer.json").read_bytes() == (hf_model_dir / "tokenizer.json").read_bytes()
