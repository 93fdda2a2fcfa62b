"""The tiny policy: a LlamaForCausalLM built from a config in code (random init, no
downloads), and the one function that turns logits into the logprobs of the sampling
distribution.

The sampling distribution is the *processed* one: logits / temperature, then the top-k
and top-p masks (vLLM's algorithm, ties kept), renormalised. Engines sample from it and
record its logprobs; trainers recompute behaviour logprobs with ``token_logprobs`` using
the same parameters, so both sides agree to float precision (tests/rl/test_engines.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from .tokenizer import CharTokenizer

MASKED = -1e9
"""Logit given to tokens outside top-k/top-p: probability exactly 0 in fp32, but finite, so
that ``logprob * mask`` never turns into NaN (a masked-out token gets about -1e9)."""


@dataclass
class ModelConfig:
    vocab_size: int = CharTokenizer.vocab_size
    hidden: int = 128
    layers: int = 2
    heads: int = 4  # head_dim = hidden / heads must be >= 32 for vLLM's CPU kernels
    intermediate: int = 256
    max_positions: int = 128
    tie_embeddings: bool = True


def llama_config(cfg: ModelConfig) -> transformers.LlamaConfig:
    tok = CharTokenizer
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, intermediate_size=cfg.intermediate,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        architectures=["LlamaForCausalLM"], torch_dtype="float32")


def build_model(cfg: ModelConfig, seed: int = 0) -> transformers.LlamaForCausalLM:
    """A randomly initialised fp32 model; ``seed`` fixes the init without touching the
    global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(llama_config(cfg))
    return model.float().eval()


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> the sampling distribution's logits: / temperature, then keep the
    top_k largest (0: all; ties at the k-th value kept) and the smallest set whose
    probability reaches top_p (1.0: all), as vLLM does. Other tokens get ``MASKED``."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (use top_k=1 for greedy decoding)")
    logits = logits.float() / temperature
    v = logits.shape[-1]
    if 0 < top_k < v:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, MASKED)
    if top_p < 1.0:
        sort, idx = logits.sort(dim=-1)  # ascending
        cum = sort.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), MASKED)
    return logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (B, T, V) of a forward pass over tokens (B, T) -> (B, T) logprobs where
    out[:, t] = log_softmax(process_logits(logits[:, t - 1]))[tokens[:, t]] and out[:, 0] = 0.

    The distribution is the processed one (temperature, top-k, top-p renormalised), the
    same that ``TorchEngine`` and vLLM (logprobs_mode="processed_logprobs") sample from.
    Differentiable; computed in fp32.
    """
    logp = process_logits(logits[:, :-1], temperature, top_k, top_p).log_softmax(dim=-1)  # (B, T-1, V)
    picked = logp.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)  # (B, T-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)

