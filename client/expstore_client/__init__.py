"""expstore client: talk to an expstore-server from training loops and producers.

Depends on grpcio, protobuf, pyarrow and numpy only (torch optionally, for to_torch).
"""

from ._codec import InsertResult, PriorityUpdate, Reservation, TableInfo
from .aio import AsyncClient, QueryResult
from .batch import Ragged, SampleBatch
from .batcher import InsertBatcher
from .client import Client, InsertFuture
from ._shard_errors import ShardedInsertError, ShardError
from .sharded import ShardedClient, ShardedInsertFuture, connect, names_shards

__all__ = ["Client", "AsyncClient", "QueryResult", "InsertFuture", "InsertBatcher", "SampleBatch", "Ragged", "InsertResult",
           "PriorityUpdate", "Reservation", "TableInfo", "ShardedClient", "ShardedInsertFuture", "ShardError", "ShardedInsertError", "connect",
           "names_shards"]
