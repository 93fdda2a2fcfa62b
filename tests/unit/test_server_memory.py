"""The server's allocator settings: glibc's malloc arenas are capped (``malloc_arenas``),
since each arena keeps the memory freed in it (docs/config.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from expstore.errors import InvalidArgument
from expstore_server.config import ServerConfig

CHILD = textwrap.dedent("""
    import ctypes, sys, threading
    from expstore_server.main import limit_malloc_arenas
    if sys.argv[1] != "default":
        assert limit_malloc_arenas(int(sys.argv[1]))
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_stats()  # one "Arena N:" section per arena, on stderr
    print("THREADS", file=sys.stderr, flush=True)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def work():
        for _ in range(200):
            libc.free(libc.malloc(200_000))
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc.malloc_stats()
""")


def arenas_before_and_after_six_threads(limit: str) -> tuple[int, int]:
    """How many arenas the process has before and after six threads malloc at once (the
    imports started threads of their own, with arenas, before any cap)."""
    out = subprocess.run([sys.executable, "-c", CHILD, limit], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, after = out.stderr.split("THREADS")
    count = lambda text: sum(line.startswith("Arena ") for line in text.splitlines())  # noqa: E731
    return count(before), count(after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_threads_share_the_capped_arenas():
    before, after = arenas_before_and_after_six_threads("default")
    assert after > before  # glibc gives new threads arenas of their own
    for cap in (1, 2):
        before, after = arenas_before_and_after_six_threads(str(cap))
        assert after == max(before, cap), (cap, before, after)


def test_malloc_arenas_is_checked():
    with pytest.raises(InvalidArgument, match="malloc_arenas must be >= 0"):
        ServerConfig(malloc_arenas=-1)
    assert ServerConfig().malloc_arenas == 2


def test_idle_trim_waits_for_a_quiet_heap_after_a_busy_one():
    """A trim comes at the first tick at which malloc's figures moved by less than
    QUIET_BYTES, once they moved by QUIET_BYTES or more since the last trim; never while
    calls allocate, never twice for the same rest."""
    from expstore_server.main import IdleTrim

    mib = 1 << 20
    states = iter([(0, 0), (50 * mib, 5 * mib), (100 * mib, 9 * mib), (100 * mib, 9 * mib + 4096),
                   (100 * mib, 9 * mib + 4096),  # read again right after the trim
                   (100 * mib + 8192, 9 * mib), (100 * mib, 9 * mib), (100 * mib + 300_000, 9 * mib - 300_000),
                   (100 * mib + 600_000, 9 * mib - 600_000),  # a trickle adds up to QUIET_BYTES: trimmed
                   (100 * mib + 600_000, 9 * mib - 600_000)])
    trims = []
    trimmer = IdleTrim(state=lambda: next(states), trim=lambda: trims.append(1))
    ticks = [trimmer.tick() for _ in range(8)]
    assert ticks == [False, False, False, True, False, False, False, True]
    assert len(trims) == 2


def test_idle_trim_off_glibc_does_nothing():
    from expstore_server.main import IdleTrim

    trimmer = IdleTrim(state=lambda: None, trim=lambda: pytest.fail("trimmed without malloc figures"))
    assert not any(trimmer.tick() for _ in range(3))


TRIM_CHILD = textwrap.dedent("""
    import ctypes
    from expstore_server.main import IdleTrim, keep_freed_memory
    assert keep_freed_memory()  # glibc keeps freed memory mapped: only a trim returns it
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    trimmer = IdleTrim()
    trimmer.tick()
    blocks = [libc.malloc(1 << 20) for _ in range(64)]  # from the heap (below the 32 MiB mmap threshold)
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    pin = libc.malloc(4096)  # above them all: the heap's top cannot shrink
    for b in blocks:
        libc.free(b)
    before = rss()
    assert not trimmer.tick()  # the figures just moved by 64 MiB: still busy
    assert trimmer.tick()
    print(before - rss())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_idle_trim_returns_freed_memory_to_the_os():
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 60 << 20  # of the 64 MiB freed


def test_malloc_trim_idle_s_is_checked():
    with pytest.raises(InvalidArgument, match="malloc_trim_idle_s must be >= 0"):
        ServerConfig(malloc_trim_idle_s=-1)
    assert ServerConfig().malloc_trim_idle_s == 0.5
