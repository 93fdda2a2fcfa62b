"""``expstore-server``: the daemon.

Starts a grpc.aio server with the ExperienceStore service and the standard health
service, on embedded defaults (127.0.0.1:50051, data dir ./expstore-data) unless told
otherwise. ``--port 0`` picks a free port; the first line on stdout is always
``expstore-server listening on HOST:PORT``. With ``--http-port`` the web console runs as a
child process (``console.child``) and the second line is ``expstore console on URL``. SIGTERM/SIGINT drain: stop accepting calls,
let running ones finish (blocked ones end with UNAVAILABLE), exit 0. Logs are JSON lines
on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import functools
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expstore import checkpoint
from expstore.errors import ExpstoreError
from expstore_proto.service import SERVICE, server_handler
from expstore.catalog import Catalog
from expstore.tiers.remote import SealedObjects, RemoteTier, fsspec_filesystem, lance_storage_options

from . import config as config_mod
from .security_log import SecurityLog
from .flight import FlightService
from .auth import Authenticator
from .clip import LOG_CHARS, clip
from .metrics import ServerMetrics
from .servicer import Servicer

log = logging.getLogger("expstore.server")
REMOTE_HEALTH = "expstore.remote"  # health service name: NOT_SERVING while the remote tier fails


class JsonFormatter(logging.Formatter):
    """One JSON object per line; every text field is clipped to ``clip.LOG_CHARS``
    characters (a message or an extra may carry a name a client sent)."""

    _skip = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 6), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in self._skip})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        entry = {k: clip(v, LOG_CHARS) if isinstance(v, str) else v for k, v in entry.items()}
        return json.dumps(entry, default=lambda v: clip(str(v), LOG_CHARS))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value); whether all were taken (False off
    glibc)."""
    libc = _glibc()
    return libc is not None and all([bool(libc.mallopt(parameter, value)) for parameter, value in settings])


