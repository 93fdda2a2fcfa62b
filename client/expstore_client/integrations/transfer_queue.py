"""expstore as a TransferQueue storage backend: verl's data flow, crash-durable.

TransferQueue (the data plane of verl, ROLL, NeMo-RL) splits into a controller (which
samples exist in each partition, which fields each one has, what each task consumed,
samplers such as GRPOGroupNSampler, kv keys and tags) and a pluggable storage backend
that holds the field values. This module registers expstore as that backend, by name:

    backend:
      storage_backend: Expstore
      Expstore:
        target: "expstore-0:50051"    # the server (required)
        table: transfer_queue         # created if missing (generic, durable)

Importing this module registers it (``StorageManagerFactory`` "Expstore", storage client
"ExpstoreStorageClient", bootstrap provider "Expstore"); every process that initialises
TransferQueue must import it first. Under Ray, name ``register`` as the workers' setup
hook: ``runtime_env={"worker_process_setup_hook":
"expstore_client.integrations.transfer_queue.register"}`` (docs/integrations.md).

What TransferQueue promises keeps working, because its controller is untouched: put and
get by fields and global indexes, ``kv_*`` keys and tags, partitions, consumption status
per task, production status, its samplers. What expstore adds: every value put is an
acknowledged row of a durable expstore table before ``put`` returns (``durability``:
"wal" survives a ``kill -9`` of the server, "fsync" a power loss), and the data outlives
the TransferQueue processes: ``tq.save_checkpoint`` records the controller's metadata
(which maps each sample's fields to expstore item ids) plus this backend's table, and
``tq.load_checkpoint`` in a new run finds every value again, checking each row's key.

Layout: one row per (sample, field) value put: ``key`` ("<put id>/<global index>@<field>",
unique per put, so a retried insert is stored once and a re-put of a field is a new row),
``field``, ``global_index``, then the value (``_values``: kind, dtype, shape, data bytes).
The item id of each row is the value's ``custom_backend_meta`` in the controller, so a get
is one ``Get`` by ids. Queryable: ``SELECT field, count(*) FROM transfer_queue GROUP BY
field``. ``clear`` forgets keys in the controller only: rows stay as the run's history
until the table's ``max_size`` evicts the oldest (expstore never deletes by id).

Calls that meet UNAVAILABLE (the server restarting) are retried for ``retry_s``; a
retried insert is idempotent by its keys.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, TypeVar

import grpc
import pyarrow as pa
import torch
import zmq
from transfer_queue.storage.bootstrap import StorageBootstrapProvider
from transfer_queue.storage.clients.base import StorageClientFactory, StorageKVClient
from transfer_queue.storage.managers.base import KVStorageManager, StorageManagerFactory
from transfer_queue.utils.zmq_utils import ZMQServerInfo

from .. import Client
from ..retry import retry_unavailable
from . import _values

log = logging.getLogger("expstore.transfer_queue")
T = TypeVar("T")

BACKEND = "Expstore"
STORAGE_CLIENT = "ExpstoreStorageClient"
CHECKPOINT_FILE = "expstore.json"

SCHEMA = pa.schema([pa.field("key", pa.string(), nullable=False), pa.field("field", pa.string(), nullable=False),
                    pa.field("global_index", pa.int64(), nullable=False), *_values.FIELDS])


@dataclass(frozen=True)
class Settings:
    """``backend.Expstore`` of the TransferQueue config."""

    target: str                      # "host:port" of the expstore server
    table: str = "transfer_queue"    # the generic table holding the values (created if missing)
    token: str | None = None         # bearer token; needs producer, reader (and admin to create the table)
    token_env: str | None = None     # or: the environment variable holding it
    tls_ca: str | None = None        # PEM of the root certificate to trust: TLS
    durability: str = "wal"          # what a put survives: "wal" (kill -9 of the server) or "fsync"
    max_size: int = 10_000_000       # rows kept (one per sample and field put); the oldest go first
    retry_s: float = 60.0            # how long calls retry while the server is UNAVAILABLE
    timeout_s: float = 60.0          # the deadline of each call

    @classmethod
    def of(cls, config: Any) -> "Settings":
        raw = _plain(config)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - {"client_name"})
        if unknown:
            raise ValueError(f"backend.{BACKEND}: unknown keys {unknown} (known: {sorted(known)})")
        if not raw.get("target"):
            raise ValueError(f"backend.{BACKEND}.target: the expstore server's host:port is required")
        return cls(**{k: v for k, v in raw.items() if k in known})

    def connect(self) -> Client:
        token = self.token or (os.environ.get(self.token_env) if self.token_env else None)
        # Reconnect within a second of a restarted server (gRPC's default backoff grows to 2 minutes).
        return Client(self.target, token, tls=self.tls_ca, timeout=self.timeout_s,
                      channel_options=[("grpc.max_reconnect_backoff_ms", 1000),
                                       ("grpc.initial_reconnect_backoff_ms", 100)])

    def ensure_table(self, client: Client) -> None:
        try:
            info = client.describe(self.table)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        else:
            if not set(SCHEMA.names) <= set(info.schema.names):
                raise ValueError(f"expstore table {self.table!r} exists and is not a TransferQueue table "
                                 f"(columns {info.schema.names}); name another in backend.{BACKEND}.table")
            return
        client.create_table(self.table, kind="generic", schema=SCHEMA, key_column="key", sampler="fifo",
                            durability=self.durability, max_size=self.max_size, if_not_exists=True)


def _plain(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    return dict(config)


def retrying(settings: Settings, call: Callable[[], T]) -> T:
    """``call()``, again while the server answers UNAVAILABLE, for up to ``retry_s``."""
    return retry_unavailable(call, settings.retry_s, lambda e: log.warning(
        "expstore at %s unavailable (%s); retrying", settings.target, e.details()))


def split_key(key: str) -> tuple[int, str]:
    """TransferQueue's KV key "<global index>@<field>" -> (global index, field)."""
    index, sep, field = key.partition("@")
    if not sep or not index.lstrip("-").isdigit():
        raise ValueError(f"TransferQueue key {key!r}: expected '<global index>@<field>'")
    return int(index), field


