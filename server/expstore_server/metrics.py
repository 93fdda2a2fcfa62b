"""Prometheus metrics of one server, over HTTP (``--metrics-port``; docs/stats.md).

Two sources, no double bookkeeping: RPC figures (requests, errors by status code,
latency, bytes) are recorded by the servicer's ``rpc`` decorator as each call ends;
table figures are read from ``Table.stats()`` at scrape time by a collector, so a scrape
costs one stats call per table and nothing runs between scrapes. The registry is private
to the server (not prometheus_client's global one). Labels stay bounded: methods, status
codes, tiers and reasons are fixed sets, and tables and consumer groups are ones the
store holds (a call naming an unknown table is counted under ``table=""``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

import grpc
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from expstore.catalog import Catalog
from expstore.table import STALENESS_BUCKETS

if TYPE_CHECKING:
    from .servicer import Call

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_OPS = ("insert", "sample", "stream")
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}

# Per-table figures: (name, type, help, label, {label value: Table.stats() key}). A key
# the table does not have (ssd_bytes of a memory-only table) gives no series.
TABLE_FIGURES: list[tuple[str, str, str, str | None, dict[str, str]]] = [
    ("expstore_items", "gauge", "Items live for sampling and streaming, by the tier their payload is read from",
     "tier", {"memory": "items_memory", "ssd": "items_ssd", "remote": "items_remote"}),
    ("expstore_tier_bytes", "gauge", "Bytes a tier holds for the table (memory, remote: Arrow bytes; ssd: compressed)",
     "tier", {"memory": "memory_bytes", "ssd": "ssd_bytes", "remote": "remote_bytes"}),
    ("expstore_tier_budget_bytes", "gauge", "The table's byte budget of a tier (memory_bytes, ssd_bytes of its config)",
     "tier", {"memory": "memory_budget_bytes", "ssd": "ssd_budget_bytes"}),
    ("expstore_tier_chunks", "gauge", "Chunks a tier holds for the table",
     "tier", {"memory": "memory_chunks", "ssd": "ssd_chunks", "remote": "remote_chunks"}),
    ("expstore_policy_version", "gauge", "The table's current policy version", None, {"": "policy_version"}),
    ("expstore_sampler_eligible_items", "gauge", "Items the sampler can choose from", None, {"": "sampler_eligible"}),
    ("expstore_inserted_items", "counter", "Rows stored (duplicates and rejected batches excluded)",
     None, {"": "inserts"}),
    ("expstore_inserted_bytes", "counter", "Arrow bytes of stored rows", None, {"": "inserted_bytes"}),
    ("expstore_duplicate_items", "counter", "Rows not stored because their key was already stored",
     None, {"": "duplicates"}),
    ("expstore_sampled_items", "counter", "Items returned by Sample", None, {"": "samples"}),
    ("expstore_streamed_items", "counter", "Items delivered by Stream, redeliveries included",
     None, {"": "stream_deliveries"}),
    ("expstore_removed_items", "counter", "Items that left the table, by reason", "reason",
     {r: f"removed_{r}" for r in ("max_size", "max_times_sampled", "stale", "zero_variance", "lost",
                                               "group_timeout", "group_late")}),
    ("expstore_demoted_chunks", "counter", "Chunks moved from the SSD to the remote tier", None, {"": "demotions"}),
    ("expstore_demotion_failures", "counter", "Mover passes that failed (remote tier down)",
     None, {"": "demotion_failures"}),
    ("expstore_promoted_chunks", "counter", "Remote chunks read whole and kept in memory", None, {"": "promotions"}),
    ("expstore_evicted_chunks", "counter", "Chunks dropped from the memory cache", None, {"": "evictions"}),
    ("expstore_prefetched_chunks", "counter", "Chunks read ahead into memory for streams", None, {"": "prefetched"}),
    ("expstore_waits", "counter", "Calls that waited: inserts for the rate limiter, samples for the rate "
     "limiter or the sampler, stream reads for new items", "op", {op: f"{op}_waits" for op in _OPS}),
    ("expstore_wait_seconds", "counter", "Seconds the calls counted in expstore_waits_total spent waiting",
     "op", {op: f"{op}_wait_seconds" for op in _OPS}),
]
# Per consumer group: (name, type, help, key of group.<name>.<key>).
GROUP_FIGURES = [
    ("expstore_stream_lag_items", "gauge", "Live items the consumer group has not read yet", "lag"),
    ("expstore_stream_unacked_items", "gauge", "Items delivered to the group and not acked yet", "inflight"),
    ("expstore_stream_delivered_items", "counter", "Deliveries to the group, redeliveries included", "delivered"),
    ("expstore_stream_redelivered_items", "counter", "Redeliveries after a visibility timeout", "redelivered"),
    ("expstore_stream_acked_items", "counter", "Items the group acked", "acked"),
]
# The staleness histogram: its count per op is the op's own item counter.
_STALENESS_COUNT = {"sample": "samples", "stream": "stream_deliveries"}


def wire_size(message) -> int:
    """Serialized bytes of a message the servicer receives or sends: pre-framed bytes or a
    protobuf message (0 for a request stream, whose messages Insert counts itself)."""
    if isinstance(message, bytes):
        return len(message)
    return message.ByteSize() if isinstance(message, Message) else 0


class TableCollector(Collector):
    """Table figures, read from ``Table.stats()`` when Prometheus scrapes."""

    def __init__(self, store: Catalog) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        stats = [(t.name, t.stats()) for t in self._store.tables()]
        for name, kind, help_text, label, keys in TABLE_FIGURES:
            family = _FAMILIES[kind](name, help_text, labels=["table"] + ([label] if label else []))
            for table, s in stats:
                for value, key in keys.items():
                    if key in s:
                        family.add_metric([table] + ([value] if label else []), s[key])
            yield family
        staleness = HistogramMetricFamily(
            "expstore_staleness_versions", "Policy versions items were behind the table's when Sample "
            "or Stream returned them", labels=["table", "op"])
        for table, s in stats:
            for op, count_key in _STALENESS_COUNT.items():
                buckets = [(floatToGoString(b), s[f"staleness.{op}.le_{b}"]) for b in STALENESS_BUCKETS]
                staleness.add_metric([table, op], buckets + [("+Inf", s[count_key])],
                                     sum_value=s[f"staleness.{op}.sum"])
        yield staleness
        for name, kind, help_text, key in GROUP_FIGURES:
            family = _FAMILIES[kind](name, help_text, labels=["table", "group"])
            for table, s in stats:
                suffix = "." + key
                for k, v in s.items():
                    if k.startswith("group.") and k.endswith(suffix):
                        family.add_metric([table, k[len("group."):-len(suffix)]], v)
            yield family


class ServerMetrics:
    """The server's registry: RPC instruments the servicer records into, the table
    collector, and the HTTP endpoint serving both."""

    def __init__(self, store: Catalog) -> None:
        self._store = store
        self.registry = CollectorRegistry()
        labels = ["method", "table"]
        self._requests = Counter("expstore_rpc_requests", "RPCs handled", labels, registry=self.registry)
        self._errors = Counter("expstore_rpc_errors", "RPCs that ended with a status other than OK",
                               labels + ["code"], registry=self.registry)
        self._duration = Histogram("expstore_rpc_duration_seconds", "Time from a call's start to its status "
                                   "(streams: until their last message)", labels, buckets=LATENCY_BUCKETS,
                                   registry=self.registry)
        self._received = Counter("expstore_rpc_received_bytes", "Serialized bytes of request messages",
                                 labels, registry=self.registry)
        self._sent = Counter("expstore_rpc_sent_bytes", "Serialized bytes of response messages",
                             labels, registry=self.registry)
        self._per_call = (self._requests, self._duration, self._received, self._sent)
        self._children: dict[tuple[str, str], tuple] = {}  # labels -> their children of _per_call
        self.registry.register(TableCollector(store))
        self._http = None

    def record(self, call: "Call") -> None:
        """Count one finished RPC (~6 us; ~18 us when each instrument looked up its
        labels' child, as 10,000 small inserts a second would)."""
        known = call.table and (call.status == grpc.StatusCode.OK or call.table in self._store)
        labels = (call.method, call.table if known else "")
        children = self._children.get(labels)
        if children is None:  # as many as the registry holds: one set per (method, table)
            children = self._children[labels] = tuple(m.labels(*labels) for m in self._per_call)
        requests, duration, received, sent = children
        requests.inc()
        if call.status != grpc.StatusCode.OK:
            self._errors.labels(*labels, call.status.name).inc()
        duration.observe(time.perf_counter() - call.started)
        received.inc(call.bytes_in)
        sent.inc(call.bytes_out)

    def start_http(self, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        """Serve ``/metrics`` on host:port (HTTPS with the server's certificate when it
        has one), from a daemon thread. Raises OSError when the port cannot be bound."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry,
                                          certfile=tls_cert, keyfile=tls_key)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
