"""Checkpoints: a consistent snapshot of a whole server, uploaded to the remote tier.

RocksDB's checkpoint is a point-in-time copy of every column family made of hard links
(it flushes the memtables first), so taking one costs milliseconds and holds no table
lock; the upload then runs from those immutable files while inserts and samples go on.
The prefix ``checkpoints/<name>/`` is sealed last (``RemoteStore.put_dir``), so a crash
mid-upload leaves nothing a restore would take. Chunks already demoted to the remote tier
are referenced in place, not copied: a restore must use the same remote tier.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import names
from .errors import AlreadyExists, FailedPrecondition
from .tiers.rocks import Database

PREFIX = "checkpoints"


@dataclass(frozen=True)
class CheckpointInfo:
    name: str
    uri: str
    num_bytes: int
    seconds: float


class Checkpointer:
    def __init__(self, db: Database, remote) -> None:
        self.db = db
        self.remote = remote  # a tiers.remote.RemoteStore

    def create(self, name: str | None = None) -> CheckpointInfo:
        name = names.check_checkpoint(name or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                                      + f"-{time.time_ns() % 10**6:06d}")
        key = f"{PREFIX}/{name}"
        if key in self.remote.list_sealed(PREFIX):
            raise AlreadyExists(f"checkpoint {name!r} exists at {self.remote.uri}/{key}")
        started = time.perf_counter()
        local = self.db.path / "checkpoints" / name
        if local.exists():
            raise AlreadyExists(f"checkpoint {name!r} is being taken")
        local.parent.mkdir(exist_ok=True)
        try:
            self.db.checkpoint(local)
            num_bytes = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
            self.remote.put_dir(local, key)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return CheckpointInfo(name, f"{self.remote.uri}/{key}", num_bytes, time.perf_counter() - started)


def restore(remote, name: str, data_dir: str | Path) -> Path:
    """Download checkpoint ``name`` into an empty data dir; a server started on it
    restores every table as it was when the checkpoint was taken."""
    target = Path(data_dir) / "rocksdb"
    if target.exists() and any(target.iterdir()):
        raise FailedPrecondition(f"data dir {data_dir} already holds a database; restore into a fresh one")
    return remote.get_dir(f"{PREFIX}/{name}", target)