def keep_freed_memory() -> bool:
    """Ask glibc to serve large buffers from its heap and keep freed memory mapped.

    Every message buffer of a sample batch is ~9 MB; by default glibc maps each one fresh
    and unmaps it when freed, so each batch pays a page fault per 4 KiB (~0.7 GB/s on
    these VMs). Raising the mmap threshold to its maximum (32 MiB on 64-bit) and the trim
    threshold makes freed buffers reusable as they are (measured: sample p99 31 ms
    instead of 46-51 ms). The process keeps its peak heap while busy (``IdleTrim`` returns
    it at rest); a no-op off glibc.
    """
    return _mallopt((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, loaded once (``IdleTrim`` asks it twice a second); None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):  # glibc 2.33 and later
        libc.mallinfo2.restype = _MallInfo2
    return libc


def malloc_state() -> tuple[int, int] | None:
    """glibc's malloc, all arenas together: (bytes in use, bytes held free); None off glibc
    (or one older than 2.33)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    info = libc.mallinfo2()
    return info.uordblks, info.fordblks


def malloc_trim() -> bool:
    """Hand the pages of every free chunk in every arena back to the OS (glibc's
    ``malloc_trim(0)``: a few ms); whether any were. False off glibc."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class IdleTrim:
    """Returns the memory malloc holds freed once the server is at rest.

    ``keep_freed_memory`` keeps freed buffers mapped so that busy periods reuse them; what
    stays mapped is the peak of transient buffers, above all gRPC's receive buffers: an
    insert's messages arrive as 64 KiB slices and are copied whole, and up to ~25 MB of
    slices per arena were live at once (measured, 8,192 items of ~36 KiB into a memory
    table over Arrow Flight: 13-39 MB held free afterwards, RSS 1.11-1.18x the payload;
    trimmed, 1.05-1.07x). ``tick`` (every ``malloc_trim_idle_s``) trims once malloc's
    bytes in use and held free moved by less than ``QUIET_BYTES`` since the previous
    tick (no call of any size is running; timers still allocate a little) after moving
    by ``QUIET_BYTES`` or more since the last trim. The first call after a trim faults
    its buffers in afresh (~0.7 GB/s here).
    """

    QUIET_BYTES = 1 << 20

    def __init__(self, state=malloc_state, trim=malloc_trim) -> None:
        self._state, self._trim = state, trim
        self._last: tuple[int, int] | None = None
        self._moved = 0  # bytes malloc's figures moved since the last trim

    def tick(self) -> bool:
        """One look; whether it trimmed."""
        state = self._state()
        if state is None:
            return False
        moved = 0 if self._last is None else abs(state[0] - self._last[0]) + abs(state[1] - self._last[1])
        self._moved += moved
        due = self._last is not None and moved < self.QUIET_BYTES <= self._moved
        if due:
            self._trim()
            self._moved = 0
            state = self._state()  # trimming the heap's top frees no chunk but may shrink it
        self._last = state
        return due


async def _trim_when_idle(interval_s: float) -> None:
    trimmer = IdleTrim()
    while True:
        await asyncio.sleep(interval_s)
        trimmer.tick()


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for the whole process (0: leave glibc's
    default); call it before the server starts its threads.

    glibc gives new threads arenas of their own, up to 8 per core, and each arena keeps
    the memory freed in it (all the more with ``keep_freed_memory``): the
    gRPC, RocksDB and engine threads left ~20 MB each mapped and mostly empty. Measured
    here, 8,192 items of ~36 KiB in a memory table: RSS 1.21-1.28x the Arrow payload with
    glibc's default, 1.11-1.12x with 2 arenas, 1.08-1.09x with 1 (measured again in
    alternating runs: 1.10x with 2, 1.12-1.16x with 1, so 1 is no better). Python's own objects
    are allocated under the GIL, so few threads contend for malloc at once. A no-op off glibc.
    """
    return arenas > 0 and _mallopt((M_ARENA_MAX, arenas))


def tune_malloc(cfg: config_mod.ServerConfig) -> None:
    """glibc's malloc as ``cfg`` asks (``malloc_arenas``, ``keep_freed_memory``); call it
    before any thread starts. The benchmarks' raw gRPC and Flight servers call it with the
    defaults, so that their ceilings are those of a server set up as this one is."""
    limit_malloc_arenas(cfg.malloc_arenas)
    if cfg.keep_freed_memory:
        keep_freed_memory()


GC_THRESHOLDS = (5000, 20, 50)  # gc.set_threshold's: Python's default is (700, 10, 10)


def collect_less_often() -> None:
    """Freeze the objects made so far (modules, their functions and types: the collector
    never walks them again) and collect cyclic garbage less often; call it once the
    imports are done.

    A burst of 10,000 small inserts keeps 10,000 calls' objects alive at once, and with
    Python's default thresholds every full collection walked them and the ~150,000
    objects of the imports: measured, 10 full collections of ~230 ms each (the event
    loop stopped each time) and ~2.7 s of collecting in all, a quarter of the server's
    CPU for the burst. Frozen and with these thresholds: ~0.3 s, the longest pause ~40
    ms. Garbage without cycles is freed at once as before; garbage in cycles waits for
    more allocations than it did (5,000 rather than 700 for the youngest generation).
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="expstore-server", description="expstore experience server")
    p.add_argument("--config", help="TOML config file (docs/config.md)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 50051)")
    p.add_argument("--data-dir", help="data directory (default ./expstore-data)")
    p.add_argument("--workers", type=int, help="engine threads (default 2)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics over HTTP on this port "
                                                    "of --host (default 0: off)")
    p.add_argument("--flight-port", type=int, help="port of the Arrow Flight service (bulk data) on --host "
                                                   "(default: --port + 1, or a free one with --port 0)")
    p.add_argument("--no-flight", action="store_true", help="serve no Arrow Flight service (gRPC only)")
    p.add_argument("--http-port", type=int, help="serve the web console on this port of --host, in a child "
                                                 "process (default 0: off; docs/console.md)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--event-loop", choices=list(config_mod.EVENT_LOOPS),
                   help="the server's event loop (default uvloop; asyncio: the standard library's)")
    p.add_argument("--tls-cert", help="PEM certificate chain; enables TLS with --tls-key")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--remote-uri", help="remote tier: file://DIR or s3://bucket/prefix "
                                        "(default file://<data-dir>/remote)")
    p.add_argument("--restore-checkpoint", metavar="URI",
                   help="first restore a checkpoint into the (empty) data dir and the remote tier: its URI "
                        "(.../checkpoints/NAME, as Checkpoint reports it; another server's, as a restored "
                        "server needs a remote tier of its own), or a NAME in the remote tier")
    return p


def build_config(args: argparse.Namespace) -> config_mod.ServerConfig:
    overrides = {"host": args.host, "port": args.port, "data_dir": args.data_dir,
                 "workers": args.workers, "log_level": args.log_level, "event_loop": args.event_loop,
                 "metrics_port": args.metrics_port,
                 "http_port": args.http_port, "flight_port": args.flight_port,
                 "flight": False if args.no_flight else None,
                 "tls_cert": args.tls_cert, "tls_key": args.tls_key}
    cfg = config_mod.load(args.config, overrides)
    if args.remote_uri:
        cfg = dataclasses.replace(cfg, remote=dataclasses.replace(cfg.remote, uri=args.remote_uri))
    return cfg


