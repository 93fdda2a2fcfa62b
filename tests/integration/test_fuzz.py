"""Fuzzing the wire with raw stubs: arbitrary bytes, scalars and corrupted Arrow IPC in
every request type. Every call must end with a gRPC status before its deadline, never an
INTERNAL/UNKNOWN one (those mean an unhandled exception in the server), and the server
must keep serving."""

from __future__ import annotations

import math
import time

import grpc
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expstore_client import Client

from ._util import ipc_bytes, pb, pb_grpc, trajectories

DEADLINE = 5.0
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
TABLES = ["fz", "fz_prio", "fz_fifo", "fz_group", "fz_generic", "fz_limited", "fz_paced"]
SERVER_FAULTS = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
METHODS = {m.name: m for m in pb.DESCRIPTOR.services_by_name["ExperienceStore"].methods}


class Server:
    """The fuzzed server (a short repr: hypothesis prints the test's arguments)."""

    def __init__(self, process):
        self.process = process
        self.address = process.address
        self.proc = process.proc

    @property
    def log(self) -> str:
        return self.process.log

    def __repr__(self) -> str:
        return f"Server({self.address})"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from ._util import start_server

    s = Server(start_server(tmp_path_factory.mktemp("fuzz") / "data"))
    with Client(s.address) as c:
        c.create_table("fz")
        c.create_table("fz_prio", sampler={"type": "prioritized", "alpha": 0.7, "beta": 0.5})
        c.create_table("fz_fifo", sampler="fifo", max_times_sampled=1000, max_size=100)
        c.create_table("fz_group", sampler={"type": "group", "group_size": 2})
        c.create_table("fz_generic", kind="generic", key_column="k",
                       schema=pa.schema([("k", pa.string()), ("v", pa.list_(pa.float32()))]))
        c.create_table("fz_limited", rate_limiter={"type": "min_size", "min_size_to_sample": 1000})
        c.create_table("fz_paced", max_staleness=1, pacing={"rollouts_per_version": 4, "lease_s": 1.0})
        for t in ("fz", "fz_prio", "fz_fifo", "fz_limited"):
            c.insert(t, trajectories(20, id_prefix="seed"))
        c.insert("fz_group", trajectories(8, groups=4, id_prefix="grp"))
        c.insert("fz_generic", [{"k": f"k{i}", "v": [float(i)] * 3} for i in range(5)])
        next(c.stream("fz", "seen", 5, poll_timeout=1))
    yield s
    s.process.stop()


@pytest.fixture(scope="module")
def stub(fuzz_server):
    channel = grpc.insecure_channel(fuzz_server.address)
    yield pb_grpc.ExperienceStoreStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def raw_channel(fuzz_server):
    channel = grpc.insecure_channel(fuzz_server.address)
    yield channel
    channel.close()


def check(call, server) -> grpc.StatusCode:
    """Run one RPC; it must end in time, with a status that is not a server fault."""
    t0 = time.monotonic()
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    elapsed = time.monotonic() - t0
    assert elapsed < DEADLINE + 1.0, f"the call took {elapsed:.1f} s"
    assert code not in SERVER_FAULTS, f"{code}: {details}"
    assert code != grpc.StatusCode.UNAVAILABLE, f"server down? {details}"
    assert server.proc.poll() is None, "the server died"
    return code


# -- strategies ---------------------------------------------------------------------------

any_float = st.floats(allow_nan=True, allow_infinity=True)
short_timeout = st.one_of(st.just(0.0), st.floats(-5, 0.2), st.just(math.nan), st.just(-math.inf))
table_names = st.one_of(st.sampled_from(TABLES), st.text(max_size=16), st.just(""))
int64 = st.integers(-(2**63), 2**63 - 1)
uint64 = st.integers(0, 2**64 - 1)
item_ids = st.lists(st.one_of(st.integers(0, 60), uint64), max_size=12)
sample_sizes = st.one_of(st.integers(-3, 80), int64)
stream_sizes = st.one_of(st.integers(-3, 80), int64)
group_names = st.one_of(st.sampled_from(["seen", "g", ""]), st.text(max_size=12))


