"""The shared loop pieces: the store as a data source, PPO's token rewards, the CLI, and
that every metric a run writes is documented."""

import json
import re
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import torch

from expstore.synthetic import trajectories
from expstore_client import Client
from expstore_rl import ppo, trainer
from expstore_rl.batching import Rollouts
from expstore_rl.distributed import Dist

from .test_fsdp import TINY, FakeSource, config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "rl.md"


def emitted(out: Path) -> set[str]:
    return {k for line in (out / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)}


def documented() -> set[str]:
    section = DOCS.read_text().split("## Trainer", 1)[1].split("\n## ", 1)[0]
    section = re.sub(r"```.*?```", "", section, flags=re.S)  # code blocks
    return set(re.findall(r"`([^`]+)`", section))


def test_every_metric_of_grpo_and_ppo_is_documented(tmp_path):
    from expstore_rl import grpo

    grpo.train(config(tmp_path / "g", steps=1), FakeSource())
    ppo_cfg = ppo.PPOConfig(weights_uri=f"file://{tmp_path}/p/weights", out=str(tmp_path / "p" / "run"), steps=1,
                            batch_size=16, kl_coef=0.1, checkpoint_every=0, **TINY)
    ppo.train(ppo_cfg, FakeSource())
    names = emitted(tmp_path / "g" / "run") | emitted(tmp_path / "p" / "run")
    assert {"losses/value", "kl/ref", "offpolicy/is_weight_mean", "ppo/explained_variance"} <= names
    assert names - documented() == set()
    assert (tmp_path / "p" / "run" / "metrics.png").stat().st_size > 0


def test_ppo_critic_learns_and_values_are_finite(tmp_path):
    cfg = ppo.PPOConfig(weights_uri=f"file://{tmp_path}/weights", out=str(tmp_path / "run"), steps=3,
                        batch_size=16, checkpoint_every=0, update_epochs=2, **TINY)
    ppo.train(cfg, FakeSource())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["losses/value"]) for r in rows)
    assert rows[0]["ppo/value_mean"] == 0  # the value head starts at 0
    assert rows[-1]["ppo/value_mean"] != 0


def test_training_under_top_k_keeps_the_weights_and_metrics_finite(tmp_path):
    from expstore_rl import grpo, weights

    # 4 optimizer steps per batch: a token outside the proximal policy's top 10 (logprob
    # -1e9) gets back in after a step or two, and its ratio to the proximal one was inf
    grpo.train(config(tmp_path, steps=3, top_k=10, num_minibatches=4), FakeSource())
    sd = weights.load_state_dict(f"file://{tmp_path}/weights", 3)
    assert all(torch.isfinite(v).all() for v in sd.values())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(v) for r in rows for v in r.values())


def test_ppo_reward_sits_on_the_last_generated_token():
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0], [0, 0, 1, 0, 0, 0]])
    rows = Rollouts(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6), mask, torch.zeros(2, 6),
                    torch.tensor([2.0, -1.0]), torch.arange(2), torch.zeros(2, dtype=torch.long))
    r = ppo.token_rewards(rows, {}, ppo.PPOConfig())
    assert r.tolist() == [[0, 0, 0, 0, 2.0, 0], [0, 0, -1.0, 0, 0, 0]]


def test_cli_flags_cover_the_config():
    cfg = trainer.parse(ppo.PPOConfig, ["--clip-high", "0.28", "--no-norm-adv", "--stream", "--loss-agg", "seq-mean"])
    assert (cfg.clip_high, cfg.norm_adv, cfg.stream, cfg.loss_agg) == (0.28, False, True, "seq-mean")


def test_store_source_samples_whole_groups(server_factory):
    server = server_factory()
    cfg = trainer.TrainConfig(target=server.address, table="grpo", sample_timeout=10, samples_per_insert=0)
    with Client(server.address) as client:
        trainer.create_table(client, cfg, batch_size=8, group_size=4)
        client.insert("grpo", trajectories(16, groups=4, reward=np.arange(16, dtype=np.float32)))
        source = trainer.StoreSource(cfg, Dist(), 8)
        got = source.next(1).rollouts
        assert len(got) == 8
        groups = got.group_index.tolist()
        assert groups[:4] == [groups[0]] * 4 and groups[4:] == [groups[4]] * 4 and groups[0] != groups[4]
        # whole: each group's 4 rows, every one of them (row i is in group i % 4, reward i)
        for rewards in (sorted(got.rewards[:4].tolist()), sorted(got.rewards[4:].tolist())):
            g = int(rewards[0])
            assert g < 4 and rewards == [g, g + 4, g + 8, g + 12]
        assert client.describe("grpo").policy_version == 0
        source.set_policy_version(3)
        assert client.describe("grpo").policy_version == 3


