import torch

from expstore_rl.model import MASKED, ModelConfig, build_model, process_logits, token_logprobs

torch.set_num_threads(1)


def test_build_model_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build_model(ModelConfig(), seed=7), build_model(ModelConfig(), seed=7)
    assert torch.rand(1) == before
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = build_model(ModelConfig(), seed=8)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_config_in_code_fp32_and_vllm_head_size():
    cfg = ModelConfig()
    m = build_model(cfg)
    assert m.config.hidden_size // m.config.num_attention_heads >= 32
    assert m.config.vocab_size == cfg.vocab_size and m.config.tie_word_embeddings
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert m.lm_head.weight is m.model.embed_tokens.weight


def test_token_logprobs_is_the_shifted_processed_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 5, 11, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    out = token_logprobs(logits, tokens, temperature=0.5)
    assert out.shape == (2, 5) and torch.all(out[:, 0] == 0)
    expected = torch.log_softmax(logits[1, 2] / 0.5, -1)[tokens[1, 3]]
    torch.testing.assert_close(out[1, 3], expected)


def test_top_k_and_top_p_renormalise_over_their_support():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = process_logits(logits, top_k=2).softmax(-1)
    assert torch.count_nonzero(p) == 2
    torch.testing.assert_close(p[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), -1))
    probs = torch.softmax(logits, -1)[0]  # 0.55, 0.20, 0.12, 0.07, 0.03
    kept = process_logits(logits, top_p=0.7).softmax(-1)[0] > 0
    assert kept.tolist() == [True, True, False, False, False]  # the smallest set with mass >= 0.7
    assert probs[:2].sum() >= 0.7 and probs[0] < 0.7
    greedy = token_logprobs(logits[:, None].expand(1, 2, 5), torch.tensor([[0, 0]]), top_k=1)
    assert greedy[0, 1] == 0


def test_masked_tokens_are_finite_so_masks_can_multiply():
    logits, tokens = torch.randn(1, 4, 9, requires_grad=True), torch.tensor([[0, 1, 2, 3]])
    lp = token_logprobs(logits, tokens, top_k=1)
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    (lp * torch.tensor([[0, 0, 1, 0]])).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert MASKED > torch.finfo(torch.float32).min