def open_store(cfg: config_mod.ServerConfig, restore_checkpoint: str | None = None):
    """The store on the data dir, with its remote tier; restores a checkpoint first if
    asked. Returns (store, checkpointer)."""
    r = cfg.remote
    uri = r.resolved_uri(cfg.data_dir)
    fs_args = dict(endpoint=r.endpoint, region=r.region, key=r.access_key_id, secret=r.secret())
    remote_store = SealedObjects(uri, fs=fsspec_filesystem(uri, **fs_args))
    if restore_checkpoint:
        source, name = checkpoint.locate(restore_checkpoint, remote_store)
        checkpoint.restore(source, name, cfg.data_dir, remote_store)
    options = lance_storage_options(**fs_args) if uri.startswith(("s3://", "s3a://")) else None
    store = Catalog(cfg.data_dir, remote=lambda table: RemoteTier(uri, table, storage_options=options),
                  min_free_bytes=cfg.min_free_disk_bytes, remote_uri=uri.rstrip("/"),
                  memtable_bytes=cfg.rocksdb_memtable_bytes, cache_bytes=cfg.rocksdb_cache_bytes,
                  direct_writes=cfg.rocksdb_direct_writes,
                  remote_in_data_dir=uri == config_mod.RemoteConfig().resolved_uri(cfg.data_dir),
                  remote_restored=bool(restore_checkpoint))  # the restore copied the datasets there
    for spec in cfg.tables:  # restored on a restart: the same config is no error
        if spec.name not in store.unopened:  # a table that failed to restore stays down (logged)
            store.create_table(spec, if_not_exists=True)
    return store, checkpoint.Checkpointer(store, remote_store)


# grpc's core holds calls that have arrived until the event loop takes them, and past
# 1,000 of them refuses new ones at random (3,000: all): a burst of producers then fails
# with CANCELLED while the loop is busy with the calls before it. expstore's waiting
# calls are coroutines, cheap to hold; a call waits out its own deadline instead.
PENDING_CALLS = [("grpc.server.max_pending_requests", 1 << 20),
                 ("grpc.server.max_pending_requests_hard_limit", 1 << 20)]


