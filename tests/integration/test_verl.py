"""verl (0.9.1, the real package) on CPU: GRPO groups sampled from a real expstore server
become a DataProto that verl's own advantage estimator consumes, and the advantages go
back into the store as protocol-v1 rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos

from expstore.synthetic import trajectories
from expstore_client import Client
from expstore_client.integrations.verl import from_dataproto, to_dataproto

GROUP = 4


def with_tool_observations(t: pa.Table) -> pa.Table:
    """Every other row gets a tool observation inside its response: loss_mask 0 (and
    logprob 0) on two tokens after the first two generated ones."""
    masks, logprobs = t.column("loss_mask").to_pylist(), t.column("logprobs").to_pylist()
    for i in range(0, t.num_rows, 2):
        first = masks[i].index(1)
        for j in (first + 2, first + 3):
            masks[i][j], logprobs[i][j] = 0, 0.0
    t = t.set_column(t.schema.get_field_index("loss_mask"), "loss_mask", pa.array(masks, t.schema.field("loss_mask").type))
    return t.set_column(t.schema.get_field_index("logprobs"), "logprobs",
                        pa.array(logprobs, t.schema.field("logprobs").type))


@pytest.fixture
def client(server_factory):
    c = Client(server_factory().address)
    yield c
    c.close()


def test_grpo_groups_from_expstore_train_through_verls_advantage_estimator(client):
    client.create_table("rollouts", sampler={"type": "group", "group_size": GROUP})
    rows = with_tool_observations(trajectories(16, tokens=(12, 30), prompt_tokens=5, groups=4, seed=7))
    client.insert("rollouts", rows)

    batch = client.sample("rollouts", 2 * GROUP)
    data = to_dataproto(batch, pad_token_id=0)
    assert isinstance(data, DataProto) and len(data) == 2 * GROUP
    uid = data.non_tensor_batch["uid"]
    assert [len(set(uid[i:i + GROUP])) for i in range(0, len(uid), GROUP)] == [1, 1]  # whole groups, contiguous

    # the layout verl expects: left-padded prompts, right-padded responses, masks aligned
    b = data.batch
    for i, row in enumerate(batch.data.to_pylist()):
        real = b["attention_mask"][i].bool()
        assert b["input_ids"][i][real].tolist() == row["tokens"]
        P = b["prompts"].shape[1]
        n_prompt = int(b["attention_mask"][i, :P].sum())
        assert b["attention_mask"][i, :P - n_prompt].sum() == 0  # left padding
        n_response = len(row["tokens"]) - n_prompt
        assert b["response_mask"][i, :n_response].tolist() == row["loss_mask"][n_prompt:]
        assert b["response_mask"][i, n_response:].sum() == 0
        assert torch.allclose(b["rollout_log_probs"][i, :n_response], torch.tensor(row["logprobs"][n_prompt:]))
        assert b["token_level_scores"][i].sum().item() == pytest.approx(row["reward"])
        assert data.non_tensor_batch["traj_id"][i] == row["traj_id"]
    assert data.non_tensor_batch["item_id"].tolist() == batch.ids.tolist()

    # verl's GRPO estimator, on the batch as given
    adv, returns = core_algos.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"], uid)
    rewards = torch.tensor(batch.column("reward").to_pylist()).view(-1, GROUP)
    expected = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    assert torch.allclose(adv.sum(1) / b["response_mask"].sum(1), expected, atol=1e-5)

    # written back: rows with their per-token advantages, validated by the server as protocol v1
    data.batch["advantages"] = adv
    client.create_table("rollouts_trained", sampler="fifo")
    result = client.insert("rollouts_trained", from_dataproto(data))
    assert result.num_inserted == 2 * GROUP
    joined = client.query_table("SELECT r.traj_id, r.tokens = t.tokens AS same_tokens, r.loss_mask = t.loss_mask "
                                "AS same_mask, r.group_id = t.group_id AS same_group, t.group_size, t.advantages, "
                                "t.reward FROM rollouts r JOIN rollouts_trained t USING (traj_id)").to_pylist()
    assert len(joined) == 2 * GROUP
    by_traj = {r["traj_id"]: r for r in joined}
    for i, traj in enumerate(data.non_tensor_batch["traj_id"]):
        row = by_traj[traj]
        assert row["same_tokens"] and row["same_mask"] and row["same_group"] and row["group_size"] == GROUP
        per_token = np.array(row["advantages"])
        mask = np.array(batch.data.column("loss_mask")[i].as_py())
        assert np.allclose(per_token[mask == 1], expected[i].item(), atol=1e-5)
        assert (per_token[mask == 0] == 0).all()  # prompt and tool observations
        assert row["reward"] == pytest.approx(batch.column("reward")[i].as_py())


def test_rows_of_one_length_become_tensors_without_a_copy():
    rows = trajectories(8, tokens=12, prompt_tokens=4)
    data = to_dataproto(rows)
    logprobs = rows.column("logprobs").chunk(0)
    buffer = logprobs.values.buffers()[1]
    start = buffer.address + logprobs.values.offset * 4
    assert data.batch["rollout_log_probs"].data_ptr() == start + 4 * 4  # a view: the response part of row 0
    ragged = to_dataproto(trajectories(8, tokens=(10, 14), prompt_tokens=4))
    assert ragged.batch["rollout_log_probs"].shape == (8, 10)  # padded: a copy, as it must be


def test_a_verl_batch_round_trips_through_arrow():
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])            # left-padded
    responses = torch.tensor([[11, 12, 13], [14, 0, 0]])             # right-padded
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    data = DataProto.from_dict(tensors={
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "response_mask": torch.tensor([[1, 0, 1], [1, 0, 0]]),
        "rollout_log_probs": torch.tensor([[-0.5, -9.0, -0.25], [-1.0, 0.0, 0.0]]),
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]]),
    }, non_tensors={"uid": np.array(["u", "u"], dtype=object), "traj_id": np.array(["a", "b"], dtype=object)})
    rows = from_dataproto(data, policy_version=3, task="math")
    assert rows.column("tokens").to_pylist() == [[5, 6, 11, 12, 13], [7, 8, 9, 10, 14]]
    assert rows.column("loss_mask").to_pylist() == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 1]]
    assert rows.column("logprobs").to_pylist() == [[0, 0, -0.5, 0, -0.25], [0, 0, 0, 0, -1.0]]
    assert rows.column("reward").to_pylist() == [1.0, 0.5]
    assert rows.column("group_size").to_pylist() == [2, 2] and rows.column("policy_version").to_pylist() == [3, 3]
    back = to_dataproto(rows)
    for name in ("prompts", "responses", "input_ids", "attention_mask", "response_mask", "token_level_scores"):
        assert torch.equal(back.batch[name], data.batch[name].to(back.batch[name].dtype)), name
    assert torch.equal(back.batch["rollout_log_probs"], data.batch["rollout_log_probs"] * data.batch["response_mask"])
    assert back.non_tensor_batch["uid"].tolist() == ["u", "u"]


def test_the_documented_main_ppo_overrides_configure_verl_for_the_expstore_backend():
    """docs/integrations.md's command-line overrides, composed with verl's own ppo_trainer
    config by Hydra (struct mode: a key verl lacks needs its '+'), then turned into
    TransferQueue's backend settings and Ray's runtime_env the way verl's main_ppo does."""
    import re
    import shlex
    from pathlib import Path

    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    from expstore_client.integrations.transfer_queue import Settings

    docs = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    command = re.search(r"```sh\n(python -m verl\.trainer\.main_ppo .*?)```", docs, re.S).group(1)
    overrides = [w for w in shlex.split(command.replace("\\\n", " ")) if "=" in w]
    assert len(overrides) == 5
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    assert config.transfer_queue.enable and config.transfer_queue.backend.storage_backend == "Expstore"
    settings = Settings.of(config.transfer_queue.backend.Expstore)
    assert (settings.target, settings.table, settings.durability) == ("expstore-0:50051", "verl_run_42", "wal")
    # main_ppo: runtime_env = merge(verl's defaults, ray_kwargs.ray_init.runtime_env), passed to ray.init
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
    assert runtime_env.worker_process_setup_hook == "expstore_client.integrations.transfer_queue.register"
