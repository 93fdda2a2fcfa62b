from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Durability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DURABILITY_UNSPECIFIED: _ClassVar[Durability]
    DURABILITY_MEMORY: _ClassVar[Durability]
    DURABILITY_WAL: _ClassVar[Durability]
    DURABILITY_FSYNC: _ClassVar[Durability]
DURABILITY_UNSPECIFIED: Durability
DURABILITY_MEMORY: Durability
DURABILITY_WAL: Durability
DURABILITY_FSYNC: Durability

class SamplerConfig(_message.Message):
    __slots__ = ("type", "alpha", "beta", "group_size", "drop_zero_variance", "group_order", "task_weights", "task_quotas")
    class TaskWeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TaskQuotasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TaskQuota
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TaskQuota, _Mapping]] = ...) -> None: ...
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DROP_ZERO_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    GROUP_ORDER_FIELD_NUMBER: _ClassVar[int]
    TASK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TASK_QUOTAS_FIELD_NUMBER: _ClassVar[int]
    type: str
    alpha: float
    beta: float
    group_size: int
    drop_zero_variance: bool
    group_order: str
    task_weights: _containers.ScalarMap[str, float]
    task_quotas: _containers.MessageMap[str, TaskQuota]
    def __init__(self, type: _Optional[str] = ..., alpha: _Optional[float] = ..., beta: _Optional[float] = ..., group_size: _Optional[int] = ..., drop_zero_variance: _Optional[bool] = ..., group_order: _Optional[str] = ..., task_weights: _Optional[_Mapping[str, float]] = ..., task_quotas: _Optional[_Mapping[str, TaskQuota]] = ...) -> None: ...

