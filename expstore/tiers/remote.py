"""Remote tier: chunks as whole fragments of a per-table Lance dataset, on ``file://`` or S3.

Layout: ``<uri>/tables/<table>.lance``, one Lance fragment per chunk, with two constant
columns added (and dropped on read): ``_chunk`` (the chunk id) and ``_nbytes`` (the
chunk's Arrow buffer size when it was put, so ``nbytes`` means what it means in the memory
tier and survives a reopen). The tier is only ever read in whole fragments (a few large
GETs each): a Lance ``take`` of 256 random rows cost ~20 ms on local disk but
~13 s against a local S3 server, while a fragment scan streams at disk or network speed.
Callers promote what they read into a faster tier before sampling.

Sealed publish: a fragment's data file is written first and becomes visible only when the
manifest of the next version is written, as one object PUT (S3) or one atomic create
(local disk); a crash in between leaves an unreferenced file no reader sees (Lance's
cleanup removes such orphans once they are a week old). ``delete`` drops whole fragments from the manifest (no
deletion vectors); their files are removed once no version younger than ``RETAIN``
references them, so a scan of an older snapshot in flight keeps working meanwhile.

Any network or endpoint failure raises ``Unavailable`` naming the URI, so callers retry
with backoff and health can report degraded; after one, the tier re-reads the latest
version before its next write (the failed commit may have landed).

Concurrency: like every tier, not thread-safe (the table holds its lock); ``get`` reads
fragments concurrently on the tier's own small thread pool. One writer per dataset (the
server's data-dir lock); readers of the same URI in other processes are fine.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator

import fsspec
import lance
import numpy as np
import pyarrow as pa

from ..errors import AlreadyExists, DataLoss, ExpstoreError, InvalidArgument, NotFound, Unavailable

try:  # s3fs is the optional ``s3`` extra; botocore comes with it
    from botocore.exceptions import BotoCoreError as _BotoError
except ImportError:  # pragma: no cover - without s3fs there are no botocore errors to map
    _BotoError = OSError

_INTERNAL = ("_chunk", "_nbytes")


def lance_storage_options(endpoint: str | None = None, region: str | None = None, key: str | None = None,
                          secret: str | None = None) -> dict[str, str]:
    """Our S3 config as Lance (object_store) storage options; each unset value falls back to
    the usual environment variable (AWS_ENDPOINT_URL, AWS_REGION or AWS_DEFAULT_REGION,
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY). An ``http://`` endpoint turns on allow_http."""
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    options = {
        "aws_endpoint": endpoint,
        "aws_region": region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"),
        "aws_access_key_id": key or os.environ.get("AWS_ACCESS_KEY_ID"),
        "aws_secret_access_key": secret or os.environ.get("AWS_SECRET_ACCESS_KEY"),
    }
    if endpoint and endpoint.startswith("http://"):
        options["allow_http"] = "true"
    return {k: v for k, v in options.items() if v}


