"""Versioned policy weights on any fsspec filesystem: ``<uri>/v<N>/`` holds
``model.safetensors`` and ``config.json`` in the Hugging Face layout (loadable by
``AutoModelForCausalLM.from_pretrained`` and by vLLM), the model's other files when given
(tokenizer, chat template: ``hf.model_files``) and a ``_PUBLISHED`` marker.

Publication is atomic for readers under one rule on every backend: a version is visible
only once its ``_PUBLISHED`` marker exists, and the marker is written last. Each file is
first written under a temporary name and then renamed (a rename on local disks; a copy on
object stores, where the marker is what makes the version visible). A version is never
rewritten: publishing an existing version raises FileExistsError, so a producer's cached
copy of ``v<N>`` is always the right one.

>>> publish(model.state_dict(), model.config.to_dict(), "file:///tmp/w", 3)
'file:///tmp/w/v3'
>>> latest_version("file:///tmp/w")
3
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Mapping

import fsspec
import torch
from safetensors.torch import load as st_load, save as st_save

WEIGHTS, CONFIG, MARKER = "model.safetensors", "config.json", "_PUBLISHED"
CACHE_DIR = Path(os.environ.get("EXPSTORE_RL_CACHE", Path(tempfile.gettempdir()) / "expstore_rl_weights"))
"""Where ``local_path`` downloads remote versions (override with $EXPSTORE_RL_CACHE)."""

_VERSION = re.compile(r"/v(\d+)/" + MARKER + "$")


def _fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, root = fsspec.core.url_to_fs(uri)
    return fs, root.rstrip("/")


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in ([fs.protocol] if isinstance(fs.protocol, str) else fs.protocol)


def publish(state_dict: dict[str, torch.Tensor], config: dict, uri: str, version: int,
            files: Mapping[str, bytes] | None = None) -> str:
    """Write version ``version`` and return its uri (``<uri>/v<N>``). ``config`` is the HF
    config dict (``model.config.to_dict()``); ``files``: more files of the version by
    name (the tokenizer's, so that the directory is a whole model directory). A tied
    ``lm_head.weight`` is left out, as Hugging Face does (safetensors refuses shared
    tensors)."""
    if version < 0:
        raise ValueError("version must be >= 0")
    files = dict(files or {})
    for name in files:
        if name in (WEIGHTS, CONFIG, MARKER) or "/" in name or name.startswith("."):
            raise ValueError(f"publish: {name!r} cannot be an extra file of a version (reserved or not a plain name)")
    fs, root = _fs(uri)
    vdir = f"{root}/v{version}"
    if fs.exists(f"{vdir}/{MARKER}"):
        raise FileExistsError(f"{uri}/v{version} is already published; versions are never rewritten")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()
               if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    files |= {WEIGHTS: st_save(tensors, metadata={"format": "pt"}),
              CONFIG: json.dumps(config, indent=2, sort_keys=True).encode(),
              MARKER: json.dumps({"version": version}).encode()}  # last (dicts keep insertion order)
    fs.makedirs(vdir, exist_ok=True)
    for name, data in files.items():
        tmp = f"{vdir}/.{name}.{uuid.uuid4().hex}.tmp"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, f"{vdir}/{name}")
    return f"{uri.rstrip('/')}/v{version}"


def versions(uri: str) -> list[int]:
    """Published versions, ascending."""
    fs, root = _fs(uri)
    found = []
    for path in fs.glob(f"{root}/v*/{MARKER}"):
        m = _VERSION.search("/" + path.lstrip("/"))
        if m:
            found.append(int(m.group(1)))
    return sorted(found)


def latest_version(uri: str) -> int | None:
    """The newest published version, or None when there is none (or ``uri`` is missing)."""
    found = versions(uri)
    return found[-1] if found else None


def load_dir(path: str) -> dict[str, torch.Tensor]:
    """The state dict stored in a version directory (local path or uri), with a tied
    ``lm_head.weight`` restored so that ``model.load_state_dict(sd)`` works strictly."""
    fs, root = _fs(path)
    config = json.loads(fs.cat_file(f"{root}/{CONFIG}"))
    sd = st_load(fs.cat_file(f"{root}/{WEIGHTS}"))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def load_state_dict(uri: str, version: int) -> dict[str, torch.Tensor]:
    _require_published(uri, version)
    return load_dir(f"{uri.rstrip('/')}/v{version}")


def local_path(uri: str, version: int) -> str:
    """A local directory holding version ``version`` (vLLM loads from local disk only).
    Local uris are returned as they are; remote ones are downloaded once, every file of
    the version, into ``CACHE_DIR`` (atomically: to a temporary dir, then renamed)."""
    fs, root = _fs(uri)
    _require_published(uri, version)
    if _is_local(fs):
        return f"{root}/v{version}"
    key = hashlib.sha256(f"{fs.protocol}://{root}".encode()).hexdigest()[:16]
    dest = CACHE_DIR / key / f"v{version}"
    if not (dest / MARKER).exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".download-"))
        entries = fs.ls(f"{root}/v{version}", detail=True)
        names = [Path(e["name"]).name for e in entries if e["type"] == "file"]
        for name in sorted((n for n in names if not n.startswith(".")), key=lambda n: n == MARKER):
            fs.get_file(f"{root}/v{version}/{name}", str(tmp / name))
        try:
            tmp.rename(dest)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def _require_published(uri: str, version: int) -> None:
    fs, root = _fs(uri)
    if not fs.exists(f"{root}/v{version}/{MARKER}"):
        raise FileNotFoundError(f"{uri}/v{version} is not published (no {MARKER} marker)")
