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
A checkpoint copies one version into a dataset of its own: its data files (hard links
or server-side copies: Lance never rewrites a file) and one commit (``version_files``,
``clone``), while ``hold`` keeps the cleanup away from them.

Opening is lazy: the constructor does no I/O, the first call reads the dataset's chunk
map, so a server starts whether or not the remote tier is reachable. Any network or
endpoint failure raises ``Unavailable`` naming the URI, so callers retry with backoff and
health can report degraded (``error``); after one, the tier re-reads the latest version
before its next write (the failed commit may have landed), and for ``RETRY_S`` reads fail
at once instead of waiting out the client's own retries again. ``probe`` is the mover's
way back: it reaches the tier and clears ``error``.

Verification: Lance files carry no checksums, so ``put`` reads the new fragment back,
checks it equals what was written, and returns a CRC32 per column of it; the caller keeps
them (``checksums.RemoteChecksums``) and hands them to ``get`` and ``scan``, which check
every column they read and raise DataLoss naming the chunk on a mismatch, or when Lance
cannot decode the fragment at all. Never wrong rows. A fragment whose internal columns
cannot be decoded when the tier opens is left out (``unreadable``) instead of failing
the whole table.

Concurrency: like every tier, not thread-safe (the table holds its lock); ``get`` reads
fragments concurrently on the tier's own small thread pool. One writer per dataset (the
server's data-dir lock); readers of the same URI in other processes are fine.
"""

from __future__ import annotations

import json
import os
import shutil
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

from .. import codec
from ..errors import AlreadyExists, DataLoss, ExpstoreError, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from .base import UNBOUNDED

try:  # s3fs is the optional ``s3`` extra; botocore comes with it
    from botocore.exceptions import BotoCoreError as _BotoError
except ImportError:  # pragma: no cover - without s3fs there are no botocore errors to map
    _BotoError = OSError

_INTERNAL = ("_chunk", "_nbytes")


def dataset_key(table: str) -> str:
    """Where a table's (or archive's) Lance dataset lives under the remote tier's URI."""
    return f"tables/{table}.lance"


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


# What Lance says when a file's bytes do not decode (some under "LanceError(IO)" too).
_UNDECODABLE = ("failed to decode Protobuf", "Invalid user input", "corrupt file", "does not match sibling")


def _is_undecodable(e: BaseException) -> bool:
    return any(s in str(e) for s in _UNDECODABLE)