def fsspec_filesystem(uri: str, endpoint: str | None = None, region: str | None = None, key: str | None = None,
                      secret: str | None = None, **options) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem for ``uri`` (``s3://`` through s3fs with the same config and
    fallbacks as ``lance_storage_options``; anything else by its protocol). ``options`` go
    to the filesystem as they are (s3fs: ``retries``, ``config_kwargs``...)."""
    protocol = fsspec.core.split_protocol(uri)[0] or "file"
    if protocol not in ("s3", "s3a"):
        return fsspec.filesystem(protocol, **options)
    s3 = lance_storage_options(endpoint, region, key, secret)
    client = {**options.pop("client_kwargs", {})}
    if "aws_endpoint" in s3:
        client["endpoint_url"] = s3["aws_endpoint"]
    if "aws_region" in s3:
        client["region_name"] = s3["aws_region"]
    return fsspec.filesystem("s3", key=s3.get("aws_access_key_id"), secret=s3.get("aws_secret_access_key"),
                             client_kwargs=client, **options)


def _is_network_error(e: BaseException) -> bool:
    # Lance raises its I/O errors as OSError, ValueError or ArrowInvalid, all "LanceError(IO): ...".
    return isinstance(e, (OSError, _BotoError)) or "LanceError(IO)" in str(e)


@contextmanager
def _unavailable(where: str) -> Iterator[None]:
    try:
        yield
    except ExpstoreError:
        raise
    except Exception as e:
        if _is_network_error(e):
            raise Unavailable(f"{where}: {e}") from e
        raise


class RemoteTier:
    """Chunks of one table as Lance fragments under ``uri`` (see the module docstring).

    ``put`` is one commit (a data file and a manifest: two PUTs on S3, O(fragments) manifest
    bytes). ``get`` is one fragment read per chunk, up to READERS at a time. ``delete`` is
    one commit. Opening reads the two internal columns of every fragment (tiny, constant)."""

    name = "remote"
    READERS = 8                      # concurrent fragment reads in one ``get``
    RETAIN = timedelta(minutes=10)   # old versions (and dropped fragments' files) are kept this long

    def __init__(self, uri: str, table: str, *, storage_options: dict | None = None, budget: int = 2**62) -> None:
        self.uri = f"{uri.rstrip('/')}/tables/{table}.lance"
        self._options = storage_options
        self._budget = budget
        self._ds: lance.LanceDataset | None = None
        self._schema: pa.Schema | None = None  # the chunks' schema, internal columns dropped
        self._fragments: dict[int, int] = {}   # chunk id -> fragment id
        self._sizes: dict[int, int] = {}       # chunk id -> Arrow buffer bytes
        self._nbytes = 0
        self._stale = False                    # a write failed: its commit may have landed
        self._cleaned = time.monotonic()
        self._pool = ThreadPoolExecutor(self.READERS, thread_name_prefix="remote-tier")
        with _unavailable(f"remote tier {self.uri}"):
            self._sync()

    @property
    def nbytes(self) -> int:
        """Arrow buffer bytes of the chunks held, as they were put (the memory tier's measure)."""
        return self._nbytes

    @property
    def budget(self) -> int:
        return self._budget

    def __len__(self) -> int:
        return len(self._fragments)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._fragments

    def size_of(self, chunk_id: int) -> int:
        return self._sizes[chunk_id]

    def chunk_ids(self) -> list[int]:
        return list(self._fragments)

    def close(self) -> None:
        self._pool.shutdown()

    def _sync(self) -> None:
        """Point at the latest version (if the dataset exists yet) and bring the chunk ->
        fragment map up to date, reading the internal columns of fragments not yet known."""
        if self._ds is None:
            try:
                self._ds = lance.dataset(self.uri, storage_options=self._options)
            except ValueError as e:
                if "was not found" not in str(e):
                    raise
                self._stale = False
                return
        elif self._stale:
            self._ds.checkout_latest()
        self._schema = pa.schema([f for f in self._ds.schema if f.name not in _INTERNAL],
                                 metadata=self._ds.schema.metadata)
        present = {f.fragment_id: f for f in self._ds.get_fragments()}
        for c in [c for c, fid in self._fragments.items() if fid not in present]:
            del self._fragments[c]
            self._nbytes -= self._sizes.pop(c)
        known = set(self._fragments.values())
        new = [f for fid, f in present.items() if fid not in known]
        self._stale = False
        if not new:
            return
        t = self._ds.scanner(columns=list(_INTERNAL), with_row_address=True, fragments=new).to_table()
        fids = t["_rowaddr"].to_numpy() >> 32
        _, first = np.unique(fids, return_index=True)
        chunks, sizes = t["_chunk"].to_numpy()[first], t["_nbytes"].to_numpy()[first]
        for fid, c, size in zip(fids[first].tolist(), chunks.tolist(), sizes.tolist()):
            self._fragments[c] = fid
            self._sizes[c] = size
            self._nbytes += size

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        with _unavailable(f"remote tier {self.uri}: {what}"):
            if self._stale:
                self._sync()
            try:
                yield
            except Exception as e:
                self._stale = _is_network_error(e)
                raise

    def put(self, chunk_id: int, batch: pa.RecordBatch) -> None:
        """Store a chunk as one new fragment. Chunk ids are never reused, so putting a held id
        again is a no-op: a put retried after ``Unavailable`` whose first attempt landed."""
        if batch.num_rows == 0:
            raise InvalidArgument(f"chunk {chunk_id} is empty: the remote tier stores no empty chunks")
        with self._writing(f"put chunk {chunk_id}"):
            if chunk_id in self._fragments:
                return
            if self._schema is not None and not batch.schema.equals(self._schema, check_metadata=True):
                raise InvalidArgument(f"chunk {chunk_id} has a schema other than the remote table {self.uri}'s:"
                                      f" {batch.schema} != {self._schema}")
            size = batch.get_total_buffer_size()
            n = batch.num_rows
            data = batch.append_column("_chunk", pa.array(np.full(n, chunk_id, np.int64)))
            data = data.append_column("_nbytes", pa.array(np.full(n, size, np.int64)))
            exists = self._ds is not None  # (a dataset with no rows is falsy)
            self._ds = lance.write_dataset(data, self._ds if exists else self.uri, mode="append" if exists else "create",
                                           max_rows_per_file=n, storage_options=self._options)
            self._schema = batch.schema
            self._fragments[chunk_id] = self._ds.get_fragments()[-1].fragment_id
            self._sizes[chunk_id] = size
            self._nbytes += size
            self._clean()

    def get(self, chunk_ids: Iterable[int]) -> dict[int, pa.RecordBatch]:
        """Read whole fragments, concurrently when there are several; each batch has exactly
        the schema it was put with."""
        ids = list(dict.fromkeys(chunk_ids))
        for c in ids:
            if c not in self._fragments:
                raise NotFound(f"chunk {c} is not in the remote tier {self.uri}")
        with _unavailable(f"remote tier {self.uri}: get {len(ids)} chunks"):
            fragments = [self._ds.get_fragment(self._fragments[c]) for c in ids]
            batches = list(self._pool.map(self._read, fragments) if len(ids) > 1 else map(self._read, fragments))
        return dict(zip(ids, batches))

    def _read(self, fragment: lance.LanceFragment) -> pa.RecordBatch:
        t = fragment.to_table(columns=self._schema.names).combine_chunks()
        return pa.RecordBatch.from_arrays([col.chunks[0] for col in t.columns], schema=self._schema)

    def delete(self, chunk_ids: Iterable[int]) -> None:
        """Drop the chunks' fragments in one commit; unknown ids are ignored."""
        ids = [c for c in dict.fromkeys(chunk_ids) if c in self._fragments]
        if not ids:
            return
        with self._writing(f"delete {len(ids)} chunks"):
            op = lance.LanceOperation.Delete([], [self._fragments[c] for c in ids],
                                             f"_chunk IN ({', '.join(map(str, ids))})")
            self._ds = lance.LanceDataset.commit(self._ds, op, read_version=self._ds.version)
            for c in ids:
                del self._fragments[c]
                self._nbytes -= self._sizes.pop(c)
            self._clean()

    def _clean(self) -> None:
        """At most once per RETAIN, after a commit: remove versions older than RETAIN and the
        files only they reference (dropped fragments). Keeps the version listing each commit
        does, and the bucket, from growing without bound."""
        if time.monotonic() - self._cleaned >= self.RETAIN.total_seconds():
            self._ds.cleanup_old_versions(older_than=self.RETAIN)
            self._cleaned = time.monotonic()

    def scan(self, columns: list[str] | None = None, filter: str | None = None, *,
             with_chunk: bool = False) -> pa.RecordBatchReader:
        """A Lance scan of the table's latest version with column selection and filter
        pushdown (a SQL predicate, which may name ``_chunk``); ``with_chunk`` adds the
        ``_chunk`` column. For queries and audits: it reads every fragment it needs whole."""
        if self._ds is None:
            return pa.RecordBatchReader.from_batches(pa.schema([]), [])
        if columns is None:
            columns = self._schema.names + (["_chunk"] if with_chunk else [])
        with _unavailable(f"remote tier {self.uri}: scan"):
            return self._ds.scanner(columns=columns, filter=filter).to_reader()


class RemoteStore:
    """Plain sealed objects under ``uri`` (checkpoints), through fsspec.

    A single object is sealed by the store itself: on S3 a PUT (or multipart upload) is
    visible whole or not at all; on a local disk it is written aside and renamed. A
    directory is sealed by a ``_SEALED`` object written last, listing each file's size: a
    prefix without one is an upload in progress or a crashed one, and ``get_dir`` refuses it.
    A sealed prefix is immutable (``put_dir`` onto one raises AlreadyExists)."""

    MARKER = "_SEALED"

    def __init__(self, uri: str, *, fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.fs = fs or fsspec_filesystem(uri)
        self._root = self.fs._strip_protocol(self.uri)
        self._local = "file" in self.fs.protocol

    def _path(self, key: str) -> str:
        return f"{self._root}/{key.strip('/')}" if key.strip("/") else self._root

    @contextmanager
    def _io(self, what: str) -> Iterator[None]:
        with _unavailable(f"remote store {self.uri}: {what}"):
            yield

    def put_file(self, local_path: str | Path, key: str) -> None:
        with self._io(f"put {key}"):
            self._put(str(local_path), self._path(key))

    def _put(self, local: str, path: str) -> None:
        if not self._local:
            self.fs.put_file(local, path)
            return
        self.fs.makedirs(self.fs._parent(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self.fs.put_file(local, tmp)
        os.replace(tmp, path)

    def put_dir(self, local_dir: str | Path, key_prefix: str) -> None:
        """Upload every file under ``local_dir``, then seal the prefix."""
        local_dir = Path(local_dir)
        files = sorted(p for p in local_dir.rglob("*") if p.is_file())
        manifest = {"files": {p.relative_to(local_dir).as_posix(): p.stat().st_size for p in files}}
        with self._io(f"put_dir {key_prefix}"):
            marker = self._path(f"{key_prefix}/{self.MARKER}")
            if self.fs.exists(marker):
                raise AlreadyExists(f"{self.uri}/{key_prefix} is already sealed; sealed prefixes are immutable")
            for rel in manifest["files"]:
                self._put(str(local_dir / rel), self._path(f"{key_prefix}/{rel}"))
            with tempfile.NamedTemporaryFile("w", suffix=self.MARKER) as f:
                json.dump(manifest, f)
                f.flush()
                self._put(f.name, marker)

    def get_dir(self, key_prefix: str, local_dir: str | Path) -> Path:
        """Download a sealed prefix into ``local_dir``; NotFound for an unsealed one,
        ExpstoreError (INTERNAL) if a listed file has another size than its seal says."""
        local_dir = Path(local_dir)
        with self._io(f"get_dir {key_prefix}"):
            try:
                manifest = json.loads(self.fs.cat_file(self._path(f"{key_prefix}/{self.MARKER}")))
            except FileNotFoundError:
                raise NotFound(f"{self.uri}/{key_prefix} is not sealed (no {self.MARKER}): "
                               "an upload in progress, a crashed one, or nothing") from None
            for rel, size in manifest["files"].items():
                dest = local_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._path(f"{key_prefix}/{rel}"), str(dest))
                if dest.stat().st_size != size:
                    raise DataLoss(f"remote store {self.uri}: {key_prefix}/{rel} has {dest.stat().st_size}"
                                        f" bytes, its seal says {size}")
        return local_dir

    def list_sealed(self, prefix: str = "") -> list[str]:
        """Key prefixes under ``prefix`` that are sealed, sorted."""
        with self._io(f"list {prefix}"):
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(self._path(prefix))
            except FileNotFoundError:
                return []
        root = self._root.rstrip("/") + "/"
        return sorted(p[len(root):-len(self.MARKER) - 1] for p in found
                      if p.endswith(f"/{self.MARKER}") and p.startswith(root))

    def delete_prefix(self, prefix: str) -> None:
        """Unseal first, then delete: a reader never sees a sealed, partly deleted prefix."""
        with self._io(f"delete {prefix}"):
            path = self._path(prefix)
            if self.fs.exists(f"{path}/{self.MARKER}"):
                self.fs.rm(f"{path}/{self.MARKER}")
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)

    def check(self) -> None:
        """A cheap reachability probe (one HEAD or listing of the root); Unavailable when
        the endpoint is down or refuses us. A root with nothing under it yet is fine."""
        with self._io("check"):
            try:
                self.fs.info(self._root, refresh=True)
            except FileNotFoundError:
                pass
