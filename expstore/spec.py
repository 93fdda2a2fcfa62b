"""Table configuration: plain, validated dataclasses built from dicts.

The same dict shape comes from the server's TOML config and from the CreateTable RPC (the
servicer turns the proto into a dict), so one parser serves both and its errors read the
same everywhere. Item counts are bounded here (``max_size``); byte budgets belong to tiers
(``memory_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import pyarrow as pa

from . import names
from .errors import FailedPrecondition, InvalidArgument

SAMPLER_TYPES = ("uniform", "prioritized", "fifo", "lifo", "max_heap", "min_heap", "group")
REMOVER_TYPES = ("fifo", "lifo", "min_priority")
KINDS = ("trajectory", "generic")
RATE_LIMITER_TYPES = ("min_size", "sample_to_insert_ratio", "queue", "stack", "custom")
TIERS = ("memory", "ssd", "remote")  # memory only (volatile) | + SSD (durable) | + remote
DURABILITIES = ("memory", "wal", "fsync")
METADATA_ENTRIES = 64
METADATA_KEY_CHARS = 128
METADATA_VALUE_CHARS = 4096
GROUP_TIMEOUT_ACTIONS = ("release", "drop")
INGEST_CHECKS = ("extends", "turns_mask", "group_prefix")
QUOTA_KEYS = ("min", "max")


@dataclass(frozen=True)
class SamplerSpec:
    """How items are chosen for ``Sample``.

    type: one of SAMPLER_TYPES.
    alpha, beta: prioritized only; P(i) ~ priority_i ** alpha (0 for a priority of 0,
        at any alpha), importance weights (N * P(i)) ** -beta normalised by the batch maximum.
    group_size: group only; members per GRPO group (>= 1). An item whose own
        ``group_size`` column is set must agree with it.
    drop_zero_variance: group only; complete groups whose rewards are all equal are
        removed instead of sampled (they carry no GRPO signal).
    group_order: group only; "uniform" over complete groups, "fifo" (oldest first) or
        "lifo" (newest first).
    task_weights: optional mixing weights per ``task``; a batch is split across tasks
        by a multinomial draw over the tasks that have items. "*" weighs unlisted tasks;
        without it they are never sampled.
    task_quotas: optional ``{task: {"min": share, "max": share}}``: every batch holds at
        least ceil(min * units) and at most floor(max * units) units (items; groups for
        the group sampler) of the task, exactly; the rest is split by ``task_weights``
        (1 for every task when unset). Shares are in [0, 1], min <= max, the mins sum to
        at most 1. See samplers/mixture.py.
    """

    type: str = "uniform"
    alpha: float = 1.0
    beta: float = 0.0
    group_size: int = 0
    drop_zero_variance: bool = False
    group_order: str = "uniform"
    task_weights: dict[str, float] | None = None
    task_quotas: dict[str, dict[str, float]] | None = None

    def __post_init__(self) -> None:
        _one_of("sampler.type", self.type, SAMPLER_TYPES)
        _require(math.isfinite(self.alpha) and self.alpha >= 0, "sampler.alpha must be a finite number >= 0")
        _require(math.isfinite(self.beta) and self.beta >= 0, "sampler.beta must be a finite number >= 0")
        _require(self.group_size >= 0, "sampler.group_size must be >= 0")
        _require(self.type != "group" or self.group_size >= 1, "the group sampler needs group_size >= 1")
        _one_of("sampler.group_order", self.group_order, ("uniform", "fifo", "lifo"))
        if self.task_weights is not None:
            _require(len(self.task_weights) > 0, "sampler.task_weights must not be empty")
            for task, w in self.task_weights.items():
                _require(math.isfinite(w) and w >= 0, f"sampler.task_weights[{task!r}] must be >= 0")
            _require(sum(self.task_weights.values()) > 0, "sampler.task_weights must not all be 0")
        if self.task_quotas is not None:
            _check_quotas(self.task_quotas)
            if not self.task_quotas:  # {} and unset are the same sampler (the proto cannot tell them apart)
                object.__setattr__(self, "task_quotas", None)

    @property
    def mixed(self) -> bool:
        """Whether batches are split across tasks (``task_weights`` or ``task_quotas``)."""
        return self.task_weights is not None or self.task_quotas is not None


@dataclass(frozen=True)
class RateLimiterSpec:
    """Reverb-style rate limiter parameters (see ``expstore.ratelimit``).

    type picks a preset: "min_size" (min_size_to_sample), "sample_to_insert_ratio"
    (samples_per_insert, min_size_to_sample, error_buffer), "queue"/"stack" (size), or
    "custom" (samples_per_insert, min_size_to_sample, min_diff, max_diff). Presets refuse
    parameters that would deadlock.
    """

    type: str = "min_size"
    min_size_to_sample: int = 1
    samples_per_insert: float = 1.0
    error_buffer: float | None = None
    min_diff: float | None = None
    max_diff: float | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        _one_of("rate_limiter.type", self.type, RATE_LIMITER_TYPES)


@dataclass(frozen=True)
class RoutedExpertsSpec:
    """The ``routed_experts`` column of an MoE policy's rollouts (router replay, R3): per
    token, the ids of the ``top_k`` experts the router chose in each of ``layers`` MoE
    layers, each below ``num_experts``. Stored as ``list<fixed_size_list<fixed_size_list<
    uint8 | uint16, top_k>, layers>>``: one entry per token, the narrowest unsigned type
    that holds every id (uint8 up to 256 experts), no per-token offsets; the storage
    layer compresses the chunks. Trainers get a (B, T, layers, top_k) tensor
    (``SampleBatch.to_torch``)."""

    layers: int
    top_k: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("layers", "top_k", "num_experts"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                     f"routed_experts.{name} must be an integer >= 1, got {value!r}")
        _require(self.num_experts <= 1 << 16, "routed_experts.num_experts must be <= 65536 (ids are uint16 at most)")
        _require(self.top_k <= self.num_experts, "routed_experts.top_k must be <= num_experts")
        _require(self.layers * self.top_k <= 1 << 16, "routed_experts: layers * top_k must be <= 65536 ids a token")

    @property
    def id_type(self) -> pa.DataType:
        return pa.uint8() if self.num_experts <= 1 << 8 else pa.uint16()

    @property
    def arrow_type(self) -> pa.DataType:
        return pa.list_(pa.list_(pa.list_(self.id_type, self.top_k), self.layers))


@dataclass(frozen=True)
class PacingSpec:
    """Admission-paced staleness (expstore/pacing.py): producers reserve before they
    start a rollout, and a reservation of n rows is granted while ``admitted + n <=
    (policy_version + max_staleness + 1) * rollouts_per_version``; nothing is removed for
    staleness. Needs ``max_staleness`` (the bound) and a trajectory table, which gets the
    column ``reservation_id`` (uint64): every inserted row names its reservation.

    rollouts_per_version: rows the trainer consumes per policy version (its batch size
        when it sets a new version after every step).
    lease_s: a reservation not settled by inserts within this many seconds (wall clock)
        expires and its unused rows return to the pace (a producer that died); a
        Reserve call may ask for another lease.
    """

    rollouts_per_version: int
    lease_s: float = 3600.0

    def __post_init__(self) -> None:
        _require(isinstance(self.rollouts_per_version, int) and not isinstance(self.rollouts_per_version, bool)
                 and self.rollouts_per_version >= 1, "pacing.rollouts_per_version must be an integer >= 1")
        _require(isinstance(self.lease_s, (int, float)) and not isinstance(self.lease_s, bool)
                 and math.isfinite(self.lease_s) and self.lease_s > 0,
                 "pacing.lease_s must be a finite number of seconds > 0")


@dataclass(frozen=True)
class TableSpec:
    """Everything a table is created with.

    kind: "trajectory" (protocol v1 schema plus the extra columns in ``schema``) or
        "generic" (``schema`` is the whole schema).
    schema: extra columns (trajectory) or the full schema (generic).
    key_column: idempotency key; a row whose key is live or was removed within the last
        ``dedup_window`` removals is not stored twice. Trajectory tables use ``traj_id``.
    max_size: items live for sampling; at the limit the remover makes room.
    max_times_sampled: an item is removed after this many samples (0: never).
    max_staleness: with policy version v set, items with policy_version < v -
        max_staleness are removed from the table (never sampled or streamed); with
        ``pacing``, the bound of the pace instead, and nothing is removed.
    memory_bytes: byte budget of the memory tier (a hard limit for volatile tables, a
        cache size for durable ones).
    tiers: "memory" (volatile: lost on restart), "ssd" (memory + RocksDB: durable,
        restored on restart) or "remote" (memory + SSD + the remote tier). Unset: "ssd"
        on a server with a data dir, "memory" in an embedded store without one.
    ssd_bytes: SSD watermark; beyond it the oldest chunks move to the remote tier.
    durability: what an acknowledged insert survives when the request does not say:
        "memory" (nothing), "wal" (a killed server), "fsync" (a power loss).
    archive: items that leave the sampling window move to the remote tier (queryable)
        instead of being deleted.
    vocab_size: trajectory tables only; every token id must be < vocab_size (ids are
        always >= 0). Unset: any non-negative int32 id is accepted.
    metadata: string notes for the tools around the table, never read by the engine;
        ``tokenizer`` names how the console decodes tokens (docs/console.md). At most
        METADATA_ENTRIES entries, keys of at most 128 and values of at most
        METADATA_VALUE_CHARS characters.
    group_timeout_s: group sampler only; a GRPO group still incomplete this many seconds
        (wall clock) after its first member arrived is released with the members it has
        or dropped, by ``group_timeout_action`` (expstore/group_timeouts.py). Tables with
        it have the server-filled column ``group_released_partial``.
    group_timeout_action: "release" (the group becomes eligible with what arrived, its
        ``group_size`` corrected and ``group_released_partial`` true) or "drop" (its
        members are removed).
    ingest_checks: trajectory tables; token-in, token-out checks of every insert, any of
        INGEST_CHECKS (expstore/ingest_checks.py). "extends" adds the ``episode_id`` column.
    routed_experts: trajectory tables; adds the ``routed_experts`` column (see
        RoutedExpertsSpec).
    pacing: admission-paced staleness instead of eviction (see PacingSpec).
    hot_retention_s, hot_retention_bytes: the hot window (expstore/retention.py): items
        inserted this many seconds ago (wall clock), and the oldest chunks' items while
        the live items' chunks take more than this many Arrow bytes, leave the sampling
        window (to the archive with ``archive = true``; else deleted).
    retention_s, retention_bytes: the total window (``archive = true``): an archive
        fragment is deleted once its newest row was inserted this long ago, and the
        oldest fragments while the live bytes plus the archive's exceed this.
    share_prefixes: tables with ``tokens`` and ``loss_mask``: each chunk stores the
        distinct prompt prefixes of its rows once (expstore/prefixes.py); samples still
        return whole rows. False: every row stores its own prompt.
    """

    name: str
    kind: str = "trajectory"
    schema: pa.Schema | None = None
    key_column: str | None = None
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    remover: str = "fifo"
    max_size: int = 1_000_000
    max_times_sampled: int = 0
    rate_limiter: RateLimiterSpec = field(default_factory=RateLimiterSpec)
    max_staleness: int | None = None
    memory_bytes: int = 2 << 30
    dedup_window: int = 1_000_000
    tiers: str | None = None
    ssd_bytes: int = 64 << 30
    durability: str | None = None  # None: "wal", or "memory" for a memory-only table
    archive: bool = False
    vocab_size: int | None = None
    metadata: dict[str, str] | None = None
    group_timeout_s: float | None = None
    group_timeout_action: str = "release"
    ingest_checks: tuple[str, ...] | None = None
    routed_experts: RoutedExpertsSpec | None = None
    pacing: PacingSpec | None = None
    hot_retention_s: float | None = None
    hot_retention_bytes: int | None = None
    retention_s: float | None = None
    retention_bytes: int | None = None
    share_prefixes: bool = True

    def __post_init__(self) -> None:
        names.check_table(self.name)
        _one_of("kind", self.kind, KINDS)
        _one_of("remover", self.remover, REMOVER_TYPES)
        _require(self.max_size >= 1, "max_size must be >= 1")
        _require(self.max_times_sampled >= 0, "max_times_sampled must be >= 0 (0: unlimited)")
        _require(self.max_staleness is None or self.max_staleness >= 0, "max_staleness must be >= 0")
        _require(self.memory_bytes >= 1, "memory_bytes must be >= 1")
        _require(self.dedup_window >= 0, "dedup_window must be >= 0")
        _require(isinstance(self.share_prefixes, bool), "share_prefixes must be true or false")
        if self.tiers is not None:
            _one_of("tiers", self.tiers, TIERS)
        if self.durability is not None:
            _one_of("durability", self.durability, DURABILITIES)
        _require(self.ssd_bytes >= 1, "ssd_bytes must be >= 1")
        _require(not self.archive or self.tiers in ("remote", None), "archive = true needs tiers = \"remote\"")
        _require(self.tiers != "memory" or self.durability in ("memory", None),
                 "a memory-only table can only acknowledge at durability \"memory\"")
        if self.metadata is not None:
            _check_metadata(self.metadata)
            if not self.metadata:  # {} and unset are the same table (the proto cannot tell them apart)
                object.__setattr__(self, "metadata", None)
        if self.kind == "generic":
            _require(self.schema is not None and len(self.schema) > 0,
                     "a generic table needs a schema")
        if self.schema is not None and "data_version" in self.schema.names:
            _require(pa.types.is_integer(self.schema.field("data_version").type),
                     f"column 'data_version' must be an integer type, got {self.schema.field('data_version').type}")
        if self.vocab_size is not None:
            _require(self.kind == "trajectory", "vocab_size applies to trajectory tables (their tokens)")
            _require(1 <= self.vocab_size <= 1 << 31, "vocab_size must be in 1..2**31 (token ids are int32)")
        if self.sampler.type == "group":
            _require(self.kind == "trajectory", "the group sampler needs a trajectory table (group_id)")
            _require(self.sampler.group_size <= self.max_size,
                     f"sampler.group_size {self.sampler.group_size} exceeds max_size {self.max_size}")
        _one_of("group_timeout_action", self.group_timeout_action, GROUP_TIMEOUT_ACTIONS)
        if self.group_timeout_s is not None:
            _require(isinstance(self.group_timeout_s, (int, float)) and math.isfinite(self.group_timeout_s)
                     and self.group_timeout_s > 0, "group_timeout_s must be a finite number of seconds > 0")
            _require(self.sampler.type == "group", "group_timeout_s needs the group sampler (sampler.type = \"group\")")
        if self.ingest_checks is not None:
            _require(not isinstance(self.ingest_checks, str), "ingest_checks must be a list of check names")
            for check in self.ingest_checks:
                _one_of("ingest_checks", check, INGEST_CHECKS)
            _require(not self.ingest_checks or self.kind == "trajectory", "ingest_checks apply to trajectory tables")
            # a set: order and repeats do not matter; empty and unset are the same table
            object.__setattr__(self, "ingest_checks", tuple(sorted(set(self.ingest_checks))) or None)
        if isinstance(self.routed_experts, dict):
            object.__setattr__(self, "routed_experts", _build("routed_experts", RoutedExpertsSpec, self.routed_experts))
        if self.routed_experts is not None:
            _require(self.kind == "trajectory", "routed_experts applies to trajectory tables (one entry per token)")
        self._check_retention()
        if isinstance(self.pacing, dict):
            object.__setattr__(self, "pacing", _build("pacing", PacingSpec, self.pacing))
        if self.pacing is not None:
            _require(self.kind == "trajectory", "pacing applies to trajectory tables (rows name their reservation)")
            _require(self.max_staleness is not None, "pacing needs max_staleness (the bound it paces admission by)")

    def _check_retention(self) -> None:
        for name in ("hot_retention_s", "retention_s"):
            v = getattr(self, name)
            _require(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                   and v > 0), f"{name} must be a finite number of seconds > 0")
        for name in ("hot_retention_bytes", "retention_bytes"):
            v = getattr(self, name)
            _require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                     f"{name} must be an integer number of bytes >= 1")
        _require(self.archive or (self.retention_s is None and self.retention_bytes is None),
                 "retention_s and retention_bytes bound the archive: they need archive = true")
        for hot, total in (("hot_retention_s", "retention_s"), ("hot_retention_bytes", "retention_bytes")):
            h, t = getattr(self, hot), getattr(self, total)
            _require(h is None or t is None or h <= t, f"{hot} ({h}) must not exceed {total} ({t}): the hot "
                                                       f"window is part of the total window")

    @property
    def retains(self) -> bool:
        """Whether the table has a hot or a total retention window."""
        return any(v is not None for v in (self.hot_retention_s, self.hot_retention_bytes,
                                           self.retention_s, self.retention_bytes))

    def engine_columns(self) -> list[pa.Field]:
        """Columns the config adds to a trajectory table's schema (after protocol v1 and
        ``schema``): ``routed_experts``, ``episode_id`` (ingest check "extends"), the
        server-filled ``group_released_partial`` (group timeouts) and ``reservation_id``
        (pacing)."""
        out = []
        if self.routed_experts is not None:
            out.append(pa.field("routed_experts", self.routed_experts.arrow_type))
        if self.ingest_checks and "extends" in self.ingest_checks:
            out.append(pa.field("episode_id", pa.string()))
        if self.group_timeout_s is not None:
            out.append(pa.field("group_released_partial", pa.bool_()))
        if self.pacing is not None:
            out.append(pa.field("reservation_id", pa.uint64()))
        return out

    def resolved(self, durable: bool) -> "TableSpec":
        """The spec with tiers and durability filled in, for a store that has (durable)
        or lacks an SSD tier."""
        tiers = self.tiers or ("ssd" if durable else "memory")
        if tiers != "memory" and not durable:
            raise FailedPrecondition(f"table {self.name!r}: tiers = {tiers!r} needs a data dir "
                                     f"(the SSD tier); use tiers = \"memory\" for a volatile table")
        durability = self.durability or ("memory" if tiers == "memory" else "wal")
        return replace(self, tiers=tiers, durability=durability)

    @property
    def key(self) -> str | None:
        return "traj_id" if self.kind == "trajectory" else self.key_column

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TableSpec":
        """Build from a TOML / JSON-like dict; unknown keys are errors, not ignored."""
        d = dict(d)
        _no_unknown_keys("table", d, {f.name for f in fields(cls)} | {"columns"})
        if "columns" in d:
            _require("schema" not in d, "give either columns or schema, not both")
            d["schema"] = schema_from_columns(d.pop("columns"))
        if isinstance(d.get("sampler"), dict):
            d["sampler"] = _build("sampler", SamplerSpec, d["sampler"])
        if isinstance(d.get("rate_limiter"), dict):
            d["rate_limiter"] = _build("rate_limiter", RateLimiterSpec, d["rate_limiter"])
        if isinstance(d.get("routed_experts"), dict):
            d["routed_experts"] = _build("routed_experts", RoutedExpertsSpec, d["routed_experts"])
        if isinstance(d.get("pacing"), dict):
            d["pacing"] = _build("pacing", PacingSpec, d["pacing"])
        if isinstance(d.get("ingest_checks"), list):
            d["ingest_checks"] = tuple(d["ingest_checks"])
        try:
            return cls(**d)
        except TypeError as e:  # a value of the wrong type
            raise InvalidArgument(f"table config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The inverse of ``from_dict`` (schema as a column -> type-string map)."""
        d = asdict(self)
        d["sampler"] = {k: v for k, v in d["sampler"].items() if v is not None}
        d["rate_limiter"] = {k: v for k, v in d["rate_limiter"].items() if v is not None}
        d.pop("schema")
        if self.ingest_checks is not None:
            d["ingest_checks"] = list(self.ingest_checks)
        if self.schema is not None:
            d["columns"] = {f.name: str(f.type) for f in self.schema}
        return {k: v for k, v in d.items() if v is not None}