def _payloads():
    data = trajectories(3, tokens=(9, 30), id_prefix="fuzzrow")
    generic = pa.table({"k": ["a", "b"], "v": [[1.0], [2.0, 3.0]]},
                       schema=pa.schema([("k", pa.string()), ("v", pa.list_(pa.float32()))]))
    return [ipc_bytes(data), ipc_bytes(data, compress=True), ipc_bytes(generic),
            ipc_bytes(generic, compress=True), ipc_bytes(data.slice(0, 1))]


PAYLOADS = _payloads()


@st.composite
def corrupted(draw):
    """A valid IPC stream with bit flips, truncation, inserted or overwritten bytes."""
    data = bytearray(draw(st.sampled_from(PAYLOADS)))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "overwrite", "int32"]))
        if not data:
            break
        pos = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[pos:pos + len(chunk)] = chunk
        else:  # a plausible-looking length or offset: a little-endian int32
            value = draw(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31), 2**16, 7, 1000]))
            data[pos:pos + 4] = value.to_bytes(4, "little", signed=True)
    return bytes(data)


ipc_payloads = st.one_of(st.binary(max_size=2048), corrupted(), st.sampled_from(PAYLOADS))


@st.composite
def insert_messages(draw):
    n = draw(st.integers(1, 3))
    out = []
    for i in range(n):
        req = pb.InsertRequest(arrow_ipc=draw(ipc_payloads),
                               priorities=draw(st.lists(any_float, max_size=4)))
        if i == 0 or draw(st.booleans()):
            req.table = draw(table_names)
        if i == 0:
            req.timeout_s = draw(short_timeout)
            req.durability = draw(st.integers(0, 2**31 - 1))
        out.append(req)
    return out