def test_store_source_streams_each_row_once_and_commits_a_cut_per_step(server_factory):
    server = server_factory()
    cfg = trainer.TrainConfig(target=server.address, table="ppo", sample_timeout=5, samples_per_insert=0,
                              stream=True, stream_group="t")
    with Client(server.address) as client:
        trainer.create_table(client, cfg, batch_size=6, group_size=None)
        client.insert("ppo", trajectories(12))
        source = trainer.StoreSource(cfg, Dist(), 6)
        source.start(0, resumed=False)
        first = source.next(1)
        first.commit()
        second = source.next(2)
        second.commit()
        assert len(first.rollouts) == len(second.rollouts) == 6
        assert client.stats("ppo")["ppo"]["group.t.acked"] == 12
        assert [client.manifest("ppo", s)[0].tolist() for s in (1, 2)] == [list(range(1, 7)), list(range(7, 13))]


def test_a_streamed_grpo_step_takes_whole_groups_and_leaves_a_partial_one_in_flight(server_factory):
    server = server_factory()
    cfg = trainer.TrainConfig(target=server.address, table="grpo", sample_timeout=5, samples_per_insert=0,
                              stream=True, max_staleness=100)
    with Client(server.address) as client:
        trainer.create_table(client, cfg, batch_size=4, group_size=2)
        source = trainer.StoreSource(cfg, Dist(), 4, group_size=2)
        source.start(0, resumed=False)
        a, b, c = (trajectories(2, groups=1, id_prefix=p) for p in "abc")
        d = trajectories(2, groups=1, id_prefix="d")
        aborted = d.set_column(d.schema.get_field_index("finish_reason"), "finish_reason",
                               pa.array(["stop", "aborted"]))
        client.insert("grpo", a)
        client.insert("grpo", b.slice(0, 1))  # half of group b so far
        client.insert("grpo", c)
        step1 = source.next(1)
        assert step1.rollouts.group_index.tolist() == [0, 0, 1, 1]  # a and c: whole groups only
        step1.commit()
        assert client.manifest("grpo", 1)[0].tolist() == [1, 2, 4, 5]
        client.insert("grpo", b.slice(1, 1))
        client.insert("grpo", aborted)
        step2 = source.next(2)  # b (waited in flight, committed with cut 1) and d, its aborted row dropped
        assert len(step2.rollouts) == 3
        step2.commit()
        assert client.manifest("grpo", 2)[0].tolist() == [3, 6, 7]
        assert client.stats("grpo")["grpo"]["group.trainer.acked"] == 8


def test_the_rate_limited_table_lets_a_producer_and_the_trainer_alternate(server_factory):
    server = server_factory()
    cfg = trainer.TrainConfig(target=server.address, table="rl", sample_timeout=5)
    with Client(server.address) as client:
        trainer.create_table(client, cfg, batch_size=16, group_size=4)
        source = trainer.StoreSource(cfg, Dist(), 16)
        for k in range(3):  # a producer inserting groups of 4, a trainer sampling 16: neither stalls
            for g in range(4):
                client.insert("rl", trajectories(4, groups=1, id_prefix=f"s{k}g{g}"), timeout=5)
            assert len(source.next(k + 1).rollouts) == 16


class Lost(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def test_a_stream_read_lost_with_its_server_is_read_again_from_the_last_cut(server_factory, monkeypatch):
    server = server_factory()
    cfg = trainer.TrainConfig(target=server.address, table="ppo", sample_timeout=5, samples_per_insert=0,
                              stream=True, store_retry_s=5)
    with Client(server.address) as client:
        trainer.create_table(client, cfg, batch_size=6, group_size=None)
        client.insert("ppo", trajectories(12))
        source = trainer.StoreSource(cfg, Dist(), 6)
        real = source.client.stream

        def lossy(*args, **kwargs):  # the server delivers rows 1-6, the response never arrives
            monkeypatch.setattr(source.client, "stream", real)
            next(real(*args, **kwargs))
            raise Lost()
            yield

        monkeypatch.setattr(source.client, "stream", lossy)
        source.start(0, resumed=False)
        for step in (1, 2):  # step 1 resumes at cut 0 and gets the lost rows again
            source.next(step).commit()
        assert [client.manifest("ppo", s)[0].tolist() for s in (1, 2)] == [list(range(1, 7)), list(range(7, 13))]


def test_the_table_names_its_tokenizer_and_archives_what_it_drops(server_factory):
    server = server_factory()
    cfg = trainer.TrainConfig(target=server.address, table="grpo", sample_timeout=10, samples_per_insert=0,
                              archive=True)
    with Client(server.address) as client:
        trainer.create_table(client, cfg, batch_size=8, group_size=4)
        info = client.describe("grpo")
        assert info.config["metadata"] == {"tokenizer": "expstore_rl.tokenizer:CharTokenizer"}
        assert (info.config["tiers"], info.config["archive"]) == ("remote", True)
        client.insert("grpo", trajectories(16, groups=4))
        source = trainer.StoreSource(cfg, Dist(), 8, group_size=4)
        source.start(0, resumed=False)
        source.next(5)
        source.next(6)  # every row sampled once: all leave the table
        ids = [int(i) for step in (5, 6) for i in client.manifest("grpo", step)[0]]
        archived = f"SELECT count(*) AS n FROM grpo WHERE tier = 'archive' AND item_id IN ({', '.join(map(str, ids))})"
        deadline = time.monotonic() + 30  # the mover archives a chunk once all its rows are gone
        while client.query_table(archived).column("n")[0].as_py() < 16 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.query_table(archived).column("n")[0].as_py() == 16
