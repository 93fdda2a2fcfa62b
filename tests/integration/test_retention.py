"""Retention classes over the wire: the four window keys round-trip through CreateTable
and Describe, and a total window without an archive is INVALID_ARGUMENT."""

from __future__ import annotations

import grpc

from ._util import rpc_error


def test_the_retention_windows_round_trip(client, table_name):
    info = client.create_table(table_name, hot_retention_s=60.0, hot_retention_bytes=1 << 20)
    try:
        config = client.describe(table_name).config
        assert config == info.config
        assert (config["hot_retention_s"], config["hot_retention_bytes"]) == (60.0, 1 << 20)
        assert "retention_s" not in config and "retention_bytes" not in config
    finally:
        client.drop_table(table_name)
    e = rpc_error(lambda: client.create_table(table_name, retention_s=3600.0), grpc.StatusCode.INVALID_ARGUMENT)
    assert "retention_s and retention_bytes bound the archive: they need archive = true" in e.details()