async def serve(cfg: config_mod.ServerConfig, restore_checkpoint: str | None = None) -> None:
    Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
    store, checkpointer = open_store(cfg, restore_checkpoint)
    if cfg.rocksdb_direct_writes and store.db is not None and not store.db.direct_writes:
        log.warning("direct_writes_unsupported", extra={"data_dir": cfg.data_dir, "detail": (
            "the data dir's filesystem does not take O_DIRECT: RocksDB's flushes write through the page cache")})
    store.start_mover(cfg.demote_interval_s)
    audit = SecurityLog(cfg.audit_path, max_bytes=cfg.audit_log_max_bytes, backups=cfg.audit_log_backups)
    metrics = ServerMetrics(store)
    servicer = Servicer(store, cfg, Authenticator(cfg.tokens), audit, checkpointer, metrics)
    options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
               ("grpc.max_send_message_length", cfg.max_message_bytes),
               ("grpc.so_reuseport", 0),
               *PENDING_CALLS]
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers((server_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    address = f"{cfg.host}:{cfg.port}"
    try:
        socket.getaddrinfo(cfg.host, cfg.port)
    except OSError as e:  # before gRPC, which would log its own lines about it
        raise ExpstoreError(f"cannot bind {address}: {e}") from None
    if cfg.tls_cert:
        creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ExpstoreError(f"could not bind {address}")
    if cfg.metrics_port:
        try:
            metrics.start_http(cfg.host, cfg.metrics_port, cfg.tls_cert, cfg.tls_key)
        except OSError as e:
            raise ExpstoreError(f"cannot bind metrics on {cfg.host}:{cfg.metrics_port}: {e}") from None
        log.info("metrics", extra={"host": cfg.host, "port": cfg.metrics_port, "tls": bool(cfg.tls_cert)})
    await server.start()
    flight = None
    if cfg.flight:
        flight = start_flight(cfg, servicer)
    console = None
    if cfg.http_port:
        from .console import child  # the console itself is imported only by the child

        console = child.ConsoleProcess(child.command(cfg.host, port, cfg.http_port, cfg.tls_cert, cfg.tls_key))
        try:
            await asyncio.get_running_loop().run_in_executor(None, console.wait_ready)
        except child.ConsoleError as e:
            await server.stop(None)
            if flight is not None:
                flight.shutdown()
            store.close()
            raise ExpstoreError(f"cannot start the console on {cfg.host}:{cfg.http_port}: {e}") from None
    for service in ("", SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    remote_health = asyncio.create_task(_report_remote_health(store, health_servicer))
    trimming = asyncio.create_task(_trim_when_idle(cfg.malloc_trim_idle_s)) if cfg.malloc_trim_idle_s else None
    print(f"expstore-server listening on {cfg.host}:{port}", flush=True)
    if flight is not None:
        log.info("flight", extra={"host": cfg.host, "port": flight.port, "tls": bool(cfg.tls_cert)})
    if console is not None:
        print(f"expstore console on {console.url}", flush=True)
        log.info("console", extra={"url": console.url, "pid": console.proc.pid})
    log.info("listening", extra={"host": cfg.host, "port": port, "tls": bool(cfg.tls_cert),
                                 "auth": bool(cfg.tokens), "tables": [t.name for t in cfg.tables],
                                 "data_dir": cfg.data_dir, "pid": os.getpid()})

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    started = time.monotonic()
    log.info("draining", extra={"grace_s": cfg.grace_s})
    for service in ("", SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    remote_health.cancel()
    if trimming is not None:
        trimming.cancel()
    if console is not None:  # first: no more queries from it while calls drain
        await asyncio.get_running_loop().run_in_executor(None, console.stop)
    stopping = asyncio.create_task(server.stop(cfg.grace_s))
    await servicer.drain()
    if flight is not None:  # waiting Flight calls end; running ones finish
        flight.drain()
        await asyncio.get_running_loop().run_in_executor(None, flight.shutdown)
    await stopping
    metrics.close()
    store.close()
    servicer.close()
    audit.close()
    log.info("stopped", extra={"drain_s": round(time.monotonic() - started, 3)})


def start_flight(cfg: config_mod.ServerConfig, servicer: Servicer) -> FlightService:
    """The Arrow Flight service on ``cfg.host``, with the gRPC port's TLS certificate;
    advertised by ``GetServerInfo``."""
    import pyarrow.flight as fl

    scheme = "grpc+tls" if cfg.tls_cert else "grpc+tcp"
    certs = [fl.CertKeyPair(cert=Path(cfg.tls_cert).read_bytes(), key=Path(cfg.tls_key).read_bytes())] \
        if cfg.tls_cert else None
    location = f"{scheme}://{cfg.host}:{cfg.resolved_flight_port}"
    try:
        flight = FlightService(location, servicer, tls_certificates=certs, waiters=cfg.flight_waiters)
    except Exception as e:  # pyarrow's ArrowException or FlightError: cannot bind
        raise ExpstoreError(f"cannot serve Arrow Flight on {cfg.host}:{cfg.resolved_flight_port}: {e} "
                            f"(set flight_port, or flight = false)") from None
    servicer.flight_port, servicer.flight_tls = flight.port, bool(cfg.tls_cert)
    return flight


async def _report_remote_health(store: Catalog, health_servicer) -> None:
    """The health service ``REMOTE_HEALTH`` is NOT_SERVING while the remote tier fails
    (degraded: inserts and samples go on from memory and SSD)."""
    last = None
    while True:
        status = health_pb2.HealthCheckResponse.NOT_SERVING if store.remote_error else \
            health_pb2.HealthCheckResponse.SERVING
        if status != last:
            await health_servicer.set(REMOTE_HEALTH, status)
            last = status
        await asyncio.sleep(0.5)


def run_event_loop(main_coroutine, event_loop: str) -> None:
    """Run the server's coroutine on ``event_loop``: ``uvloop`` (libuv; the default) or
    ``asyncio`` (the standard library's loop).

    Every call's steps are callbacks of this one loop (gRPC's completions, the handlers,
    the engine threads' answers), and with thousands of producers the loop is the server's
    bound: measured here (Insert as a client stream, alternating runs), 10,000 producers
    offering 1,611 calls a second were served at 1,170-1,245 calls/s (p99 1.8-2.4 s) on
    the standard loop and 1,347-1,368 (p99 1.2 s) on uvloop; one client inserting 256 rows
    of 300 B back to back went 0-20% faster. gRPC's asyncio API runs on either (its
    completion queue is polled by a thread of its own that hands events to the loop).
    """
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(main_coroutine)
    else:
        asyncio.run(main_coroutine)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = build_config(args)
    except ExpstoreError as e:
        print(f"expstore-server: {e}", file=sys.stderr)
        return 2
    tune_malloc(cfg)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=cfg.log_level.upper(), handlers=[handler], force=True)
    collect_less_often()
    try:
        run_event_loop(serve(cfg, args.restore_checkpoint), cfg.event_loop)
    except (ExpstoreError, OSError, RuntimeError) as e:  # bind, TLS files, data dir
        print(f"expstore-server: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