def optional(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def table_configs(draw):
    sampler = pb.SamplerConfig(type=draw(st.one_of(st.sampled_from(
        ["uniform", "prioritized", "fifo", "lifo", "max_heap", "min_heap", "group", ""]), st.text(max_size=8))))
    for name, strategy in [("alpha", any_float), ("beta", any_float),
                           ("group_size", st.integers(-5, 10**6)), ("drop_zero_variance", st.booleans()),
                           ("group_order", st.one_of(st.sampled_from(["uniform", "fifo", "lifo"]), st.text(max_size=5)))]:
        value = draw(optional(strategy))
        if value is not None:
            setattr(sampler, name, value)
    for task, w in draw(st.dictionaries(st.text(max_size=5), any_float, max_size=3)).items():
        sampler.task_weights[task] = w
    limiter = pb.RateLimiterConfig(type=draw(st.one_of(st.sampled_from(
        ["min_size", "sample_to_insert_ratio", "queue", "stack", "custom", ""]), st.text(max_size=8))))
    for name, strategy in [("min_size_to_sample", int64), ("samples_per_insert", any_float),
                           ("error_buffer", any_float), ("min_diff", any_float), ("max_diff", any_float),
                           ("size", int64)]:
        value = draw(optional(strategy))
        if value is not None:
            setattr(limiter, name, value)
    schema = draw(st.one_of(st.just(b""), st.binary(max_size=256), st.sampled_from([
        pa.schema([("extra", pa.float32())]).serialize().to_pybytes(),
        pa.schema([("priority", pa.float64())]).serialize().to_pybytes(),
        pa.schema([("k", pa.string()), ("v", pa.dictionary(pa.int8(), pa.string()))]).serialize().to_pybytes(),
    ])))
    config = pb.TableConfig(
        name=draw(st.one_of(st.from_regex(r"\Afz_new_[a-z0-9]{1,6}\Z"), st.text(max_size=10))),
        kind=draw(st.one_of(st.sampled_from(["trajectory", "generic", ""]), st.text(max_size=6))),
        schema=schema, sampler=sampler, rate_limiter=limiter)
    for name, strategy in [("key_column", st.one_of(st.sampled_from(["k", "traj_id"]), st.text(max_size=4))),
                           ("remover", st.one_of(st.sampled_from(["fifo", "lifo", "min_priority"]),
                                                 st.text(max_size=4))),
                           ("max_size", int64), ("max_times_sampled", int64), ("max_staleness", int64),
                           ("memory_bytes", int64), ("dedup_window", int64), ("hot_retention_s", any_float),
                           ("hot_retention_bytes", int64), ("retention_s", any_float), ("retention_bytes", int64)]:
        value = draw(optional(strategy))
        if value is not None:
            setattr(config, name, value)
    if draw(st.booleans()):
        config.pacing.rollouts_per_version = draw(int64)
        if (lease := draw(optional(any_float))) is not None:
            config.pacing.lease_s = lease
    return pb.CreateTableRequest(config=config, if_not_exists=draw(st.booleans()))


@st.composite
def read_calls(draw):
    """(method name, request) for every non-Insert, non-CreateTable RPC."""
    kind = draw(st.sampled_from(["Sample", "Stream", "Get", "Ack", "Nack", "UpdatePriorities", "SetPolicyVersion",
                                 "Stats", "DescribeTable", "DropTable", "ListTables", "Reserve", "Release"]))
    table = draw(table_names)
    if kind == "Sample":
        return kind, pb.SampleRequest(table=table, batch_size=draw(sample_sizes), timeout_s=draw(short_timeout),
                                      compress=draw(st.booleans()))
    if kind == "Stream":
        return kind, pb.StreamRequest(
            table=table, group=draw(group_names), batch_size=draw(stream_sizes), timeout_s=draw(short_timeout),
            visibility_timeout_s=draw(any_float), compress=draw(st.booleans()),
            start=draw(st.one_of(st.sampled_from(["earliest", "latest", ""]), st.text(max_size=6))))
    if kind == "Get":
        return kind, pb.GetRequest(table=table, item_ids=draw(item_ids), compress=draw(st.booleans()))
    if kind == "Ack":
        return kind, pb.AckRequest(table=table, group=draw(group_names), item_ids=draw(item_ids))
    if kind == "Nack":
        return kind, pb.NackRequest(table=table, group=draw(group_names), item_ids=draw(item_ids))
    if kind == "UpdatePriorities":
        ids = draw(item_ids)
        n = draw(st.one_of(st.just(len(ids)), st.integers(0, 5)))
        return kind, pb.UpdatePrioritiesRequest(table=table, item_ids=ids,
                                                priorities=draw(st.lists(any_float, min_size=n, max_size=n)))
    if kind == "SetPolicyVersion":
        return kind, pb.SetPolicyVersionRequest(table=table, version=draw(int64))
    if kind == "Reserve":
        lease = draw(st.one_of(st.none(), any_float))
        return kind, pb.ReserveRequest(table=table, count=draw(st.one_of(st.integers(-2, 10), int64)),
                                       timeout_s=draw(short_timeout), lease_s=lease)
    if kind == "Release":
        return kind, pb.ReleaseRequest(table=table, reservation_id=draw(st.one_of(st.integers(0, 5), uint64)))
    if kind == "Stats":
        return kind, pb.StatsRequest(table=table)
    if kind == "DescribeTable":
        return kind, pb.DescribeTableRequest(table=table)
    if kind == "DropTable":  # never one of the fixture's tables
        return kind, pb.DropTableRequest(table=draw(st.text(max_size=16).filter(lambda t: t not in TABLES)))
    return kind, pb.ListTablesRequest()


def invoke(stub, method: str, request):
    fn = getattr(stub, method)
    if method == "Insert":
        return lambda: fn(iter(request), timeout=DEADLINE)
    if METHODS[method].server_streaming:
        return lambda: list(fn(request, timeout=DEADLINE))
    return lambda: fn(request, timeout=DEADLINE)


# -- the fuzzers ---------------------------------------------------------------------------

@FUZZ
@given(messages=insert_messages())
def test_fuzz_insert(fuzz_server, stub, messages):
    check(invoke(stub, "Insert", messages), fuzz_server)


@FUZZ
@given(payload=corrupted(), table=st.sampled_from(["fz", "fz_generic", "fz_group"]),
       priorities=st.booleans())
def test_fuzz_corrupted_ipc(fuzz_server, stub, payload, table, priorities):
    req = pb.InsertRequest(table=table, arrow_ipc=payload, timeout_s=0.1)
    if priorities:
        req.priorities.extend([1.0, 2.0, 3.0])
    check(invoke(stub, "Insert", [req]), fuzz_server)


@FUZZ
@given(request=table_configs())
def test_fuzz_create_table(fuzz_server, stub, request):
    code = check(invoke(stub, "CreateTable", request), fuzz_server)
    name = request.config.name
    if code == grpc.StatusCode.OK and name not in TABLES:
        stub.DropTable(pb.DropTableRequest(table=name), timeout=DEADLINE)


@FUZZ
@given(call=read_calls())
def test_fuzz_reads_and_updates(fuzz_server, stub, call):
    method, request = call
    check(invoke(stub, method, request), fuzz_server)


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), frames=st.lists(st.binary(max_size=512), min_size=1, max_size=3))
def test_fuzz_raw_request_bytes(fuzz_server, raw_channel, method, frames):
    """Bytes that may not even parse as the request message."""
    m = METHODS[method]
    path = f"/expstore.v1.ExperienceStore/{method}"
    kind = ("stream" if m.client_streaming else "unary") + "_" + ("stream" if m.server_streaming else "unary")
    fn = getattr(raw_channel, kind)(path, request_serializer=None, response_deserializer=None)
    if m.client_streaming:
        call = lambda: fn(iter(frames), timeout=DEADLINE)
    elif m.server_streaming:
        call = lambda: list(fn(frames[0], timeout=DEADLINE))
    else:
        call = lambda: fn(frames[0], timeout=DEADLINE)
    check(call, fuzz_server)


