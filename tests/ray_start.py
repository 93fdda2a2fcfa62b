"""Starting a local Ray in a test on a loaded machine.

Ray waits a fixed 30 s for its GCS port and for its raylet to register
(``ray/_private/node.py``); two test suites side by side on 2 cores have run past both.
The GCS wait is an environment setting; the raylet's is not, so a start that timed out is
shut down and made again.
"""

from __future__ import annotations

import os

ATTEMPTS = 3


def start_ray(**init_args):
    import ray

    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return ray.init(**init_args)
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == ATTEMPTS:
                raise
            ray.shutdown()
