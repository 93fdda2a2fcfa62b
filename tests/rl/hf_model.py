"""A tiny Hugging Face model directory made here, offline: a byte-level BPE tokenizer
trained on the words, digits and operators of the test environments, a Qwen2-like ChatML
chat template with a tool role, and a randomly initialised Qwen2 model (head_dim 32, as
vLLM's CPU kernels need), all written with ``save_pretrained``."""

from __future__ import annotations

import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]  # added, not special: decode keeps them, as Qwen2.5's
SYSTEM = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
"""Qwen2.5's layout: a default system message, tool results as a user turn in <tool_response>."""


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["calc", "tool", "obs", "count down from", "next", "again", "reverse", "user", "assistant", "system",
             "tool_response", "name", "arguments", "expression", SYSTEM, "error", "denied", "say"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        lines += [f"{a}*{b}={a * b}", f"<tool>calc {a}*{b}</tool>", f'{{"name": "calc", "arguments": "{a}+{b}"}}',
                  f"{rng.randint(100, 999)}= {a - b} ({a}/{b})", " ".join(rng.sample(words, 4))]
    return lines


def build(path: Path, seed: int = 0, vocab_multiple: int = 64) -> Path:
    """Write the model directory to ``path`` and return it."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(SPECIALS) + 400, special_tokens=SPECIALS, initial_alphabet=alphabet,
        show_progress=False))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                               pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    tok.add_tokens(TOOL_TOKENS)
    tok.save_pretrained(path)
    vocab = -(-len(tok) // vocab_multiple) * vocab_multiple  # padded beyond the tokenizer, as real models are
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return Path(path)
