"""TransferQueue (0.1.11, the real package, under a local Ray) with ``storage_backend:
Expstore``: verl's data flow through TransferQueue's API, stored in a real expstore server
that is killed with SIGKILL and restarted, and a TransferQueue run that resumes from its
checkpoint."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
import transfer_queue as tq
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict
from transfer_queue import GRPOGroupNSampler

import expstore_client.integrations.transfer_queue as backend
from expstore_client import Client

from ray_start import local_ray

from ._util import restartable_port, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
HOOK = "expstore_client.integrations.transfer_queue.register"
TABLE = "tq_values"
N, GROUP = 8, 4  # two prompts, four responses each


class Store:
    """An expstore server whose data dir and port outlive a kill -9."""

    def __init__(self, data_dir) -> None:
        self.data_dir = data_dir
        self.server = start_server(data_dir, None, "--port", restartable_port())
        self.address = self.server.address

    def kill_and_restart(self) -> None:
        self.server.stop(signal.SIGKILL)
        self.server = start_server(self.data_dir, None, "--port", self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        if self.server.proc.poll() is None:
            self.server.stop()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = Store(tmp_path_factory.mktemp("tq") / "data")
    yield s
    s.close()


def tq_config(address: str) -> dict:
    return {"controller": {"sampler": GRPOGroupNSampler(n_samples_per_prompt=GROUP)},
            "backend": {"storage_backend": "Expstore", "Expstore": {"target": address, "table": TABLE}}}


@pytest.fixture(scope="module")
def tq_run(store):
    with local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False,
                   runtime_env={"worker_process_setup_hook": HOOK}):
        tq.init(OmegaConf.create(tq_config(store.address), flags={"allow_objects": True}))
        yield
        tq.close()


@pytest.fixture
def tq_client(tq_run):
    return tq.get_client()  # the current one: a test may restart TransferQueue


def test_the_docs_example_runs(store, tmp_path):
    """docs/integrations.md's Python example, as written, in a process of its own (its own Ray)."""
    code = re.search(r"```python\n(import torch.*?)```", DOCS.read_text(), re.S).group(1)
    p = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:50051", store.address)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[1.0, 0.0, 0.5, 1.0]"


def test_every_backend_key_is_documented():
    prose = re.sub(r"```.*?```", "", DOCS.read_text(), flags=re.S)  # code spans outside the code blocks
    documented = set(re.findall(r"`([^`]+)`", prose))
    assert {f.name for f in dataclasses.fields(backend.Settings)} - documented == set()


