"""The native block encoder (expstore/blocks_native.cpp), which writes a chunk file's
blocks from the batches' own buffers: byte for byte what ``codec.encode_block``
serializes, with the same sizes and CRC32C checksums, for any rows and any slices of
them (shared prompt columns included); every byte written whatever each write takes;
a write the system refuses ends in its OSError, with exactly the bytes before in the
file."""

from __future__ import annotations

import decimal
import errno
import fcntl
import os
import subprocess
import sys
import textwrap
import threading

import crc32c
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expstore import codec, prefixes
from expstore.synthetic import trajectories
from expstore.tiers.rocks import block_offsets

pytestmark = pytest.mark.skipif(codec.native is None, reason="the native encoder is not built (no C++ compiler)")


def written(blocks: codec.Blocks, path) -> bytes:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        blocks.write_to(fd)
    finally:
        os.close(fd)
    return path.read_bytes()


def assert_encoded_as_serialized(batches: list[pa.RecordBatch], path) -> None:
    """The same sizes, checksums and bytes, the checksums read before the write (computed
    then) or after it (computed as each group of blocks is written)."""
    want = [codec.encode_block(b).to_pybytes() for b in batches]
    for checksums_first in (True, False):
        blocks = codec.encode_blocks(batches)
        assert isinstance(blocks, codec.native.Messages)
        assert list(blocks.sizes) == [len(w) for w in want]
        checksums = list(blocks.checksums) if checksums_first else None
        assert written(blocks, path) == b"".join(want)
        assert (checksums or list(blocks.checksums)) == [crc32c.crc32c(w) for w in want]


