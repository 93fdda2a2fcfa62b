"""Faults of the remote tier: with S3 unreachable, inserts go on into the SSD tier, the
mover retries with backoff and reports why, and once S3 is back every chunk moves down
and nothing was lost."""

from __future__ import annotations

import time

import numpy as np
import pytest
import s3server

from expstore.errors import Unavailable
from expstore.spec import TableSpec
from expstore.store import Store
from expstore.synthetic import trajectories
from expstore.tiers.remote import RemoteTier

pytestmark = pytest.mark.timeout(120)


def wait_until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_s3_down_inserts_go_on_uploads_retry_and_nothing_is_lost(tmp_path):
    s3 = s3server.start()
    uri = f"s3://{s3.bucket('faults')}/p"
    options = {**s3.lance_options, "client_max_retries": "0", "client_retry_timeout": "1"}
    store = Store(tmp_path / "d", remote=lambda name: RemoteTier(uri, name, storage_options=options))
    t = store.create_table(TableSpec("t", tiers="remote", memory_bytes=1 << 20, ssd_bytes=256 << 10))
    store.start_mover(interval_s=0.05, max_backoff_s=0.2)
    inserted = []
    try:
        for i in range(4):
            inserted += t.insert(trajectories(32, tokens=1024, id_prefix=f"up{i}")).item_ids.tolist()
        wait_until(lambda: t.stats()["items_remote"] > 0)
        s3.stop()
        for i in range(4):  # S3 is down: inserts still succeed, into the SSD tier
            inserted += t.insert(trajectories(32, tokens=1024, id_prefix=f"down{i}")).item_ids.tolist()
        wait_until(lambda: store.remote_error is not None and t.stats()["demotion_failures"] > 0)
        assert "remote tier" in store.remote_error
        assert t.stats()["ssd_bytes"] > 256 << 10  # over the watermark, waiting
        with pytest.raises(Unavailable):  # reading what only S3 has fails clearly ...
            t.get(inserted[:1])
        t.get(inserted[-32:])  # ... what the SSD has is served
        s3 = s3server.start(int(s3.endpoint.rsplit(":", 1)[1]))
        wait_until(lambda: store.remote_error is None and t.stats()["ssd_bytes"] <= 512 << 10)
        rows = t.get(inserted)
        assert rows.data.num_rows == len(inserted) == 256
        assert np.array_equal(rows.item_ids, inserted)
        expected = [f"{p}{i}-{j}" for p in ("up", "down") for i in range(4) for j in range(32)]
        assert rows.data.column("traj_id").to_pylist() == expected
    finally:
        store.close()
        s3.stop()
