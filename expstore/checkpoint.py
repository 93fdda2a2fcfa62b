"""Checkpoints: a consistent snapshot of a whole server, uploaded to the remote tier.

A checkpoint is the prefix ``<remote>/checkpoints/<name>/``::

    rocksdb/...              a RocksDB checkpoint of the data dir, its chunk files in rocksdb/blocks/
    tables/<t>.lance/...     each remote dataset (a table's chunks, its archive) as it was
                             at that instant, as a Lance dataset of its own
    checkpoint.json          the format, the remote tier it was taken from, its datasets
    _SEALED                  written last (``SealedObjects.seal``): a crash mid-upload leaves
                             nothing a restore would take

Taking one (``Checkpointer.create``): ``Catalog.checkpoint`` takes the RocksDB checkpoint
(hard links, after flushing the memtables without holding the GIL) and the versions of
the remote datasets as of the same instant; the upload and the copies then run from
immutable files while inserts and samples go on. Remote datasets are copied, not
referenced: hard links on a local disk, server-side copies on S3 (no bytes pass through
the server), so a checkpoint restores completely however long after it was taken,
whatever the live server freed and Lance cleaned up since.

Restoring one (``restore``): into an empty data dir, and into a remote tier of its own.
A restored server writes its remote datasets, so it must never write those of the server
the checkpoint was taken from (two writers of one Lance dataset lose commits): a restore
into that server's remote tier, or into one that holds any of the checkpoint's datasets
already, is refused; the checkpoint is then read by its URI (``locate``). Checkpoints
of the first format (RocksDB files at the top, no checkpoint.json) referenced remote
chunks in place and restore as they did, into the remote tier they reference.

Nothing a request names makes this module write or delete outside what the call
created: names are checked (``expstore.names``), a seal's paths must stay inside their
prefix (``SealedObjects.sealed_files``), local work happens in a directory the call made
for itself, and cleanup removes only that (and the datasets a failed restore created).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import fsspec

from . import names
from .errors import AlreadyExists, DataLoss, ExpstoreError, FailedPrecondition, InvalidArgument
from .tiers.remote import SealedObjects

log = logging.getLogger("expstore.checkpoint")
PREFIX = "checkpoints"
DESCRIPTOR = "checkpoint.json"
FORMAT = 2
_WORK = ".taking"  # suffix of the local directory a checkpoint is taken in


@dataclass(frozen=True)
class CheckpointInfo:
    name: str
    uri: str
    num_bytes: int
    seconds: float


class Checkpointer:
    """Checkpoints of one store (``expstore.catalog.Catalog``) into one SealedObjects, whose URI
    is that of the store's remote tier. Thread-safe: one checkpoint of a name at a time,
    any number of different names at once."""

    def __init__(self, store, remote: SealedObjects) -> None:
        self.store = store
        self.remote = remote
        self._work = Path(store.db.path) / PREFIX
        self._lock = threading.Lock()
        self._taking: set[str] = set()
        self._remove_crashed_work()

    def create(self, name: str | None = None) -> CheckpointInfo:
        name = names.check_checkpoint(name or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
                                      + f"-{time.time_ns() % 10**6:06d}")
        key = f"{PREFIX}/{name}"
        started = time.perf_counter()
        with self._claim(name):
            if self.remote.is_sealed(key):
                raise AlreadyExists(f"checkpoint {name!r} exists at {self.remote.uri}/{key}")
            self._work.mkdir(exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f"{name}.", suffix=_WORK, dir=self._work))
            try:
                held = self.store.checkpoint(work / "rocksdb")
                try:
                    for _, tier, _ in held:
                        if tier.uri != f"{self.remote.uri}/{tier.key}":
                            raise FailedPrecondition(f"remote dataset {tier.uri} is not under {self.remote.uri}, "
                                                     f"where checkpoints go: cannot copy it into one")
                    files = {f"rocksdb/{rel}": size
                             for rel, size in self.remote.put_files(work / "rocksdb", f"{key}/rocksdb").items()}
                    datasets = {}
                    for _, tier, version in held:
                        datasets[tier.key] = version
                        if version is not None:
                            files.update(self._copy_dataset(tier, version, key))
                finally:
                    self.store.release(held)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            descriptor = json.dumps({"format": FORMAT, "remote_uri": self.remote.uri, "datasets": datasets,
                                     "taken_at": time.time()}).encode()
            self.remote.put_bytes(descriptor, f"{key}/{DESCRIPTOR}")
            files[DESCRIPTOR] = len(descriptor)
            self.remote.seal(key, files)
        return CheckpointInfo(name, f"{self.remote.uri}/{key}", sum(files.values()), time.perf_counter() - started)

    def _copy_dataset(self, tier, version: int, key: str) -> dict[str, int]:
        """Version ``version`` of a remote tier's dataset into the checkpoint: its data
        files copied, then a commit making the copy a dataset of its own."""
        dest = f"{key}/{tier.key}"
        self.remote.copy({f"{tier.key}/{rel}": f"{dest}/{rel}" for rel in tier.version_files(version)})
        tier.clone(version, f"{self.remote.uri}/{dest}")
        return {f"{tier.key}/{rel}": size for rel, size in self.remote.sizes(dest).items()}

    @contextlib.contextmanager
    def _claim(self, name: str) -> Iterator[None]:
        with self._lock:
            if name in self._taking:
                raise AlreadyExists(f"checkpoint {name!r} is being taken")
            self._taking.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._taking.discard(name)

    def _remove_crashed_work(self) -> None:
        """Work directories of checkpoints a crashed server was taking (hard links that
        would hold disk space forever); none is in progress while we hold the data dir."""
        if self._work.is_dir():
            for path in self._work.glob(f"*{_WORK}"):
                log.info("removing %s, left by a checkpoint a crashed server was taking", path)
                shutil.rmtree(path, ignore_errors=True)


def locate(where: str, remote: SealedObjects) -> tuple[SealedObjects, str]:
    """The store and name of a checkpoint given by its name (in ``remote``) or by its URI
    (``<root>/checkpoints/<name>``, as ``Checkpointer.create`` reports it; read with
    ``remote``'s filesystem and credentials when on the same kind of store)."""
    if "://" not in where:
        return remote, names.check_checkpoint(where)
    root, _, name = where.rstrip("/").rpartition("/")
    if not root.endswith(f"/{PREFIX}"):
        raise InvalidArgument(f"checkpoint URI {where!r} must end in /{PREFIX}/<name>")
    root = root[:-len(PREFIX) - 1]
    same_kind = fsspec.core.split_protocol(root)[0] in remote.fs.protocol
    return SealedObjects(root, fs=remote.fs if same_kind else None), names.check_checkpoint(name)


def restore(source: SealedObjects, name: str, data_dir: str | Path, remote: SealedObjects) -> Path:
    """Restore checkpoint ``name`` of ``source`` into an empty data dir and the remote tier
    ``remote``: a server started on them restores every table as it was when the
    checkpoint was taken. Refused (FAILED_PRECONDITION, nothing written) when the data dir
    holds a database, or when ``remote`` is the remote tier the checkpoint was taken from
    or holds one of its datasets; DATA_LOSS for a seal or descriptor listing paths outside
    the checkpoint. A failed restore removes what it wrote."""
    name = names.check_checkpoint(name)
    key = f"{PREFIX}/{name}"
    data_dir = Path(data_dir)
    target = data_dir / "rocksdb"
    if target.exists() and any(target.iterdir()):
        raise FailedPrecondition(f"data dir {data_dir} already holds a database; restore into a fresh one")
    files = source.sealed_files(key)
    if DESCRIPTOR in files:
        taken_from, datasets = _descriptor(source, key, files)
        _check_own_remote(source, key, taken_from, remote, datasets)
        rocks_key, rocks = f"{key}/rocksdb", {rel[len("rocksdb/"):]: n for rel, n in files.items()
                                              if rel.startswith("rocksdb/")}
    else:  # the first format: RocksDB files at the top, remote chunks referenced in place
        datasets, rocks_key, rocks = {}, key, files
    data_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rocksdb.", suffix=".restoring", dir=data_dir))
    created: list[str] = []
    try:
        source.get_files(rocks_key, rocks, work)
        for dataset, dataset_files in datasets.items():
            if not dataset_files:
                continue
            created.append(dataset)
            source.copy({f"{key}/{rel}": rel for rel in dataset_files}, into=remote)
            have = {f"{dataset}/{rel}": n for rel, n in remote.sizes(dataset).items()}
            wrong = [rel for rel, n in dataset_files.items() if have.get(rel) != n]
            if wrong:
                raise DataLoss(f"restoring checkpoint {name!r}: {remote.uri}/{wrong[0]} has "
                               f"{have.get(wrong[0])} bytes after the copy, its seal says {dataset_files[wrong[0]]}")
        if target.exists():
            target.rmdir()  # empty (checked above)
        os.rename(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        for dataset in created:  # none existed before: _check_own_remote
            with contextlib.suppress(ExpstoreError):
                remote.delete_prefix(dataset)
        raise
    return target


def _descriptor(source: SealedObjects, key: str, files: dict[str, int]) -> tuple[str, dict[str, dict[str, int]]]:
    """The remote tier the checkpoint was taken from, and its remote datasets
    (``tables/<x>.lance``) with their files (paths relative to the checkpoint; none for a
    dataset that did not exist yet)."""
    where = f"checkpoint {source.uri}/{key}: {DESCRIPTOR}"
    try:
        descriptor = json.loads(source.read(f"{key}/{DESCRIPTOR}"))
        taken_from, named = descriptor["remote_uri"], list(descriptor["datasets"])
    except (ValueError, TypeError, KeyError):
        raise DataLoss(f"{where} is not a checkpoint descriptor") from None
    datasets = {}
    for dataset in named:
        parts = dataset.split("/") if isinstance(dataset, str) else []
        if len(parts) != 2 or parts[0] != "tables" or not parts[1].endswith(".lance") or parts[1] == ".lance":
            raise DataLoss(f"{where} names {dataset!r}, which is not a remote dataset; refusing it")
        datasets[dataset] = {rel: n for rel, n in files.items() if rel.startswith(f"{dataset}/")}
    if not isinstance(taken_from, str):
        raise DataLoss(f"{where} is not a checkpoint descriptor")
    return taken_from, datasets


def _check_own_remote(source: SealedObjects, key: str, taken_from: str, remote: SealedObjects,
                      datasets: dict) -> None:
    if _place(taken_from) == _place(remote.uri):
        raise FailedPrecondition(
            f"checkpoint {source.uri}/{key} was taken by the server whose remote tier is {taken_from}: a "
            f"restored server needs a remote tier of its own, or both would write the same Lance datasets; "
            f"restore with another --remote-uri and --restore-checkpoint {source.uri}/{key}")
    for dataset in datasets:
        if remote.exists(dataset):
            raise FailedPrecondition(
                f"remote tier {remote.uri} already holds {dataset}, a dataset of checkpoint {key}: a restored "
                f"server must not write a dataset another server may write; restore into a remote tier of "
                f"its own (or delete {remote.uri}/{dataset} if no server uses it)")


def _place(uri: str) -> tuple[str, str]:
    """Where a URI points, for comparing two spellings of it."""
    protocol, path = fsspec.core.split_protocol(uri.rstrip("/"))
    protocol = {None: "file", "local": "file", "s3a": "s3"}.get(protocol, protocol)
    return protocol, os.path.realpath(path) if protocol == "file" else path.strip("/")