def test_schema_bytes_pyarrow_rejects_with_oserror(fuzz_server, stub):
    config = pb.TableConfig(name="fz_bad_schema", schema=b"\xff" * 8)
    with pytest.raises(grpc.RpcError) as info:
        stub.CreateTable(pb.CreateTableRequest(config=config), timeout=DEADLINE)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_undecodable_nested_field_name(fuzz_server, stub):
    payload = PAYLOADS[0]
    i = payload.index(b"tool_name")  # a field of the turns struct
    bad = payload[:i] + b"\xff" + payload[i + 1:]
    with pytest.raises(grpc.RpcError) as info:
        stub.Insert(iter([pb.InsertRequest(table="fz", arrow_ipc=bad)]), timeout=DEADLINE)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()


def test_request_timeout_longer_than_deadline_is_bounded(fuzz_server, stub):
    for timeout_s in (math.inf, 1e300):
        t0 = time.monotonic()
        req = pb.SampleRequest(table="fz_limited", batch_size=1, timeout_s=timeout_s)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Sample(req, timeout=0.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.5


def test_server_survives_the_fuzz(fuzz_server):
    """Runs last in this module: the server is alive, serves a normal round trip, and
    logged no internal error."""
    assert fuzz_server.proc.poll() is None
    with Client(fuzz_server.address) as c:
        c.create_table("after_fuzz")
        data = trajectories(5, id_prefix="after")
        ids = c.insert("after_fuzz", data).item_ids
        assert c.get("after_fuzz", ids).data.column("tokens").to_pylist() == data.column("tokens").to_pylist()
        assert len(c.sample("after_fuzz", 3)) == 3
        assert set(TABLES) <= {t.name for t in c.list_tables()}
        assert c.describe("fz").num_items >= 20
    assert fuzz_server.proc.poll() is None
    assert '"internal error"' not in fuzz_server.log
