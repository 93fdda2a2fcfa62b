"""Sampling strategies (samplers) and eviction strategies (removers) for tables.

Every strategy implements :class:`~expstore.samplers.base.Selector` over slots; a
remover is a selector in a second role: the table calls ``remover.sample(k, rng)`` for k
distinct victims, then ``remove`` on both. One strategy per file:

=================  =======================  ==========================================
name               class                    sample(n)
=================  =======================  ==========================================
uniform            ``Uniform``              with replacement, P = 1/N
prioritized        ``Prioritized``          with replacement, P ~ p**alpha (sum tree)
fifo / lifo        ``Fifo`` / ``Lifo``      n distinct, oldest / newest first
max_heap/min_heap  ``MaxHeap``/``MinHeap``  n distinct, highest / lowest priority first
group              ``GroupSampler``         n / group_size distinct complete groups
task_weights       ``TaskMixture``          a multinomial split across tasks,
task_quotas                                 with exact min/max counts per task
=================  =======================  ==========================================

Removers: "fifo" (oldest), "lifo" (newest), "min_priority" (lowest priority).
"""

from __future__ import annotations

from ..errors import InvalidArgument
from ..spec import REMOVER_TYPES, SamplerSpec
from .base import Codebook, Items, Selection, Selector
from .group import GroupSampler
from .heap import MaxHeap, MinHeap
from .mixture import TaskMixture
from .ordered import Fifo, Lifo
from .prioritized import Prioritized
from .sumtree import SumTree
from .uniform import Uniform

__all__ = [
    "Codebook", "Fifo", "GroupSampler", "Items", "Lifo", "MaxHeap", "MinHeap", "Prioritized",
    "Selection", "Selector", "SumTree", "TaskMixture", "Uniform", "make_remover", "make_sampler",
]


def _single(spec: SamplerSpec) -> Selector:
    if spec.type == "uniform":
        return Uniform()
    if spec.type == "prioritized":
        return Prioritized(alpha=spec.alpha, beta=spec.beta)
    if spec.type == "fifo":
        return Fifo()
    if spec.type == "lifo":
        return Lifo()
    if spec.type == "max_heap":
        return MaxHeap()
    if spec.type == "min_heap":
        return MinHeap()
    if spec.type == "group":
        return GroupSampler(spec.group_size, spec.drop_zero_variance, spec.group_order)
    raise InvalidArgument(f"unknown sampler type {spec.type!r}")


def make_sampler(spec: SamplerSpec, tasks: Codebook) -> Selector:
    """The sampler a table's ``SamplerSpec`` describes; a ``TaskMixture`` of one such
    sampler per task (and data version) when ``spec.task_weights`` or ``spec.task_quotas``
    is set (weights default to 1 for every task; ``tasks`` is the table's task codebook,
    used to name task codes)."""
    if not spec.mixed:
        return _single(spec)
    unit = spec.group_size if spec.type == "group" else 1
    return TaskMixture(spec.task_weights or {"*": 1.0}, tasks, lambda: _single(spec), unit=unit,
                       quotas=spec.task_quotas)


def make_remover(name: str) -> Selector:
    """The remover named in ``TableSpec.remover``: "fifo" (oldest first), "lifo" (newest
    first), "min_priority" (lowest priority first, ties: least recently inserted or
    updated)."""
    if name == "fifo":
        return Fifo()
    if name == "lifo":
        return Lifo()
    if name == "min_priority":
        return MinHeap()
    raise InvalidArgument(f"remover must be one of {list(REMOVER_TYPES)}, got {name!r}")
