"""Server configuration: a TOML file (``--config``), overridden by command-line flags.

Every key is documented in docs/config.md (a test checks it). Unknown keys are errors, so
a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from expstore import query
from expstore.errors import InvalidArgument
from expstore.spec import TableSpec

ROLES = ("producer", "trainer", "reader", "admin")
LOG_LEVELS = ("debug", "info", "warning", "error")
EVENT_LOOPS = ("uvloop", "asyncio")  # the server's event loop (main.run_event_loop)


@dataclass(frozen=True)
class TokenConfig:
    """A bearer token: ``token`` inline or ``token_env`` naming an environment variable."""

    name: str
    roles: tuple[str, ...]
    token: str | None = None
    token_env: str | None = None

    def secret(self) -> str:
        if self.token_env is not None:
            value = os.environ.get(self.token_env)
            if not value:
                raise InvalidArgument(f"auth token {self.name!r}: environment variable {self.token_env} is empty")
            return value
        if not self.token:
            raise InvalidArgument(f"auth token {self.name!r}: give token or token_env")
        return self.token


@dataclass(frozen=True)
class RemoteConfig:
    """The remote tier: an fsspec URI (``file://...`` or ``s3://bucket/prefix``) and, for
    S3, an endpoint, region and credentials (unset: the usual AWS_* environment)."""

    uri: str | None = None  # default: file://<data_dir>/remote
    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key_env: str | None = None  # the secret comes from the environment only

    def resolved_uri(self, data_dir: str) -> str:
        return self.uri or "file://" + str(Path(data_dir).resolve() / "remote")

    def secret(self) -> str | None:
        return os.environ.get(self.secret_access_key_env) if self.secret_access_key_env else None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: str = "./expstore-data"
    workers: int = 2
    max_message_bytes: int = 256 << 20
    message_bytes: int = 8 << 20
    visibility_timeout_s: float = 60.0
    grace_s: float = 30.0
    log_level: str = "info"
    event_loop: str = "uvloop"  # or "asyncio": the standard library's (main.run_event_loop)
    keep_freed_memory: bool = True  # glibc keeps freed buffers mapped (see main.keep_freed_memory)
    malloc_arenas: int = 2  # glibc's malloc arenas, all threads together (0: glibc's default; main.limit_malloc_arenas)
    malloc_trim_idle_s: float = 0.5  # freed memory goes back to the OS once malloc was still this long (0: never; main.IdleTrim)
    audit_log: str | None = None  # default: <data_dir>/audit.jsonl
    audit_log_max_bytes: int = 64 << 20  # the audit log rotates at this size (0: never)
    audit_log_backups: int = 4  # rotated audit logs kept
    tls_cert: str | None = None
    tls_key: str | None = None
    min_free_disk_bytes: int = 256 << 20  # inserts are refused below this much free disk
    rocksdb_memtable_bytes: int = 256 << 20  # RocksDB's write buffers, all column families together
    rocksdb_cache_bytes: int = 64 << 20  # RocksDB's block cache
    rocksdb_direct_writes: bool = True  # flushes and compactions bypass the page cache (where the filesystem allows)
    demote_interval_s: float = 1.0  # how often the mover checks SSD watermarks
    metrics_port: int = 0  # Prometheus metrics over HTTP on this port of host; 0: off
    query_workers: int = 2  # threads of their own that run SQL queries
    query_queue: int = 4  # open queries beyond query_workers; more are refused
    query_timeout_s: float = 300.0  # seconds of computing a query may take
    query_memory_bytes: int = 1 << 30  # DuckDB memory limit of each query
    query_temp_bytes: int = 1 << 30  # disk each query may spill to (in <data_dir>/query-tmp)
    query_threads: int = 1  # DuckDB threads of each query
    http_port: int = 0  # the web console (a child process) on this port of host; 0: off
    flight: bool = True  # serve bulk data over Arrow Flight too (docs/rpc.md, "Arrow Flight")
    flight_port: int | None = None  # its port; unset: port + 1, or a free one when port is 0
    flight_waiters: int = 32  # Flight calls that may wait at once (each holds a thread); more go over gRPC
    tokens: tuple[TokenConfig, ...] = ()
    tables: tuple[TableSpec, ...] = field(default_factory=tuple)
    remote: RemoteConfig = field(default_factory=RemoteConfig)

    @property
    def query_limits(self) -> query.Limits:
        return query.Limits(timeout_s=self.query_timeout_s, memory_bytes=self.query_memory_bytes,
                            temp_bytes=self.query_temp_bytes, threads=self.query_threads,
                            temp_root=str(Path(self.data_dir) / "query-tmp"))

    @property
    def resolved_flight_port(self) -> int:
        """The Flight port to bind: flight_port, or port + 1 (a free one when port is 0)."""
        if self.flight_port is not None:
            return self.flight_port
        return self.port + 1 if self.port else 0

    @property
    def audit_path(self) -> Path:
        return Path(self.audit_log) if self.audit_log else Path(self.data_dir) / "audit.jsonl"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in 0..65535, got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise InvalidArgument(f"metrics_port must be in 0..65535 (0: off), got {self.metrics_port}")
        if self.flight_port is not None and not 0 <= self.flight_port <= 65535:
            raise InvalidArgument(f"flight_port must be in 0..65535 (0: a free one), got {self.flight_port}")
        if self.flight_waiters < 1:
            raise InvalidArgument("flight_waiters must be >= 1")
        if not 0 <= self.http_port <= 65535:
            raise InvalidArgument(f"http_port must be in 0..65535 (0: off), got {self.http_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("tls_cert and tls_key go together")
        if self.log_level not in LOG_LEVELS:
            raise InvalidArgument(f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise InvalidArgument(f"event_loop must be one of {list(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.workers < 1:
            raise InvalidArgument("workers must be >= 1")
        if self.malloc_arenas < 0:
            raise InvalidArgument(f"malloc_arenas must be >= 0 (0: glibc's default), got {self.malloc_arenas}")
        if not self.malloc_trim_idle_s >= 0:
            raise InvalidArgument(f"malloc_trim_idle_s must be >= 0 (0: never), got {self.malloc_trim_idle_s}")
        if self.query_workers < 1 or self.query_queue < 0 or self.query_threads < 1:
            raise InvalidArgument("query_workers and query_threads must be >= 1, query_queue >= 0")
        if not self.query_timeout_s > 0 or self.query_memory_bytes < 16 << 20 or self.query_temp_bytes < 0:
            raise InvalidArgument("query_timeout_s must be > 0, query_memory_bytes >= 16777216 and "
                                  "query_temp_bytes >= 0 (0: no spilling)")
        if self.audit_log_max_bytes < 0 or self.audit_log_backups < 1:
            raise InvalidArgument("audit_log_max_bytes must be >= 0 (0: never rotate) and audit_log_backups >= 1")
        if self.rocksdb_memtable_bytes < 16 << 20 or self.rocksdb_cache_bytes < 0:
            raise InvalidArgument("rocksdb_memtable_bytes must be >= 16777216 and rocksdb_cache_bytes >= 0")
        if not isinstance(self.rocksdb_direct_writes, bool):
            raise InvalidArgument(f"rocksdb_direct_writes must be true or false, got {self.rocksdb_direct_writes!r}")
        if self.max_message_bytes < 1 << 20:
            raise InvalidArgument("max_message_bytes must be >= 1048576 (a response needs room for its framing)")
        if not 1024 <= self.message_bytes <= self.max_message_bytes:
            raise InvalidArgument("message_bytes must be in 1024..max_message_bytes")
        names = [t.name for t in self.tables]
        if len(names) != len(set(names)):
            raise InvalidArgument(f"config declares a table twice: {names}")


def load(path: str | None, overrides: dict[str, Any]) -> ServerConfig:
    """Read the TOML file (if any), then apply non-None overrides (command-line flags)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise InvalidArgument(f"config {path}: {e}") from None
    return from_dict(raw, overrides)


def from_dict(raw: dict[str, Any], overrides: dict[str, Any] | None = None) -> ServerConfig:
    raw = dict(raw)
    server = dict(raw.pop("server", {}))
    auth = dict(raw.pop("auth", {}))
    tls = dict(raw.pop("tls", {}))
    tables = raw.pop("tables", [])
    remote = dict(raw.pop("remote", {}))
    if raw:
        raise InvalidArgument(f"config: unknown section(s) {sorted(raw)}; known: server, auth, tls, remote, tables")
    remote_keys = {f.name for f in fields(RemoteConfig)}
    if set(remote) - remote_keys:
        raise InvalidArgument(f"config [remote]: unknown key(s) {sorted(set(remote) - remote_keys)}; "
                              f"known: {sorted(remote_keys)}")
    known = {f.name for f in fields(ServerConfig)} - {"tokens", "tables", "tls_cert", "tls_key", "remote"}
    unknown = set(server) - known
    if unknown:
        raise InvalidArgument(f"config [server]: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    tokens = []
    for t in auth.pop("tokens", []):
        t = dict(t)
        bad = set(t) - {"name", "roles", "token", "token_env"}
        if bad or "name" not in t:
            raise InvalidArgument(f"config [auth] token entries take name, roles, token|token_env; got {sorted(t)}")
        roles = tuple(t.get("roles", ()))
        if not roles or set(roles) - set(ROLES):
            raise InvalidArgument(f"auth token {t['name']!r}: roles must be a non-empty subset of {list(ROLES)}")
        tokens.append(TokenConfig(name=t["name"], roles=roles, token=t.get("token"), token_env=t.get("token_env")))
    if auth:
        raise InvalidArgument(f"config [auth]: unknown key(s) {sorted(auth)}; known: tokens")
    if set(tls) - {"cert", "key"}:
        raise InvalidArgument(f"config [tls]: unknown key(s) {sorted(set(tls) - {'cert', 'key'})}")
    values: dict[str, Any] = dict(server, tls_cert=tls.get("cert"), tls_key=tls.get("key"),
                                  remote=RemoteConfig(**remote))
    for k, v in (overrides or {}).items():
        if v is not None:
            values[k] = v
    try:
        return ServerConfig(**values, tokens=tuple(tokens),
                            tables=tuple(TableSpec.from_dict(t) for t in tables))
    except TypeError as e:
        raise InvalidArgument(f"config: {e}") from None
