"""Sampling with replacement under ``max_times_sampled``: a table's cap on how often an
item may be returned, applied to a selector that draws i.i.d. (``with_replacement``)."""

from __future__ import annotations

import numpy as np

from .base import Selector


def sample_capped(sampler: Selector, times_sampled: np.ndarray, cap: int, n: int, rng: np.random.Generator,
                  **kw) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sample n with replacement while no item exceeds ``cap`` samples, as Reverb's
    one-at-a-time sampling would: draws beyond an item's allowance are rejected, items
    that reach it leave the sampler, and the rejected draws are redrawn. Each round
    accepts at least one draw. ``times_sampled`` (by slot) is counted up in place.
    Returns (slots, probabilities, weights, exhausted)."""
    ts = times_sampled
    parts, exhausted, left = [], [], n
    while left:
        sel = sampler.sample(left, rng, **kw)
        keep = occurrence_rank(sel.slots) < cap - ts[sel.slots]
        taken = sel.slots[keep]
        np.add.at(ts, taken, 1)
        parts.append((taken, sel.probabilities[keep], sel.weights[keep]))
        left -= len(taken)
        done = np.unique(taken[ts[taken] >= cap])
        sampler.remove(done)
        exhausted.append(done)
    slots, probabilities, weights = (np.concatenate(x) for x in zip(*parts))
    return slots, probabilities, weights, np.concatenate(exhausted)


def occurrence_rank(values: np.ndarray) -> np.ndarray:
    """For each entry, how many equal entries come before it: [5, 3, 5, 5] -> [0, 0, 1, 2]."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.ones(len(values), dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    first = np.maximum.accumulate(np.where(starts, np.arange(len(values)), 0))
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = np.arange(len(values)) - first
    return rank