def rollouts(seed: int) -> TensorDict:
    """A verl-like rollout batch: ids, masks, bfloat16 logprobs, scalar rewards, strings, dicts."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict({
        "input_ids": torch.randint(0, 1000, (N, 6), generator=g),
        "response_mask": torch.randint(0, 2, (N, 3), generator=g).to(torch.int64),
        "old_log_probs": -torch.rand(N, 3, generator=g).to(torch.bfloat16),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 1.0]),
        "uid": NonTensorStack(*[f"p{seed}-{i // GROUP}" for i in range(N)]),
        "reward_extra_info": NonTensorStack(*[{"acc": i % 2, "tags": ["x", i]} for i in range(N)]),
    }, batch_size=N)


def same(a: TensorDict, b: TensorDict, fields: list[str]) -> None:
    for name in fields:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and not y.is_nested, name
            assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(x, y), name
        else:
            assert list(y) == list(x), name


def test_a_grpo_step_through_transfer_queue_is_stored_in_expstore(store, tq_client):
    batch = rollouts(1)
    tq_client.put(data=batch, partition_id="train")

    # compute_advantage: the GRPO sampler hands out whole groups; the values come from expstore
    fields = ["input_ids", "response_mask", "old_log_probs", "rewards", "uid", "reward_extra_info"]
    meta = tq_client.get_meta(data_fields=fields, batch_size=N, partition_id="train", task_name="compute_adv")
    assert meta.size == N
    got = tq_client.get_data(meta)
    order = meta.global_indexes
    same(batch[torch.tensor(order)], got, fields)
    rewards = got["rewards"].view(-1, GROUP)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    tq_client.put(data=TensorDict({"advantages": adv[:, None].expand(N, 3).contiguous()}, batch_size=N),
                  metadata=meta)

    # update_actor: reads the advantages written back
    meta = tq_client.get_meta(data_fields=["input_ids", "advantages"], batch_size=N, partition_id="train",
                              task_name="update_actor")
    got = tq_client.get_data(meta)
    assert torch.equal(got["advantages"][:, 0], adv[torch.tensor([order.index(i) for i in meta.global_indexes])])

    # TransferQueue's bookkeeping is its own: consumption per task
    consumed = tq_client.get_consumption_status(task_name="compute_adv", partition_id="train")[1]
    assert consumed.tolist() == [1] * N

    # and every value is an acknowledged row of the expstore table
    with Client(store.address) as c:
        counts = c.query_table(f"SELECT field, count(*) AS n FROM {TABLE} WHERE global_index < {N} "
                               f"GROUP BY field ORDER BY field").to_pylist()
    assert counts == [{"field": f, "n": N} for f in sorted(fields + ["advantages"])]


@ray.remote
class Worker:
    """A Ray worker (as verl's are): it attaches to the running TransferQueue; only the
    setup hook made the Expstore backend known in its process."""

    def put_and_get(self, seed: int) -> list:
        import transfer_queue as tq

        tq.init()
        client = tq.get_client()
        meta = client.put(data=TensorDict({"values": torch.arange(4.0) + seed}, batch_size=4), partition_id="worker")
        return client.get_data(meta)["values"].tolist()


def test_a_ray_worker_attaches_through_the_setup_hook(tq_client):
    assert ray.get(Worker.remote().put_and_get.remote(10)) == [10.0, 11.0, 12.0, 13.0]


def test_data_put_through_transfer_queue_survives_a_kill_9_of_the_server(store, tq_client):
    keys = [f"crash-{i}" for i in range(N)]
    batch = rollouts(2)
    tq.kv_batch_put(keys=keys, partition_id="crash", fields=batch, tags=[{"status": "done"}] * N)
    store.kill_and_restart()
    got = tq.kv_batch_get(keys=keys, partition_id="crash")
    same(batch, got, ["input_ids", "response_mask", "old_log_probs", "rewards", "uid", "reward_extra_info"])


def test_a_new_transfer_queue_resumes_from_its_checkpoint(store, tq_client, tmp_path):
    keys = [f"resume-{i}" for i in range(N)]
    batch = rollouts(3)
    tq.kv_batch_put(keys=keys, partition_id="resume", fields=batch, tags=[{"step": 7}] * N)
    tq.save_checkpoint(tmp_path / "tq", metadata={"global_steps": 7})
    record = json.loads((tmp_path / "tq" / backend.CHECKPOINT_FILE).read_text())
    assert record["table"] == TABLE and record["target"] == store.address

    tq.close()  # the trainer's TransferQueue goes away: controller, clients, their memory
    tq.init(OmegaConf.create(tq_config(store.address), flags={"allow_objects": True}))
    tq.load_checkpoint(tmp_path / "tq")
    assert tq.kv_list("resume")["resume"] == {k: {"step": 7} for k in keys}
    same(batch, tq.kv_batch_get(keys=keys, partition_id="resume"), ["input_ids", "old_log_probs", "uid"])


def test_values_that_are_not_data_are_refused_naming_the_field(tq_client):
    bad = TensorDict({"ok": torch.zeros(2), "handle": NonTensorStack(object(), object())}, batch_size=2)
    with pytest.raises(TypeError, match="handle"):
        tq_client.put(data=bad, partition_id="bad")


def test_storage_client_checks_that_each_row_is_the_key_asked_for(store, tq_client):
    storage = backend.ExpstoreStorageClient({"target": store.address, "table": TABLE})
    ids = storage.put(["0@a", "1@a"], [torch.ones(2), np.arange(3)])
    assert [v.tolist() for v in storage.get(["0@a", "1@a"], custom_backend_meta=ids)] == [[1.0, 1.0], [0, 1, 2]]
    with pytest.raises(RuntimeError, match="not TransferQueue key '1@a'"):
        storage.get(["1@a"], custom_backend_meta=[ids[0]])
    with pytest.raises(KeyError, match="no item id recorded"):
        storage.get(["0@a"], custom_backend_meta=[None])
