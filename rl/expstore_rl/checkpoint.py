"""Trainer checkpoints: models, optimizers and loop state, resumable where a run stopped.

Layout under ``<dir>``::

    step_000120/        torch.distributed.checkpoint (DCP): each rank writes its own shards
        .metadata, __0_0.distcp, ...
        trainer.pt      loop state from rank 0: step, policy version, RNG, data-source state
    latest              text: the name of the newest complete checkpoint

A checkpoint is written to ``step_N.tmp`` and renamed once every rank has finished, and
``latest`` is replaced atomically after that, so a crash mid-save leaves the previous
checkpoint in charge. DCP's sharded format reloads under another world size (it reshards),
and in a single process with no process group at all. Older checkpoints beyond ``keep``
are deleted.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .distributed import Dist

Pairs = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
"""Named (model, optimizer) pairs: {"policy": (...), "critic": (...)}."""


def _states(pairs: Pairs) -> dict[str, dict]:
    out = {}
    for name, (model, opt) in pairs.items():
        msd, osd = get_state_dict(model, opt)
        out[name] = {"model": msd, "optim": osd}
    return out


def save(directory: str | Path, step: int, pairs: Pairs, loop_state: dict[str, Any], d: Dist,
         keep: int = 2) -> Path:
    """Write checkpoint ``step``; every rank must call it. Returns its path."""
    root = Path(directory)
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    if d.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    d.barrier()
    with warnings.catch_warnings():  # single process: DCP warns that it saves locally, as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(_states(pairs), checkpoint_id=str(tmp))
    if d.main:
        torch.save({"step": step, **loop_state}, tmp / "trainer.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        for old in sorted(root.glob("step_??????"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    d.barrier()
    return final


def latest(directory: str | Path) -> Path | None:
    pointer = Path(directory) / "latest"
    return Path(directory) / pointer.read_text().strip() if pointer.exists() else None


def load(path: str | Path, pairs: Pairs) -> dict[str, Any]:
    """Restore models and optimizers in place from ``path``; returns the loop state.
    Every rank must call it; the models must be built (and sharded) as when saved."""
    states = _states(pairs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(states, checkpoint_id=str(path))
    for name, (model, opt) in pairs.items():
        set_state_dict(model, opt, model_state_dict=states[name]["model"],
                       optim_state_dict=states[name]["optim"])
    return torch.load(Path(path) / "trainer.pt", weights_only=False)
