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