@st.composite
def sliced(draw):
    """A batch cut into slices at arbitrary rows: binary values of 0 to 40 KiB (pieces
    copied and pieces written where they are; checksums over one lane or three), lists
    of int32 of up to 80 KiB, booleans (a bitmap sliced off a byte's boundary), nulls."""
    n = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sizes = draw(st.lists(st.none() | st.integers(0, 40_000), min_size=n, max_size=n))
    lengths = draw(st.lists(st.none() | st.integers(0, 20_000), min_size=n, max_size=n))
    batch = pa.RecordBatch.from_arrays([
        pa.array([None if k is None else rng.bytes(k) for k in sizes], pa.binary()),
        pa.array([None if k is None else rng.integers(-2**31, 2**31, k, dtype=np.int32) for k in lengths],
                 pa.list_(pa.int32())),
        pa.array(draw(st.lists(st.none() | st.booleans(), min_size=n, max_size=n)), pa.bool_()),
    ], names=["bytes", "tokens", "done"])
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    bounds = [0, *cuts, n]
    return [batch.slice(lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=sliced())
def test_any_slices_are_written_as_their_serialized_bytes(tmp_path, batches):
    assert_encoded_as_serialized(batches, tmp_path / "blocks")


@pytest.mark.parametrize("shared", [False, True])
def test_a_chunks_blocks_are_written_as_their_serialized_bytes(tmp_path, shared):
    """The SSD tier's blocks of a chunk of trajectories (nested turns, strings), with
    their prompts shared or not (list views in a struct, compacted per block)."""
    batch = trajectories(24, tokens=2560, prompt_tokens=2048, groups=2, shared_prompts=True, seed=3) \
        .combine_chunks().to_batches()[0]
    if shared:
        batch = prefixes.share(batch)
        assert prefixes.is_shared(batch.schema)
    offsets = block_offsets(batch.num_rows, batch.get_total_buffer_size()).tolist()
    blocks = [prefixes.compact(batch.slice(lo, hi - lo)) for lo, hi in zip(offsets[:-1], offsets[1:])]
    assert len(blocks) >= 3
    assert_encoded_as_serialized(blocks, tmp_path / "blocks")


def test_columns_of_every_layout_are_written_as_their_serialized_bytes(tmp_path):
    """Tables of any kind hold any Arrow type: buffers of every layout (views with variadic
    buffers, run ends, unions, dictionaries, fixed-size lists, maps), whole and sliced."""
    n, rng = 40, np.random.default_rng(0)
    batch = pa.RecordBatch.from_pydict({
        "large_string": pa.array([None if k % 7 == 0 else "x" * int(k) for k in rng.integers(0, 30_000, n)],
                                 pa.large_string()),
        "decimal": pa.array([decimal.Decimal(i) / 8 for i in range(n)], pa.decimal128(20, 5)),
        "timestamp": pa.array(np.arange(n) * 10**6, pa.timestamp("us", tz="UTC")),
        "fixed_size_list": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 2048, dtype=np.float32)), 2048),
        "map": pa.array([[("a", float(i)), ("b", None)] for i in range(n)], pa.map_(pa.string(), pa.float64())),
        "list_view": pa.ListViewArray.from_arrays(pa.array(np.arange(n) * 3, pa.int32()), pa.array([3] * n, pa.int32()),
                                                  pa.array(rng.integers(0, 9, 3 * n), pa.int64())),
        "run_end": pa.RunEndEncodedArray.from_arrays(pa.array([10, 25, n], pa.int32()), pa.array(["a", "b", "c"])),
        "union": pa.UnionArray.from_dense(pa.array([i % 2 for i in range(n)], pa.int8()),
                                          pa.array([i // 2 for i in range(n)], pa.int32()),
                                          [pa.array(range(n)), pa.array([str(i) for i in range(n)])]),
        "binary_view": pa.array([b"y" * int(k) for k in rng.integers(0, 20_000, n)], pa.binary_view()),
        "dictionary": pa.array(["p", "q"] * (n // 2)).dictionary_encode(),
        "null": pa.nulls(n),
        "half_float": pa.array(rng.random(n).astype(np.float16), pa.float16()),
    })
    assert_encoded_as_serialized([batch], tmp_path / "whole")
    assert_encoded_as_serialized([batch.slice(0, 7), batch.slice(7, 13), batch.slice(20, 20)], tmp_path / "sliced")


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_blocks_are_checksummed_group_by_group_as_they_are_written(tmp_path, rows):
    """Blocks of 36 KiB rows, ``rows`` to a block: many to a group of blocks written
    together, a few, and blocks larger than a group (1.5 MB), with a short last group."""
    batch = trajectories(125, tokens=4096).combine_chunks().to_batches()[0]
    assert_encoded_as_serialized([batch.slice(i, rows) for i in range(0, 125, rows)], tmp_path / "blocks")


def test_no_batches_are_no_blocks(tmp_path):
    blocks = codec.encode_blocks([])
    assert (list(blocks.sizes), list(blocks.checksums), written(blocks, tmp_path / "none")) == ([], [], b"")


def test_every_byte_is_written_whatever_each_write_takes(tmp_path):
    """Into a pipe of 4 KiB that does not block, drained as it fills: most writes take
    part of what they are given, some none (EAGAIN, waited out)."""
    batch = trajectories(8, tokens=4096).combine_chunks().to_batches()[0]
    parts = [batch.slice(i, 2) for i in range(0, 8, 2)]
    want = b"".join(codec.encode_block(p).to_pybytes() for p in parts)
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(write_end, False)
    got = bytearray()

    def drain():
        while chunk := os.read(read_end, 3000):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        codec.encode_blocks(parts).write_to(write_end)
    finally:
        os.close(write_end)
        reader.join(timeout=60)
        os.close(read_end)
    assert bytes(got) == want


CUT_SHORT = textwrap.dedent("""
    import os, resource, signal, sys
    from expstore import codec
    from expstore.synthetic import trajectories
    batch = trajectories(8, tokens=4096).combine_chunks().to_batches()[0]
    parts = [batch.slice(i, 2) for i in range(0, 8, 2)]
    want = b"".join(codec.encode_block(p).to_pybytes() for p in parts)
    limit = len(want) // 2 + 5  # inside a block, inside a piece
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        codec.encode_blocks(parts).write_to(fd)
        print("written")
    except OSError as e:
        print(e.errno, open(sys.argv[1], "rb").read() == want[:limit])
""")


def test_a_write_the_system_refuses_fails_with_its_error_after_the_bytes_it_took(tmp_path):
    """A file size limit makes the kernel write part of what it was given, then refuse
    (EFBIG): the writer goes on from where the short write stopped and raises the error."""
    out = subprocess.run([sys.executable, "-c", CUT_SHORT, str(tmp_path / "cut")], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.split() == [str(errno.EFBIG), "True"], out.stderr
