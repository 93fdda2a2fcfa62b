"""A producer on a paced table (expstore_rl/pace.py): it reserves each group before it
starts it, waits while the trainer is behind, and its rows settle their reservations."""

import threading

import pytest
import torch

from expstore_rl.engines import SamplingParams, TorchEngine
from expstore_rl.envs import ReverseDigits
from expstore_rl.model import ModelConfig, build_model
from expstore_rl.producer import Producer

from integration._util import wait_until  # tests/ is on sys.path (rootdir, prepend import mode)

torch.set_num_threads(1)
PARAMS = SamplingParams(max_tokens=4, temperature=0.8, top_k=8)
pytestmark = pytest.mark.timeout(120)


def test_a_producer_waits_for_the_trainer_on_a_paced_table(client, shared_server, table_name):
    # window: (0 + max_staleness 0 + 1) * 4 rows = two groups of 2 at version 0
    client.create_table(table_name, sampler="fifo", max_staleness=0, pacing={"rollouts_per_version": 4})
    producer = Producer(shared_server.address, table_name, TorchEngine(build_model(ModelConfig(), seed=0)),
                        ReverseDigits, group_size=2, params=PARAMS)
    done = []
    runner = threading.Thread(target=lambda: done.append(producer.run(num_groups=3)))
    runner.start()
    stats = lambda: client.stats(table_name)[table_name]
    assert wait_until(lambda: stats()["reserve_waits"] >= 1 and stats()["items"] == 4, timeout=60)
    assert not done  # the third group waits for the trainer ...
    client.set_policy_version(table_name, 1)  # ... which moves on
    runner.join(60)
    assert done and done[0]["producer/groups"] == 3
    s = stats()
    assert (s["items"], s["pacing_settled_rows"], s["pacing_live_reservations"], s["pacing_late_rows"]) == (6, 6, 0, 0)
    rows = client.sample(table_name, 6).data.to_pylist()
    by_group = {}
    for r in rows:
        by_group.setdefault(r["group_id"], set()).add(r["reservation_id"])
    assert sorted(len(v) for v in by_group.values()) == [1, 1, 1]  # one reservation a group
    assert sorted(v.pop() for v in by_group.values()) == [1, 2, 3]