@StorageClientFactory.register(STORAGE_CLIENT)
class ExpstoreStorageClient(StorageKVClient):
    """TransferQueue's KV storage client over one expstore table (thread-safe)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.settings = Settings.of(config)
        self.client = self.settings.connect()
        retrying(self.settings, lambda: self.settings.ensure_table(self.client))

    def put(self, keys: list[str], values: list[Any]) -> list[int]:
        """Store ``values`` under ``keys``; returns each one's expstore item id (its
        custom_backend_meta) once the rows are acknowledged at ``durability``."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        if not keys:
            return []
        put_id = uuid.uuid4().hex
        indexes, names = zip(*(split_key(k) for k in keys))
        rows = pa.table({"key": pa.array([f"{put_id}/{k}" for k in keys], pa.string()),
                         "field": pa.array(names, pa.string()), "global_index": pa.array(indexes, pa.int64()),
                         **_values.encode(values, keys)}, schema=SCHEMA)
        result = retrying(self.settings, lambda: self.client.insert(self.settings.table, rows,
                                                                     durability=self.settings.durability))
        return [int(i) for i in result.item_ids]

    def get(self, keys: list[str], shapes=None, dtypes=None, custom_backend_meta=None) -> list[Any]:
        """The values of ``keys``, by the item ids their puts returned. Each row's key is
        checked against the one asked for: a value is never handed to the wrong field."""
        if not keys:
            return []
        ids = list(custom_backend_meta or [])
        missing = [k for k, i in zip(keys, ids + [None] * (len(keys) - len(ids))) if i is None]
        if missing:
            raise KeyError(f"expstore table {self.settings.table!r}: no item id recorded for keys {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''} (were they put through the Expstore backend?)")
        try:
            batch = retrying(self.settings, lambda: self.client.get(self.settings.table, ids))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise KeyError(f"expstore table {self.settings.table!r}: {e.details()} (evicted by max_size "
                               f"{self.settings.max_size}, lost at durability 'memory', or another table?)") from None
            raise
        stored = batch.column("key").to_pylist()
        for key, item, got in zip(keys, ids, stored):
            if got.partition("/")[2] != key:
                raise RuntimeError(f"expstore table {self.settings.table!r}: item {item} holds {got!r}, "
                                   f"not TransferQueue key {key!r}")
        return _values.decode(batch.data)

    def clear(self, keys: list[str], custom_backend_meta=None) -> None:
        """Nothing to free: the rows stay as the run's history until max_size evicts them."""
        log.debug("clear of %d keys: kept in %s until evicted", len(keys), self.settings.table)


@StorageManagerFactory.register(BACKEND)
class ExpstoreStorageManager(KVStorageManager):
    """TransferQueue's storage manager for ``storage_backend: Expstore``."""

    def __init__(self, controller_info: ZMQServerInfo, config: Any,
                 zmq_context: zmq.asyncio.Context | None = None) -> None:
        config = _plain(config)
        if config.get("client_name") not in (None, STORAGE_CLIENT):
            raise ValueError(f"the {BACKEND} backend uses {STORAGE_CLIENT}, not {config['client_name']!r}")
        super().__init__(controller_info, {**config, "client_name": STORAGE_CLIENT}, zmq_context=zmq_context)

    async def get_data(self, metadata) -> Any:
        """As the KV backends return it, except that a field whose values all have one
        shape comes back as one dense tensor, as it was put (not a nested tensor)."""
        data = await super().get_data(metadata)
        for name, value in list(data.items()):
            if isinstance(value, torch.Tensor) and value.is_nested:
                parts = value.unbind()
                if parts and all(p.shape == parts[0].shape for p in parts):
                    data[name] = torch.stack(parts)
        return data

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """The values are in expstore already: record where (the server's own checkpoint,
        ``client.checkpoint()``, snapshots them)."""
        settings = self.storage_client.settings
        info = await asyncio.get_running_loop().run_in_executor(
            None, lambda: retrying(settings, lambda: self.storage_client.client.describe(settings.table)))
        record = {"backend": BACKEND, "target": settings.target, "table": settings.table,
                  "rows": info.num_items, "saved_at": time.time()}
        path = Path(checkpoint_dir) / CHECKPOINT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Check that this run reads the table the checkpoint's values are in."""
        path = Path(checkpoint_dir) / CHECKPOINT_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path}: not a checkpoint of the {BACKEND} backend")
        record = json.loads(path.read_text())
        settings = self.storage_client.settings
        if record.get("table") != settings.table:
            raise ValueError(f"checkpoint {checkpoint_dir}: its values are in expstore table {record.get('table')!r}, "
                             f"this run's backend.{BACKEND}.table is {settings.table!r}")
        await asyncio.get_running_loop().run_in_executor(
            None, lambda: retrying(settings, lambda: self.storage_client.client.describe(settings.table)))


@StorageBootstrapProvider.register_provider(BACKEND)
def bootstrap(conf: Any) -> dict[str, str]:
    """Run once by ``tq.init``: check the server and create the table."""
    settings = Settings.of(conf.backend[BACKEND])
    client = settings.connect()
    try:
        retrying(settings, lambda: settings.ensure_table(client))
    finally:
        client.close()
    return {"target": settings.target, "table": settings.table}


def register() -> None:
    """Ray's ``worker_process_setup_hook``: importing this module registered the backend."""