def schema_from_columns(columns: dict[str, str]) -> pa.Schema:
    """``{"score": "float32", "tags": "list<string>"}`` -> pa.Schema."""
    _require(isinstance(columns, dict), "columns must map column names to type names")
    return pa.schema([pa.field(name, parse_type(t)) for name, t in columns.items()])


def parse_type(text: str) -> pa.DataType:
    """Parse the type names pyarrow prints: primitives, ``list<T>``, ``large_list<T>``."""
    t = str(text).strip()
    for prefix, make in (("list<", pa.list_), ("large_list<", pa.large_list)):
        if t.startswith(prefix) and t.endswith(">"):
            inner = t[len(prefix):-1]
            inner = inner.split(":", 1)[1] if inner.startswith("item:") else inner
            return make(parse_type(inner))
    try:
        return pa.type_for_alias(t)
    except (ValueError, KeyError):
        raise InvalidArgument(f"unknown column type {text!r} (e.g. int32, float32, string, list<int32>)") from None


def _check_metadata(metadata: Any) -> None:
    _require(isinstance(metadata, dict), "metadata must map names to strings")
    _require(len(metadata) <= METADATA_ENTRIES, f"metadata has {len(metadata)} entries; at most {METADATA_ENTRIES}")
    for k, v in metadata.items():
        _require(isinstance(k, str) and 0 < len(k) <= METADATA_KEY_CHARS,
                 f"metadata key {str(k)[:40]!r} must be a string of 1 to {METADATA_KEY_CHARS} characters")
        _require(isinstance(v, str) and len(v) <= METADATA_VALUE_CHARS,
                 f"metadata[{k[:40]!r}] must be a string of at most {METADATA_VALUE_CHARS} characters")


