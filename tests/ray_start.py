"""A local Ray for one test or module, on a loaded machine, beside other suites.

Ray waits a fixed 30 s for its GCS port and for its raylet to register
(``ray/_private/node.py``); two test suites side by side on 2 cores have run past both.
The GCS wait is an environment setting; the raylet's is not, so a start that timed out is
shut down and made again. Each Ray also gets a temp dir of its own instead of the shared
``/tmp/ray``: two suites side by side started their Rays there within seconds of each
other, and one GCS never wrote its port file (nor its logs).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

ATTEMPTS = 3
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


@contextmanager
def local_ray(**init_args):
    """``ray.init(**init_args)`` in a fresh temp dir; shut down and the dir removed after."""
    import ray

    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                ray.init(_temp_dir=temp_dir, **init_args)
                break
            except Exception as e:  # noqa: BLE001 - Ray raises bare Exceptions and RuntimeErrors for these
                if not any(m in str(e) for m in STARTUP_TIMEOUTS) or attempt == ATTEMPTS:
                    raise
                ray.shutdown()
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
