"""Your own environment and reward, named on a command line by import path.

``--env`` is a built-in name (``envs.ENVS``: reverse, calculator) or ``module:Class``;
``--reward`` a reward of ``expstore_rl.rewards`` by name or ``module:function``. The
module is imported as Python finds it: on ``PYTHONPATH``, installed, or in the current
directory (added to the path here, as ``expstore audit --reward`` does), so a producer
started by the launcher, which inherits both, finds it too.

An environment class is called with no arguments for each episode (``env_factory()``)
and must have the ``envs.base.Env`` attributes; a reward is ``fn(sample) ->
RewardResult`` (rewards.py). What does not fit is refused before anything starts, with
an error naming the flag and the spec.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

ENV_ATTRS = ("name", "tools", "sample_task", "reset", "step")


def load(spec: str, flag: str) -> Any:
    """The object ``module:attr`` names (``attr`` may be dotted); ValueError naming
    ``flag`` when it cannot be imported or found."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{flag} {spec!r}: expected module:attribute")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{flag} {spec!r}: cannot import {module!r}: {e}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{flag} {spec!r}: {module!r} has no attribute {attr!r}") from None
    return obj


def env_factory(spec: str) -> Callable[[], Any]:
    """The environment class of ``--env``: a built-in name or ``module:Class``."""
    from .envs import ENVS

    if spec in ENVS:
        return ENVS[spec]
    if ":" not in spec:
        raise ValueError(f"--env {spec!r}: not a built-in environment ({', '.join(sorted(ENVS))}) "
                         "nor module:Class")
    cls = load(spec, "--env")
    missing = [a for a in ENV_ATTRS if not hasattr(cls, a)]
    if not callable(cls) or missing:
        raise ValueError(f"--env {spec!r}: not an environment class (missing {', '.join(missing) or 'a constructor'}; "
                         "see envs/base.py)")
    return cls


def reward(spec: str) -> Callable:
    """The reward of ``--reward``: a name in ``expstore_rl.rewards`` or ``module:function``."""
    from . import rewards

    if ":" not in spec:
        fn = getattr(rewards, spec, None)
        if fn is None or not callable(fn) or spec.startswith("_"):
            raise ValueError(f"--reward {spec!r}: not a reward of expstore_rl.rewards (or module:function)")
        return fn
    fn = load(spec, "--reward")
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: not callable (a reward is fn(sample) -> RewardResult)")
    return fn