def _check_quotas(quotas: Any) -> None:
    _require(isinstance(quotas, dict), "sampler.task_quotas must map task names to {min, max} shares")
    for task, q in quotas.items():
        what = f"sampler.task_quotas[{task!r}]"
        _require(isinstance(task, str) and task != "*", f"{what}: quotas name tasks (\"*\" is not one)")
        _require(isinstance(q, dict) and q, f"{what} must be a table of min and/or max shares")
        _no_unknown_keys(what, q, set(QUOTA_KEYS))
        for key, share in q.items():
            _require(isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1,
                     f"{what}.{key} must be a share in [0, 1], got {share!r}")
        _require(q.get("min", 0) <= q.get("max", 1), f"{what}: min {q.get('min')} exceeds max {q.get('max')}")
    total = sum(q.get("min", 0) for q in quotas.values())
    _require(total <= 1 + 1e-9, f"sampler.task_quotas: the min shares sum to {total:g}, more than 1")


def _build(what: str, cls: type, d: dict[str, Any]):
    _no_unknown_keys(what, d, {f.name for f in fields(cls)})
    try:
        return cls(**d)
    except TypeError as e:
        raise InvalidArgument(f"{what}: {e}") from None


def _no_unknown_keys(what: str, d: dict, known: set[str]) -> None:
    unknown = sorted(set(d) - known)
    _require(not unknown, f"{what}: unknown key(s) {unknown}; known: {sorted(known)}")


def _one_of(what: str, value: Any, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{what} must be one of {list(allowed)}, got {value!r}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)