def _is_network_error(e: BaseException) -> bool:
    # Lance raises its I/O errors as OSError, ValueError or ArrowInvalid, all "LanceError(IO): ...".
    if _is_undecodable(e):
        return False
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
    one commit. Opening (on first use) reads the two internal columns of every fragment
    (tiny, constant)."""

    name = "remote"
    READERS = 8                      # concurrent fragment reads in one ``get``
    RETAIN = timedelta(minutes=10)   # old versions (and dropped fragments' files) are kept this long
    RETRY_S = 5.0                    # after a failure, reads fail at once for this long

    def __init__(self, uri: str, table: str, *, storage_options: dict | None = None) -> None:
        self.key = dataset_key(table)
        self.uri = f"{uri.rstrip('/')}/{self.key}"
        self._options = storage_options
        self._ds: lance.LanceDataset | None = None
        self._schema: pa.Schema | None = None  # the chunks' schema, internal columns dropped
        self._fragments: dict[int, int] = {}   # chunk id -> fragment id
        self._sizes: dict[int, int] = {}       # chunk id -> Arrow buffer bytes
        self.unreadable: dict[int, str] = {}   # fragment id -> why its chunk id could not be read
        self._nbytes = 0
        self._stale = False                    # a write failed: its commit may have landed
        self._opened = False                   # the chunk map has been read once
        self.error: str | None = None          # the last failure to reach the tier, until a call succeeds
        self._failed_at = 0.0
        self._cleaned = time.monotonic()
        self._holds = 0                        # while > 0, no version's files are cleaned up
        self._pool = ThreadPoolExecutor(self.READERS, thread_name_prefix="remote-tier")

    @property
    def nbytes(self) -> int:
        """Arrow buffer bytes of the chunks held, as they were put (the memory tier's measure)."""
        self._open()
        return self._nbytes

    @property
    def budget(self) -> int:
        """Unbounded: the bucket's size is the operator's business."""
        return UNBOUNDED

    def __len__(self) -> int:
        self._open()
        return len(self._fragments)

    def __contains__(self, chunk_id: int) -> bool:
        self._open()
        return chunk_id in self._fragments

    def size_of(self, chunk_id: int) -> int:
        self._open()
        return self._sizes[chunk_id]

    def chunk_ids(self) -> list[int]:
        """Every chunk the dataset holds (a listing: for DropTable and tools, not for start-up)."""
        self._open()
        return list(self._fragments)

    @property
    def ready(self) -> bool:
        """The tier has been reached and its last call succeeded."""
        return self._opened and self.error is None

    def probe(self) -> None:
        """Reach the tier (open it, or re-read its latest version after a failure); raises
        Unavailable while it cannot be reached. Clears ``error`` when it succeeds."""
        with self._io("probe"):
            if self._opened:
                self._stale = True
                self._sync()

    def close(self) -> None:
        self._pool.shutdown()

    def _open(self) -> None:
        if not self._opened:
            with self._io("open"):
                pass

    @contextmanager
    def _io(self, what: str, *, fail_fast: bool = False) -> Iterator[None]:
        """Open the tier if need be and map failures to reach it to Unavailable, kept in
        ``error`` until a call succeeds; ``fail_fast`` (reads) raises at once within
        RETRY_S of a failure instead of waiting for the client's own retries again."""
        if fail_fast and self.error is not None and time.monotonic() - self._failed_at < self.RETRY_S:
            raise Unavailable(f"{self.error} (retried in the background)")
        try:
            with _unavailable(f"remote tier {self.uri}: {what}"):
                if not self._opened:
                    self._sync()
                    self._opened = True
                yield
        except Unavailable as e:
            self.error, self._failed_at = str(e), time.monotonic()
            raise
        self.error = None

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
        t = self._internal_columns(new)
        fids = t["_rowaddr"].to_numpy() >> 32
        _, first = np.unique(fids, return_index=True)
        chunks, sizes = t["_chunk"].to_numpy()[first], t["_nbytes"].to_numpy()[first]
        for fid, c, size in zip(fids[first].tolist(), chunks.tolist(), sizes.tolist()):
            self._fragments[c] = fid
            self._sizes[c] = size
            self._nbytes += size

    def _internal_columns(self, fragments: list[lance.LanceFragment]) -> pa.Table:
        """``_chunk``, ``_nbytes`` and the row address of every row of ``fragments``; a
        fragment that does not decode is left out and noted in ``unreadable``."""
        def scan(fragments):
            return self._ds.scanner(columns=list(_INTERNAL), with_row_address=True, fragments=fragments).to_table()
        try:
            return scan(fragments)
        except Exception as e:
            if _is_network_error(e):
                raise
        parts = []
        for f in fragments:  # one does not decode: find it, keep the others
            try:
                parts.append(scan([f]))
            except Exception as e:
                if _is_network_error(e):
                    raise
                self.unreadable[f.fragment_id] = str(e)
        if parts:
            return pa.concat_tables(parts)
        return pa.table({"_chunk": pa.array([], pa.int64()), "_nbytes": pa.array([], pa.int64()),
                         "_rowaddr": pa.array([], pa.uint64())})

    @contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        with self._io(what):
            if self._stale:
                self._sync()
            try:
                yield
            except Exception as e:
                self._stale = _is_network_error(e)
                raise

    def put(self, chunk_id: int, batch: pa.RecordBatch) -> np.ndarray:
        """Store a chunk as one new fragment, read it back and return its per-column
        checksums (see the module docstring); DataLoss if it reads back other than written
        (the fragment is dropped again). Chunk ids are never reused, so putting a held id
        again only checks it: a put retried after ``Unavailable`` whose first attempt landed
        (FailedPrecondition if it holds other rows)."""
        self._open()
        held = chunk_id in self._fragments
        self._write(chunk_id, batch)
        with self._io(f"read back chunk {chunk_id}"):
            try:
                stored = self._checked_read(self._ds, chunk_id, self._fragments[chunk_id], None, None)
            except DataLoss:
                stored = None
        if stored is not None and stored.equals(batch):
            return codec.column_checksums(stored)
        if held:
            raise FailedPrecondition(f"remote tier {self.uri}: chunk {chunk_id} is held with other rows "
                                     f"than this put's (chunk ids are never reused)")
        self.delete([chunk_id])
        raise DataLoss(f"remote tier {self.uri}: chunk {chunk_id} read back other than it was "
                       f"written; its fragment was dropped again")

    def _write(self, chunk_id: int, batch: pa.RecordBatch) -> None:
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

    def get(self, chunk_ids: Iterable[int], checksums=None) -> dict[int, pa.RecordBatch]:
        """Read whole fragments, concurrently when there are several; each batch has exactly
        the schema it was put with. With ``checksums`` (chunk id -> the per-column checksums
        ``put`` returned; ``.get`` is all it needs) each is verified: DataLoss names the
        first damaged chunk and its ``damage`` every damaged chunk read."""
        ids = list(dict.fromkeys(chunk_ids))
        with self._io(f"get {len(ids)} chunks", fail_fast=True):
            for c in ids:
                if c not in self._fragments:
                    raise NotFound(f"chunk {c} is not in the remote tier {self.uri}")
            ds = self._ds

            def read(c: int) -> pa.RecordBatch | DataLoss:
                try:
                    return self._checked_read(ds, c, self._fragments[c], None, checksums)
                except DataLoss as e:
                    return e
            out = list(self._pool.map(read, ids) if len(ids) > 1 else map(read, ids))
        damaged = [e for e in out if isinstance(e, DataLoss)]
        if damaged:
            more = f" (and {len(damaged) - 1} more damaged chunks)" if len(damaged) > 1 else ""
            raise DataLoss(f"{damaged[0]}{more}", damage={c: None for e in damaged for c in e.damage})
        return dict(zip(ids, out))

    def _read(self, fragment: lance.LanceFragment, columns: list[str] | None = None) -> pa.RecordBatch:
        """A fragment's rows (of ``columns``; None: all the chunk's) as one record batch."""
        schema = self._schema if columns is None else pa.schema([self._schema.field(c) for c in columns])
        t = fragment.to_table(columns=schema.names).combine_chunks()
        return pa.RecordBatch.from_arrays([col.chunks[0] for col in t.columns], schema=schema)

    def _checked_read(self, ds, chunk_id: int, fragment_id: int, columns: list[str] | None,
                      checksums) -> pa.RecordBatch:
        """``_read``, verified against the chunk's checksums when there are any; DataLoss
        when a column's checksum differs or the fragment does not decode."""
        def damaged(why: str) -> DataLoss:
            return DataLoss(f"remote tier {self.uri}: chunk {chunk_id} (fragment {fragment_id}) {why}; the "
                            f"stored fragment is corrupt", damage={chunk_id: None})
        try:
            batch = self._read(ds.get_fragment(fragment_id), columns)
        except Exception as e:
            if _is_network_error(e) or not _is_undecodable(e):
                raise
            raise damaged(f"does not decode: {e}") from None
        expected = checksums.get(chunk_id) if checksums is not None else None
        if expected is None:  # demoted before chunks had checksums
            return batch
        names = self._schema.names
        got = codec.column_checksums(batch).tolist()
        bad = [n for n, g in zip(batch.schema.names, got)
               if names.index(n) >= len(expected) or int(expected[names.index(n)]) != g]
        if bad:
            raise damaged(f"checksum mismatch in column(s) {', '.join(bad)}")
        return batch

    def delete(self, chunk_ids: Iterable[int]) -> None:
        """Drop the chunks' fragments in one commit; unknown ids are ignored."""
        chunk_ids = list(dict.fromkeys(chunk_ids))
        if not chunk_ids:
            return
        with self._writing(f"delete {len(chunk_ids)} chunks"):
            ids = [c for c in chunk_ids if c in self._fragments]
            if not ids:
                return
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
        if not self._holds and time.monotonic() - self._cleaned >= self.RETAIN.total_seconds():
            self._ds.cleanup_old_versions(older_than=self.RETAIN)
            self._cleaned = time.monotonic()

    # -- copies (checkpoints) -------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The dataset version this tier reads and writes; None while there is no dataset
        (looked for again each time: one listing)."""
        if self._ds is None:
            if self._opened:  # opened before the dataset existed: look again
                with self._io("open"):
                    self._sync()
            else:
                self._open()
        return self._ds.version if self._ds is not None else None

    def hold(self) -> None:
        """Keep every version's files from cleanup until ``release``: a copy of a version
        (``version_files``) is under way, however long it takes."""
        self._holds += 1

    def release(self) -> None:
        self._holds -= 1

    def version_files(self, version: int) -> list[str]:
        """The data files of ``version``, relative to the dataset: what a copy of the
        version needs besides its manifest (``clone`` writes that). Reads the version's
        manifest only; safe beside the tier's own use."""
        with _unavailable(f"remote tier {self.uri}: version {version}"):
            ds = lance.dataset(self.uri, version=version, storage_options=self._options)
            files = []
            for fragment in ds.get_fragments():
                meta = fragment.metadata
                if meta.deletion_file is not None or any(f.base_id is not None for f in meta.files):
                    raise ExpstoreError(f"remote tier {self.uri}: fragment {meta.id} has a deletion file or "
                                        f"a data file in another base: this tier writes neither; cannot copy it")
                files += [f"data/{f.path}" for f in meta.files]
        return files

    def clone(self, version: int, dest_uri: str) -> None:
        """Make ``dest_uri``, where the caller copied ``version_files(version)`` under the
        same relative paths, a dataset of its own holding exactly ``version``'s fragments
        (one Overwrite commit): no later change or cleanup of this dataset reaches it."""
        with _unavailable(f"remote tier {self.uri}: clone version {version} to {dest_uri}"):
            ds = lance.dataset(self.uri, version=version, storage_options=self._options)
            lance.LanceDataset.commit(dest_uri, lance.LanceOperation.Overwrite(
                ds.schema, [f.metadata for f in ds.get_fragments()]), storage_options=self._options)

    def scan(self, columns: list[str] | None = None, filter: str | None = None, *,
             with_chunk: bool = False, checksums=None, skip=frozenset()) -> pa.RecordBatchReader:
        """A Lance scan of the table's latest version with column selection and filter
        pushdown (a SQL predicate, which may name ``_chunk``); ``with_chunk`` adds the
        ``_chunk`` column. For queries and audits: it reads every fragment it needs whole.

        With ``checksums`` (as for ``get``) the scan is verified instead: each fragment's
        columns are read whole and checked, no filter is pushed down (the caller filters),
        chunks in ``skip`` are left out, and a damaged fragment raises DataLoss naming it."""
        with self._io("scan", fail_fast=True):
            if self._ds is None:
                return pa.RecordBatchReader.from_batches(pa.schema([]), [])
            if columns is None:
                columns = self._schema.names + (["_chunk"] if with_chunk else [])
            if checksums is not None:
                if filter is not None:
                    raise InvalidArgument("a verified scan pushes no filter down")
                return self._verified_scan(columns, checksums, skip)
            return self._ds.scanner(columns=columns, filter=filter).to_reader()

    def _verified_scan(self, columns: list[str], checksums, skip) -> pa.RecordBatchReader:
        payload = [c for c in columns if c != "_chunk"]
        schema = pa.schema([self._schema.field(c) for c in payload] +
                           ([pa.field("_chunk", pa.int64())] if "_chunk" in columns else []))
        ds, fragments = self._ds, {c: f for c, f in self._fragments.items() if c not in skip}

        def batches():
            for c, fid in fragments.items():
                with _unavailable(f"remote tier {self.uri}: scan chunk {c}"):
                    batch = self._checked_read(ds, c, fid, payload, checksums)
                if "_chunk" in columns:
                    batch = batch.append_column("_chunk", pa.array(np.full(batch.num_rows, c, np.int64)))
                yield batch
        return pa.RecordBatchReader.from_batches(schema, batches())


class SealedObjects:
    """Plain sealed objects under ``uri`` (checkpoints), through fsspec.

    A single object is sealed by the store itself: on S3 a PUT (multipart upload, or
    server-side copy) is visible whole or not at all; on a local disk it is written aside
    and renamed. A directory is sealed by a ``_SEALED`` object written last, listing each
    file's relative path and size: a prefix without one is an upload in progress or a
    crashed one, and reading it is refused. A sealed prefix is immutable (uploading into
    or sealing it again raises AlreadyExists).

    Keys, and the paths a seal lists, are relative and ``/``-separated, without empty,
    ``.`` or ``..`` parts: a crafted seal makes a download write (or read) nothing outside
    the directory and prefix it names; it is refused whole before anything is written."""

    MARKER = "_SEALED"

    def __init__(self, uri: str, *, fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.uri = uri.rstrip("/")
        self.fs = fs or fsspec_filesystem(uri)
        self._root = self.fs._strip_protocol(self.uri)
        self._local = "file" in self.fs.protocol

    def _path(self, key: str) -> str:
        key = key.strip("/")
        if not key:
            return self._root
        return f"{self._root}/{_relative(key, f'remote store {self.uri}: key', InvalidArgument)}"

    @contextmanager
    def _io(self, what: str) -> Iterator[None]:
        with _unavailable(f"remote store {self.uri}: {what}"):
            yield

    # -- single objects -----------------------------------------------------------------

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

    def put_bytes(self, data: bytes, key: str) -> None:
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            self.put_file(f.name, key)

    def read(self, key: str) -> bytes:
        with self._io(f"read {key}"):
            try:
                return self.fs.cat_file(self._path(key))
            except FileNotFoundError:
                raise NotFound(f"{self.uri}/{key} does not exist") from None

    def exists(self, key: str) -> bool:
        """Whether an object, or any object under ``key``/, exists."""
        path = self._path(key)
        with self._io(f"exists {key}"):
            self.fs.invalidate_cache(path)
            return self.fs.exists(path)

    def copy(self, keys: dict[str, str], into: "SealedObjects | None" = None) -> None:
        """Copy objects ``{key here: key in into}`` (``into`` defaults to this store): a hard
        link (or a copy) on a local disk, a server-side copy where one filesystem holds both
        (S3 CopyObject, concurrently), else through a local temporary file."""
        into = into or self
        pairs = [(self._path(src), into._path(dst)) for src, dst in keys.items()]
        with self._io(f"copy {len(pairs)} objects to {into.uri}"), _missing_is_not_found(self.uri):
            if self._local and into._local:
                for src, dst in pairs:
                    _link_or_copy(src, dst)
            elif self.fs is into.fs and pairs:
                self.fs.copy([src for src, _ in pairs], [dst for _, dst in pairs])
            else:
                for src, dst in pairs:
                    with tempfile.TemporaryDirectory() as tmp:
                        self.fs.get_file(src, f"{tmp}/object")
                        into._put(f"{tmp}/object", dst)

    def sizes(self, key_prefix: str) -> dict[str, int]:
        """Every object under ``key_prefix``/, by path relative to it, with its size."""
        path = self._path(key_prefix)
        with self._io(f"list {key_prefix}"):
            self.fs.invalidate_cache(path)
            try:
                found = self.fs.find(path, detail=True)
            except FileNotFoundError:
                return {}
        root = self.fs._strip_protocol(path).rstrip("/") + "/"
        return {p[len(root):]: int(info["size"]) for p, info in found.items()
                if p.startswith(root) and info.get("type") != "directory"}

    # -- sealed prefixes ----------------------------------------------------------------

    def is_sealed(self, key_prefix: str) -> bool:
        return self.exists(f"{key_prefix}/{self.MARKER}")

    def put_files(self, local_dir: str | Path, key_prefix: str) -> dict[str, int]:
        """Upload every file under ``local_dir`` into the (unsealed) prefix; returns their
        relative paths and sizes, for ``seal``. On a local disk each is a hard link where
        one filesystem holds both (a copy otherwise): the files must never change after
        (a RocksDB checkpoint's never do)."""
        local_dir = Path(local_dir)
        files = {p.relative_to(local_dir).as_posix(): p.stat().st_size
                 for p in sorted(local_dir.rglob("*")) if p.is_file()}
        if self.is_sealed(key_prefix):
            raise AlreadyExists(f"{self.uri}/{key_prefix} is already sealed; sealed prefixes are immutable")
        with self._io(f"put_dir {key_prefix}"):
            for rel in files:
                put = _link_or_copy if self._local else self._put
                put(str(local_dir / rel), self._path(f"{key_prefix}/{rel}"))
        return files

    def seal(self, key_prefix: str, files: dict[str, int]) -> None:
        """Write the prefix's ``_SEALED`` object, listing ``files`` (relative path -> size),
        all of which must be in place: from now on the prefix is readable and immutable."""
        for rel in files:
            _relative(rel, f"remote store {self.uri}: {key_prefix}: file", InvalidArgument)
        if self.is_sealed(key_prefix):
            raise AlreadyExists(f"{self.uri}/{key_prefix} is already sealed; sealed prefixes are immutable")
        self.put_bytes(json.dumps({"files": files}).encode(), f"{key_prefix}/{self.MARKER}")

    def put_dir(self, local_dir: str | Path, key_prefix: str) -> None:
        """Upload every file under ``local_dir``, then seal the prefix."""
        self.seal(key_prefix, self.put_files(local_dir, key_prefix))

    def sealed_files(self, key_prefix: str) -> dict[str, int]:
        """The files a sealed prefix holds (relative path -> size). NotFound for an unsealed
        prefix; DataLoss for a seal that is not what ``seal`` writes, or that lists a path
        leaving the prefix (``..``, an absolute path)."""
        try:
            raw = self.read(f"{key_prefix}/{self.MARKER}")
        except NotFound:
            raise NotFound(f"{self.uri}/{key_prefix} is not sealed (no {self.MARKER}): "
                           "an upload in progress, a crashed one, or nothing") from None
        where = f"remote store {self.uri}: the seal of {key_prefix}"
        try:
            files = json.loads(raw)["files"]
        except (ValueError, TypeError, KeyError):
            raise DataLoss(f"{where} is not a list of files; refusing to read the prefix") from None
        if not isinstance(files, dict):
            raise DataLoss(f"{where} is not a list of files; refusing to read the prefix")
        for rel, size in files.items():
            _relative(rel, f"{where} lists", DataLoss)
            if rel.split("/")[-1] == self.MARKER or type(size) is not int or size < 0:
                raise DataLoss(f"{where} lists {rel!r} with size {size!r}; refusing to read the prefix")
        return files

    def get_files(self, key_prefix: str, files: dict[str, int], local_dir: str | Path) -> Path:
        """Download ``files`` (relative path -> size, from ``sealed_files``) of a prefix into
        ``local_dir``; DataLoss if one has another size than listed."""
        local_dir = Path(local_dir)
        for rel in files:
            _relative(rel, f"remote store {self.uri}: {key_prefix}: file", DataLoss)
        with self._io(f"get_dir {key_prefix}"):
            for rel, size in files.items():
                dest = local_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.fs.get_file(self._path(f"{key_prefix}/{rel}"), str(dest))
                except FileNotFoundError:
                    raise DataLoss(f"remote store {self.uri}: {key_prefix}/{rel}, listed in its seal, "
                                   f"is missing") from None
                if dest.stat().st_size != size:
                    raise DataLoss(f"remote store {self.uri}: {key_prefix}/{rel} has {dest.stat().st_size}"
                                   f" bytes, its seal says {size}")
        return local_dir

    def get_dir(self, key_prefix: str, local_dir: str | Path) -> Path:
        """Download a sealed prefix into ``local_dir`` (see ``sealed_files``, ``get_files``)."""
        return self.get_files(key_prefix, self.sealed_files(key_prefix), local_dir)

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


def _relative(path: object, what: str, error: type[ExpstoreError]) -> str:
    """``path`` if it is relative and stays where it is put (no empty, ``.`` or ``..``
    part, no backslash or NUL); else ``error`` naming it."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path or "\0" in path \
            or any(part in ("", ".", "..") for part in path.split("/")):
        raise error(f"{what} {path!r}: not a relative path inside its directory")
    return path


@contextmanager
def _missing_is_not_found(where: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as e:
        raise NotFound(f"remote store {where}: {e.filename or e} does not exist") from None


def _link_or_copy(src: str, dst: str) -> None:
    """``dst`` as a hard link to ``src`` (a copy across filesystems), appearing whole."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.tmp-{uuid.uuid4().hex}"
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
