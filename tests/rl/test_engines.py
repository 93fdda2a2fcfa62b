"""TorchEngine: recorded logprobs equal the trainer's recomputation, KV-cache reuse across
turns equals a full forward pass, stop tokens, seeds and weight loading."""

import pytest
import torch

from expstore_rl import weights
from expstore_rl.engines import SamplingParams, TorchEngine
from expstore_rl.model import ModelConfig, build_model, token_logprobs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig(), seed=0)


def recompute(model, seq, **proc):
    t = torch.tensor([seq])
    with torch.no_grad():
        return token_logprobs(model(t).logits, t, **proc)[0]


@pytest.mark.parametrize("proc", [dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
                                  dict(temperature=1.0)])
def test_recorded_logprobs_equal_recomputation(model, proc):
    engine = TorchEngine(model)
    prompts = [[1, 8, 9, 10, 13], [1, 7], [1, 12, 12, 12, 12, 12, 12, 20]]  # left padding in the batch
    gens = engine.generate(prompts, SamplingParams(max_tokens=12, seed=0, **proc))
    for p, g in zip(prompts, gens):
        assert len(g.tokens) == len(g.logprobs) == 12 and g.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(g.logprobs), recompute(model, p + g.tokens, **proc)[len(p):],
                                   rtol=0, atol=1e-5)


def test_kv_cache_reuse_across_turns_equals_a_full_forward(model):
    engine = TorchEngine(model)
    proc = dict(temperature=0.8, top_k=10)
    params = SamplingParams(max_tokens=6, seed=1, stop_token_ids=(2,), **proc)
    session = engine.session([[1, 8, 9], [1, 10, 11, 12, 13]])
    generated = {0: [], 1: []}
    for turn in range(3):
        rows = [0, 1] if turn != 1 else [1]  # row 0 sits out a turn: its cache gets holes
        for i, g in zip(rows, session.generate(params, rows)):
            generated[i].append((len(session.tokens[i]) - len(g.tokens), g))
        session.append(0, [5, 7 + turn, 6])  # an observation, not generated
        session.append(1, [5, 6])
    for i in (0, 1):
        full = recompute(model, session.tokens[i], **proc)
        for start, g in generated[i]:
            assert session.tokens[i][start:start + len(g.tokens)] == g.tokens
            torch.testing.assert_close(torch.tensor(g.logprobs), full[start:start + len(g.tokens)], rtol=0, atol=1e-5)


def test_stop_token_is_included_and_ends_that_row_only(model):
    engine = TorchEngine(model)
    params = SamplingParams(max_tokens=30, seed=0, stop_token_ids=tuple(range(7, 17)))  # any digit stops
    gens = engine.generate([[1, 20]] * 8, params)
    for g in gens:
        assert g.finish_reason == ("stop" if g.tokens[-1] in range(7, 17) else "length")
        assert not set(g.tokens[:-1]) & set(range(7, 17))
    assert {g.finish_reason for g in gens} == {"stop"}


def test_max_positions_bounds_generation(model):
    engine = TorchEngine(model)
    g = engine.generate([[1] * 125], SamplingParams(max_tokens=10, seed=0))[0]
    assert len(g.tokens) == 3 and g.finish_reason == "length"


def test_seed_reproduces_and_rows_of_one_prompt_differ(model):
    engine = TorchEngine(model)
    params = SamplingParams(max_tokens=8, seed=42)
    a, b = engine.generate([[1, 9]] * 4, params), engine.generate([[1, 9]] * 4, params)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert len({tuple(g.tokens) for g in a}) > 1


def test_load_weights_from_a_published_dir_or_a_state_dict(tmp_path):
    engine = TorchEngine(build_model(ModelConfig(), seed=0))
    other = build_model(ModelConfig(), seed=3)
    weights.publish(other.state_dict(), other.config.to_dict(), str(tmp_path), 4)
    engine.load_weights(weights.local_path(str(tmp_path), 4), 4)
    assert engine.version == 4
    assert torch.equal(engine.model.model.layers[0].mlp.up_proj.weight, other.model.layers[0].mlp.up_proj.weight)
    g = engine.generate([[1, 9]], SamplingParams(max_tokens=5, seed=0, temperature=0.9))[0]
    torch.testing.assert_close(torch.tensor(g.logprobs), recompute(other, [1, 9] + g.tokens, temperature=0.9)[2:],
                               rtol=0, atol=1e-5)
    engine.load_weights(build_model(ModelConfig(), seed=0).state_dict(), 5)
    assert engine.version == 5


def test_rows_left_out_or_out_of_room_keep_their_pending_tokens(model):
    engine = TorchEngine(model)
    params = SamplingParams(max_tokens=4, seed=0, temperature=0.9)
    session = engine.session([[1, 9], [1] * 128, [1, 10, 11]])  # row 1 has no room left
    first = session.generate(params, [1, 2])  # row 0 sits out its first pass
    assert first[0].tokens == [] and first[0].finish_reason == "length"
    second = session.generate(params, [0, 2])
    for i, g in ((0, second[0]), (2, second[1])):
        full = recompute(model, session.tokens[i], temperature=0.9)
        torch.testing.assert_close(torch.tensor(g.logprobs), full[-len(g.tokens):], rtol=0, atol=1e-5)
