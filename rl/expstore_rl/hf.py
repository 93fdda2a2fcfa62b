"""Your own model: a Hugging Face causal LM directory (``--model PATH``) as the policy of
producers and trainers, in place of the toy model of ``model.py``.

The directory is what ``save_pretrained`` writes for a model and its tokenizer:
``config.json``, the weights (safetensors), the tokenizer files and a chat template
(``chat.HFChat`` reads them). Nothing is downloaded (``local_files_only``). Models load in
fp32, the dtype the engines and the trainer compute logprobs in, so that both sides agree.

The files that are not weights or config (tokenizer, chat template, generation config)
travel with every published version (``model_files`` -> ``weights.publish(files=...)``),
so a version directory is itself a model directory: ``from_pretrained`` and vLLM load it,
and ``AutoTokenizer`` finds the tokenizer there.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from . import weights

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
"""Files of a model directory that hold weights (or their index): not copied by ``model_files``."""


def require_model_dir(path: str) -> Path:
    """``path`` as a Path, or a ValueError saying what is missing."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model directory {path}: not a directory (a Hugging Face model directory: config.json, "
                         "safetensors weights, tokenizer files; nothing is downloaded)")
    if not (p / "config.json").is_file():
        raise ValueError(f"model directory {path}: no config.json (what save_pretrained writes)")
    return p


def load_model(path: str) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` in fp32, in eval mode."""
    import transformers

    require_model_dir(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    return model.float().eval()


@lru_cache(maxsize=8)
def _files(path: str) -> Mapping[str, bytes]:
    out = {}
    for f in sorted(require_model_dir(path).iterdir()):
        reserved = f.name in (weights.WEIGHTS, weights.CONFIG, weights.MARKER)
        if f.is_file() and not f.name.startswith(".") and not reserved and not f.name.endswith(WEIGHT_SUFFIXES):
            out[f.name] = f.read_bytes()
    return MappingProxyType(out)


def model_files(path: str | None) -> Mapping[str, bytes]:
    """The files of model directory ``path`` other than weights and config.json (the
    tokenizer, its chat template, generation_config.json, ...), by name: what
    ``weights.publish`` writes beside each version. Read once per path; {} for None."""
    return _files(os.path.abspath(path)) if path else MappingProxyType({})
