"""A real S3-compatible server on loopback for the remote tier tests: moto's server mode.

Moto keeps its buckets in process-global state, so two servers in one process see the same
buckets; each test makes its own bucket, named from a process-wide counter. ``stop`` also closes the listening socket, so a
client of a stopped server gets "connection refused" at once instead of hanging in the
accept backlog (what ``ThreadedMotoServer.stop`` alone leaves behind).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import boto3
from moto.server import ThreadedMotoServer

KEY = "testing"
SECRET = "testing"
REGION = "us-east-1"


_NAMES = itertools.count()  # moto's buckets outlive each server: names are never reused


@dataclass
class S3Server:
    server: ThreadedMotoServer
    endpoint: str

    @property
    def lance_options(self) -> dict[str, str]:
        """Lance (object_store) storage options; few retries, so a dead server fails fast."""
        return {"aws_endpoint": self.endpoint, "aws_access_key_id": KEY, "aws_secret_access_key": SECRET,
                "aws_region": REGION, "allow_http": "true",
                "client_max_retries": "1", "client_retry_timeout": "2", "connect_timeout": "2s"}

    @property
    def fsspec_options(self) -> dict:
        """s3fs keyword arguments."""
        return {"key": KEY, "secret": SECRET,
                "client_kwargs": {"endpoint_url": self.endpoint, "region_name": REGION},
                "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}}}

    @property
    def config(self) -> dict:
        """The keywords of ``expstore.tiers.remote.lance_storage_options``/``fsspec_filesystem``."""
        return {"endpoint": self.endpoint, "region": REGION, "key": KEY, "secret": SECRET}

    def bucket(self, prefix: str = "b") -> str:
        """Create a fresh bucket (no location constraint: moto refuses us-east-1's)."""
        name = f"{prefix}-{next(_NAMES)}"
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                     region_name=REGION).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.server.stop()
        self.server._server.server_close()


def start(port: int = 0) -> S3Server:
    """A server on ``port`` (0: a free one); restarting on a stopped server's port brings its
    buckets back, since moto's state outlives the server."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3Server(server, f"http://{host}:{port}")
