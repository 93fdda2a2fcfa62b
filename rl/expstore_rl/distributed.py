"""FSDP2 set-up: one process per device under torchrun, or a single plain process.

Launch: ``torchrun --nproc-per-node N -m expstore_rl.grpo ...`` (gloo on CPU, nccl on
GPU). Without torchrun's environment (WORLD_SIZE unset or 1) nothing is initialised and
models stay plain modules: the single-process mode for small models.

FSDP2 (``fully_shard``) shards each decoder layer and then the root, over a 1-D
``init_device_mesh``. Gradients are averaged over ranks by FSDP's reduce-scatter;
losses are normalised by batch-wide counts, so ``Dist.loss_scale`` (= world size)
turns that average back into the sum the single-process step computes.
Rendezvous stays on loopback (MASTER_ADDR=127.0.0.1, GLOO_SOCKET_IFNAME=lo) unless the
environment says otherwise.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    mesh: Any = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def loss_scale(self) -> float:
        return float(self.world)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """x reduced over ranks (x itself in one process); op: sum or max. Travels via
        the device (nccl reduces GPU tensors only) and comes back on x's device."""
        if self.world == 1:
            return x
        y = x.to(self.device)
        dist.all_reduce(y, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return y.to(x.device)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; for batches and small state)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def init(backend: str | None = None) -> Dist:
    """Join the torchrun process group if there is one; else the single-process Dist."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    return Dist(rank, world, device, init_device_mesh(device.type, (world,)))


def shard(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """fully_shard every decoder layer, then the root (embeddings, norm, head); a no-op
    in one process. Works for frozen models too (the reference: forward only)."""
    model.to(d.device)
    if d.world == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=d.mesh)
    fully_shard(model, mesh=d.mesh)
    return model


def gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (FSDP2); off, they accumulate
    unsharded on each rank until a backward with sync on. A no-op for plain modules."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a HF causal LM (``model.model.layers``) or of a model that
    wraps one as ``.backbone``."""
    base = getattr(model, "backbone", model)
    return list(getattr(base, "model", base).layers)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU. Every rank must call it (it all-gathers); ranks
    other than 0 get an empty dict."""
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards); returns the norm before
    clipping. max_norm <= 0 only measures it."""
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def close(d: Dist | None = None) -> None:
    """Leave the group together, then let its threads go while Python is still whole.

    Every rank first waits for the others at a barrier: a rank that tears its gloo pairs
    down while its peer still reads from them can abort the peer. Then the group is
    destroyed, and its last references dropped: ``destroy_process_group`` only forgets
    the group, and its threads (gloo's loop and workers) run on until the last object
    holding it goes: ``d``'s mesh, and models sharded over it. Left running into the
    interpreter's shutdown, they aborted the process after its work was done ("terminate
    called without an active exception": about one run in 30 on a loaded machine). So
    pass ``d``, and call this once the sharded models are gone. (After FSDP steps,
    torch's own DTensor caches still hold the mesh, and with it the threads, until the
    interpreter clears them.)"""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    if d is not None:
        d.mesh = None
    gc.collect()  # the models' reference cycles, which hold the mesh
