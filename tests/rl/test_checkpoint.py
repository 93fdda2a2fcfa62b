"""A trainer stopped and resumed from its checkpoint ends where an uninterrupted run ends."""

import json

import torch

from expstore_rl import checkpoint, grpo, weights

from .test_fsdp import FakeSource, config


def final_weights(root, version):
    return weights.load_state_dict(f"file://{root}/weights", version)


def test_resume_continues_exactly_where_the_run_stopped(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    opts = dict(steps=4, checkpoint_every=2, num_minibatches=2)  # 2 minibatches: the shuffle RNG is restored too
    grpo.train(config(straight, **opts), FakeSource())

    grpo.train(config(resumed, **{**opts, "steps": 2}), FakeSource())  # stops after step 2 (checkpointed)
    assert checkpoint.latest(resumed / "run" / "checkpoints").name == "step_000002"
    state = grpo.train(config(resumed, **opts), FakeSource())
    assert (state.step, state.version) == (4, 4)

    a, b = final_weights(straight, 4), final_weights(resumed, 4)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(line)["step"] for line in (resumed / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_resume_after_publishing_past_the_checkpoint_republishes_as_a_newer_version(tmp_path):
    grpo.train(config(tmp_path, steps=3, checkpoint_every=2), FakeSource())  # checkpoints at 2 and 3
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_000002")  # as if it crashed before step 3's
    restored = torch.load(tmp_path / "run" / "checkpoints" / "step_000002" / "trainer.pt", weights_only=False)
    assert restored["version"] == 2
    state = grpo.train(config(tmp_path, steps=4, checkpoint_every=2), FakeSource())
    assert state.step == 4 and state.version == 6  # v4 = the restored step-2 weights, then v5, v6
    assert weights.versions(f"file://{tmp_path}/weights") == list(range(7))
    v2, v4 = final_weights(tmp_path, 2), final_weights(tmp_path, 4)
    assert all(torch.equal(v2[k], v4[k]) for k in v2)


def test_checkpoints_beyond_keep_are_deleted(tmp_path):
    grpo.train(config(tmp_path, steps=3, checkpoint_every=1), FakeSource())
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["latest", "step_000002", "step_000003"]
