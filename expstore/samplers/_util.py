"""Small helpers shared by the selectors: growable per-slot arrays and argument checks."""

from __future__ import annotations

import operator

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument
from .base import Selection

EMPTY_SLOTS = np.empty(0, dtype=np.int64)


def grown(arr: np.ndarray, size: int, fill) -> np.ndarray:
    """``arr`` if it already holds ``size`` entries, else a copy at least twice as long
    (amortised O(1) per entry) with the new tail set to ``fill``."""
    if size <= len(arr):
        return arr
    out = np.full(max(size, 2 * len(arr), 16), fill, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


def count(n) -> int:
    """``n`` as a Python int; InvalidArgument if it is not a non-negative integer."""
    try:
        n = operator.index(n)
    except TypeError:
        raise InvalidArgument(f"sample size must be an integer, got {n!r}") from None
    if n < 0:
        raise InvalidArgument(f"sample size must be >= 0, got {n}")
    return n


def unique(a: np.ndarray) -> np.ndarray:
    """Sorted distinct values of an int array: a sort and an adjacent compare, O(k log k).
    (``np.unique`` is an order of magnitude slower on large int arrays in numpy 2.x.)"""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if len(a) else a


def as_slots(slots) -> np.ndarray:
    return np.asarray(slots, dtype=np.int64).reshape(-1)


def deterministic(slots: np.ndarray) -> Selection:
    """A selection from a sampler that is not probabilistic: probabilities and weights 1."""
    ones = np.ones(len(slots), dtype=np.float64)
    return Selection(slots=slots, probabilities=ones, weights=ones.copy())


def cannot(what: str, n: int, have: int) -> FailedPrecondition:
    return FailedPrecondition(f"{what} cannot sample {n}: it holds {have} eligible")
