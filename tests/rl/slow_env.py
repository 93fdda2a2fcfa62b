"""An environment for producer subprocesses that must be caught mid-work (``--env
slow_env:SlowReverse`` with this directory on the path): ReverseDigits whose reset takes
half a second."""

from __future__ import annotations

import time

from expstore_rl.envs import ReverseDigits


class SlowReverse(ReverseDigits):
    def reset(self, task: dict) -> str:
        time.sleep(0.5)
        return super().reset(task)