class TaskQuota(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: float
    max: float
    def __init__(self, min: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class RoutedExpertsConfig(_message.Message):
    __slots__ = ("layers", "top_k", "num_experts")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    top_k: int
    num_experts: int
    def __init__(self, layers: _Optional[int] = ..., top_k: _Optional[int] = ..., num_experts: _Optional[int] = ...) -> None: ...

class PacingConfig(_message.Message):
    __slots__ = ("rollouts_per_version", "lease_s")
    ROLLOUTS_PER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    rollouts_per_version: int
    lease_s: float
    def __init__(self, rollouts_per_version: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RateLimiterConfig(_message.Message):
    __slots__ = ("type", "min_size_to_sample", "samples_per_insert", "error_buffer", "min_diff", "max_diff", "size")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUFFER_FIELD_NUMBER: _ClassVar[int]
    MIN_DIFF_FIELD_NUMBER: _ClassVar[int]
    MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    type: str
    min_size_to_sample: int
    samples_per_insert: float
    error_buffer: float
    min_diff: float
    max_diff: float
    size: int
    def __init__(self, type: _Optional[str] = ..., min_size_to_sample: _Optional[int] = ..., samples_per_insert: _Optional[float] = ..., error_buffer: _Optional[float] = ..., min_diff: _Optional[float] = ..., max_diff: _Optional[float] = ..., size: _Optional[int] = ...) -> None: ...

class TableConfig(_message.Message):
    __slots__ = ("name", "kind", "schema", "key_column", "sampler", "remover", "max_size", "max_times_sampled", "rate_limiter", "max_staleness", "memory_bytes", "dedup_window", "tiers", "ssd_bytes", "durability", "archive", "vocab_size", "metadata", "group_timeout_s", "group_timeout_action", "ingest_checks", "routed_experts", "pacing", "hot_retention_s", "hot_retention_bytes", "retention_s", "retention_bytes", "share_prefixes")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    KEY_COLUMN_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    REMOVER_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEDUP_WINDOW_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    GROUP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    GROUP_TIMEOUT_ACTION_FIELD_NUMBER: _ClassVar[int]
    INGEST_CHECKS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PACING_FIELD_NUMBER: _ClassVar[int]
    HOT_RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    HOT_RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARE_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    schema: bytes
    key_column: str
    sampler: SamplerConfig
    remover: str
    max_size: int
    max_times_sampled: int
    rate_limiter: RateLimiterConfig
    max_staleness: int
    memory_bytes: int
    dedup_window: int
    tiers: str
    ssd_bytes: int
    durability: str
    archive: bool
    vocab_size: int
    metadata: _containers.ScalarMap[str, str]
    group_timeout_s: float
    group_timeout_action: str
    ingest_checks: _containers.RepeatedScalarFieldContainer[str]
    routed_experts: RoutedExpertsConfig
    pacing: PacingConfig
    hot_retention_s: float
    hot_retention_bytes: int
    retention_s: float
    retention_bytes: int
    share_prefixes: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., schema: _Optional[bytes] = ..., key_column: _Optional[str] = ..., sampler: _Optional[_Union[SamplerConfig, _Mapping]] = ..., remover: _Optional[str] = ..., max_size: _Optional[int] = ..., max_times_sampled: _Optional[int] = ..., rate_limiter: _Optional[_Union[RateLimiterConfig, _Mapping]] = ..., max_staleness: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., dedup_window: _Optional[int] = ..., tiers: _Optional[str] = ..., ssd_bytes: _Optional[int] = ..., durability: _Optional[str] = ..., archive: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., group_timeout_s: _Optional[float] = ..., group_timeout_action: _Optional[str] = ..., ingest_checks: _Optional[_Iterable[str]] = ..., routed_experts: _Optional[_Union[RoutedExpertsConfig, _Mapping]] = ..., pacing: _Optional[_Union[PacingConfig, _Mapping]] = ..., hot_retention_s: _Optional[float] = ..., hot_retention_bytes: _Optional[int] = ..., retention_s: _Optional[float] = ..., retention_bytes: _Optional[int] = ..., share_prefixes: _Optional[bool] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("config", "if_not_exists")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    IF_NOT_EXISTS_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    if_not_exists: bool
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., if_not_exists: _Optional[bool] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("config", "schema", "num_items", "policy_version")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NUM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    config: TableConfig
    schema: bytes
    num_items: int
    policy_version: int
    def __init__(self, config: _Optional[_Union[TableConfig, _Mapping]] = ..., schema: _Optional[bytes] = ..., num_items: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("table", "arrow_ipc", "priorities", "timeout_s", "durability", "parts", "part_timeouts_s")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PART_TIMEOUTS_S_FIELD_NUMBER: _ClassVar[int]
    table: str
    arrow_ipc: bytes
    priorities: _containers.RepeatedScalarFieldContainer[float]
    timeout_s: float
    durability: Durability
    parts: _containers.RepeatedScalarFieldContainer[int]
    part_timeouts_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, table: _Optional[str] = ..., arrow_ipc: _Optional[bytes] = ..., priorities: _Optional[_Iterable[float]] = ..., timeout_s: _Optional[float] = ..., durability: _Optional[_Union[Durability, str]] = ..., parts: _Optional[_Iterable[int]] = ..., part_timeouts_s: _Optional[_Iterable[float]] = ...) -> None: ...

class InsertPart(_message.Message):
    __slots__ = ("num_inserted", "num_duplicates", "num_stale", "code", "message")
    NUM_INSERTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NUM_STALE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    num_inserted: int
    num_duplicates: int
    num_stale: int
    code: int
    message: str
    def __init__(self, num_inserted: _Optional[int] = ..., num_duplicates: _Optional[int] = ..., num_stale: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("item_ids", "num_inserted", "num_duplicates", "num_stale", "parts")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_INSERTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NUM_STALE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    num_inserted: int
    num_duplicates: int
    num_stale: int
    parts: _containers.RepeatedCompositeFieldContainer[InsertPart]
    def __init__(self, item_ids: _Optional[_Iterable[int]] = ..., num_inserted: _Optional[int] = ..., num_duplicates: _Optional[int] = ..., num_stale: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[InsertPart, _Mapping]]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("table", "batch_size", "timeout_s", "compress", "step", "data_versions")
    class DataVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: VersionRange
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[VersionRange, _Mapping]] = ...) -> None: ...
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    table: str
    batch_size: int
    timeout_s: float
    compress: bool
    step: int
    data_versions: _containers.MessageMap[str, VersionRange]
    def __init__(self, table: _Optional[str] = ..., batch_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., compress: _Optional[bool] = ..., step: _Optional[int] = ..., data_versions: _Optional[_Mapping[str, VersionRange]] = ...) -> None: ...

class VersionRange(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: int
    max: int
    def __init__(self, min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("table", "group", "batch_size", "timeout_s", "visibility_timeout_s", "compress", "start", "ack_item_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ACK_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    group: str
    batch_size: int
    timeout_s: float
    visibility_timeout_s: float
    compress: bool
    start: str
    ack_item_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., group: _Optional[str] = ..., batch_size: _Optional[int] = ..., timeout_s: _Optional[float] = ..., visibility_timeout_s: _Optional[float] = ..., compress: _Optional[bool] = ..., start: _Optional[str] = ..., ack_item_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RowsResponse(_message.Message):
    __slots__ = ("arrow_ipc", "item_ids", "priorities", "probabilities", "weights", "times_sampled", "policy_versions")
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    arrow_ipc: bytes
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    weights: _containers.RepeatedScalarFieldContainer[float]
    times_sampled: _containers.RepeatedScalarFieldContainer[int]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, arrow_ipc: _Optional[bytes] = ..., item_ids: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[float]] = ..., probabilities: _Optional[_Iterable[float]] = ..., weights: _Optional[_Iterable[float]] = ..., times_sampled: _Optional[_Iterable[int]] = ..., policy_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("table", "group", "item_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    group: str
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., group: _Optional[str] = ..., item_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("num_acked", "num_already_acked")
    NUM_ACKED_FIELD_NUMBER: _ClassVar[int]
    NUM_ALREADY_ACKED_FIELD_NUMBER: _ClassVar[int]
    num_acked: int
    num_already_acked: int
    def __init__(self, num_acked: _Optional[int] = ..., num_already_acked: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("table", "group", "item_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    group: str
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., group: _Optional[str] = ..., item_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("table", "item_ids", "priorities")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    table: str
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, table: _Optional[str] = ..., item_ids: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class UpdatePrioritiesResponse(_message.Message):
    __slots__ = ("num_updated", "unknown_item_ids")
    NUM_UPDATED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    num_updated: int
    unknown_item_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_updated: _Optional[int] = ..., unknown_item_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("table", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SetPolicyVersionResponse(_message.Message):
    __slots__ = ("version", "num_expired")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_expired: int
    def __init__(self, version: _Optional[int] = ..., num_expired: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("table", "count", "timeout_s", "lease_s")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    table: str
    count: int
    timeout_s: float
    lease_s: float
    def __init__(self, table: _Optional[str] = ..., count: _Optional[int] = ..., timeout_s: _Optional[float] = ..., lease_s: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "count", "lease_deadline", "policy_version")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    count: int
    lease_deadline: float
    policy_version: int
    def __init__(self, reservation_id: _Optional[int] = ..., count: _Optional[int] = ..., lease_deadline: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("table", "reservation_id")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    table: str
    reservation_id: int
    def __init__(self, table: _Optional[str] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("num_released",)
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    num_released: int
    def __init__(self, num_released: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("table", "item_ids", "compress")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    table: str
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    compress: bool
    def __init__(self, table: _Optional[str] = ..., item_ids: _Optional[_Iterable[int]] = ..., compress: _Optional[bool] = ...) -> None: ...

class QueryRequest(_message.Message):
    __slots__ = ("sql", "max_rows")
    SQL_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    sql: str
    max_rows: int
    def __init__(self, sql: _Optional[str] = ..., max_rows: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("table", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, table: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ...) -> None: ...

class CommitCutRequest(_message.Message):
    __slots__ = ("table", "group", "step", "item_ids", "tag")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    table: str
    group: str
    step: int
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    tag: str
    def __init__(self, table: _Optional[str] = ..., group: _Optional[str] = ..., step: _Optional[int] = ..., item_ids: _Optional[_Iterable[int]] = ..., tag: _Optional[str] = ...) -> None: ...

class CommitCutResponse(_message.Message):
    __slots__ = ("num_acked",)
    NUM_ACKED_FIELD_NUMBER: _ClassVar[int]
    num_acked: int
    def __init__(self, num_acked: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("table", "group", "step")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    table: str
    group: str
    step: int
    def __init__(self, table: _Optional[str] = ..., group: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("position", "inflight")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    position: int
    inflight: int
    def __init__(self, position: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("table", "step")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    table: str
    step: int
    def __init__(self, table: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("item_ids", "policy_versions")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, item_ids: _Optional[_Iterable[int]] = ..., policy_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("name", "uri", "num_bytes", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    uri: str
    num_bytes: int
    seconds: float
    def __init__(self, name: _Optional[str] = ..., uri: _Optional[str] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("flight_port", "flight_tls", "insert_unary", "insert_parts")
    FLIGHT_PORT_FIELD_NUMBER: _ClassVar[int]
    FLIGHT_TLS_FIELD_NUMBER: _ClassVar[int]
    INSERT_UNARY_FIELD_NUMBER: _ClassVar[int]
    INSERT_PARTS_FIELD_NUMBER: _ClassVar[int]
    flight_port: int
    flight_tls: bool
    insert_unary: bool
    insert_parts: bool
    def __init__(self, flight_port: _Optional[int] = ..., flight_tls: _Optional[bool] = ..., insert_unary: _Optional[bool] = ..., insert_parts: _Optional[bool] = ...) -> None: ...

class FlightTicket(_message.Message):
    __slots__ = ("sample", "stream", "get", "query")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    GET_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    sample: SampleRequest
    stream: StreamRequest
    get: GetRequest
    query: QueryRequest
    def __init__(self, sample: _Optional[_Union[SampleRequest, _Mapping]] = ..., stream: _Optional[_Union[StreamRequest, _Mapping]] = ..., get: _Optional[_Union[GetRequest, _Mapping]] = ..., query: _Optional[_Union[QueryRequest, _Mapping]] = ...) -> None: ...
