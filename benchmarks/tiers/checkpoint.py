"""7e. Checkpointer.create against an fsspec put of a RocksDB checkpoint (see benchmarks/tiers/__init__.py)."""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import fsspec

from expstore.checkpoint import Checkpointer
from expstore.catalog import Catalog
from expstore.tiers.remote import SealedObjects


# -- 5. checkpoint ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str] | None:
    exe = Path(sys.executable).with_name("moto_server")
    if not exe.exists():
        return None
    port = _free_port()
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    proc.wait()
    return None


def _checkpoint_pair(store: Catalog, tmp: Path, remote: SealedObjects, fs: fsspec.AbstractFileSystem, dest: str,
                     rounds: int, label: str) -> dict:
    exp, ceil, links = [], [], []
    num_bytes = 0
    for r in range(rounds):
        info = Checkpointer(store, remote).create(f"{label}-{r}")
        exp.append(info.seconds)
        num_bytes = info.num_bytes
        src = tmp / f"ckpt-src-{r}"
        t0 = time.perf_counter()
        store.db.checkpoint(src)
        links.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fs.put(str(src), f"{dest}/ceiling-{r}", recursive=True)
        ceil.append(time.perf_counter() - t0)
        shutil.rmtree(src, ignore_errors=True)
    gb = num_bytes / 1e9
    e, c = statistics.median(exp), statistics.median(ceil)
    return {"num_bytes": num_bytes, "expstore_s": e, "ceiling_s": c,
            "expstore_s_per_GB": e / gb, "ceiling_s_per_GB": c / gb, "rocksdb_checkpoint_s": statistics.median(links),
            "expstore_rounds_s": exp, "ceiling_rounds_s": ceil}


def bench_checkpoint(tmp: Path, data_dir: Path, quick: bool) -> dict:
    rounds = 2 if quick else 3
    out: dict = {"rounds": rounds}
    store = Catalog(data_dir)
    try:
        local_root = tmp / "ckpt-remote"
        out["file"] = _checkpoint_pair(store, tmp, SealedObjects(f"file://{local_root}"), fsspec.filesystem("file"),
                                       str(tmp / "ckpt-ceiling"), rounds, "file")
        shutil.rmtree(local_root, ignore_errors=True)
        shutil.rmtree(tmp / "ckpt-ceiling", ignore_errors=True)
        moto = _start_moto()
        if moto is None:
            out["s3"] = {"skipped": "moto_server did not start"}
        else:
            proc, endpoint = moto
            try:
                import boto3
                import s3fs
                kw = dict(aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1")
                boto3.client("s3", endpoint_url=endpoint, **kw).create_bucket(Bucket="bench")
                fs = s3fs.S3FileSystem(key="testing", secret="testing",
                                       client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
                out["s3"] = _checkpoint_pair(store, tmp, SealedObjects("s3://bench/expstore", fs=fs), fs,
                                             "bench/ceiling", 1, "s3")
                out["s3"]["endpoint"] = endpoint
            finally:
                proc.kill()
                proc.wait()
    finally:
        store.close()
    return out


