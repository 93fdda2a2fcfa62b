"""The selector protocol shared by samplers and removers.

A selector picks *slots*: dense integer handles the table assigns to live items (a slot is
reused after its item leaves). Selectors see slots, item ids, priorities and the few
per-item labels in :class:`Items`, never payloads. They are not thread-safe: the table
holds its lock around every call. Every method takes whole numpy arrays, so a batch of
256 is a handful of numpy calls, not 256 Python calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Items:
    """Per-item facts a selector may use, one entry per item, all the same length.

    slots:      int64, the table's handle for each item.
    ids:        uint64, item ids; monotonic in insertion order within a table.
    priorities: float64, >= 0.
    groups:     int64, a dense code for ``group_id`` (-1: no group).
    group_sizes: int64, members the item's group will have (0: unknown).
    tasks:      int64, a dense code for ``task`` (-1: none).
    rewards:    float64, trajectory reward (NaN: not set).
    data_versions: int64, the row's ``data_version`` (None: all 0); the task mixture
                keeps one child per task and data version.
    """

    slots: np.ndarray
    ids: np.ndarray
    priorities: np.ndarray
    groups: np.ndarray
    group_sizes: np.ndarray
    tasks: np.ndarray
    rewards: np.ndarray
    data_versions: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def take(self, idx: np.ndarray) -> "Items":
        """The items at positions ``idx``."""
        return Items(**{f: (None if v is None else np.asarray(v)[idx]) for f, v in vars(self).items()})


@dataclass(frozen=True)
class Selection:
    """What ``sample`` returns: the chosen slots, their sampling probability and the
    importance weights that correct for it (all ones for samplers that are not
    probabilistic). Slots may repeat for samplers that sample with replacement."""

    slots: np.ndarray
    probabilities: np.ndarray
    weights: np.ndarray


class Selector(Protocol):
    #: Whether ``sample`` draws i.i.d. with replacement (slots may repeat; their order
    #: means nothing, so the table may return rows in storage order).
    with_replacement: bool = False
    #: Batches are multiples of this many items (the group sampler: whole groups).
    unit: int = 1
    #: Members per group when the selector samples whole groups (each row's group_size
    #: must agree); None otherwise.
    group_size: int | None = None

    def insert(self, items: Items) -> None:
        """Add items. Slots are not in the selector already."""

    def remove(self, slots: np.ndarray) -> None:
        """Forget items. Every slot is in the selector."""

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Change priorities of items in the selector."""

    def __len__(self) -> int:
        """Items the selector holds."""

    def can_sample(self, n: int) -> bool:
        """Whether ``sample(n)`` would succeed now."""

    def sample(self, n: int, rng: np.random.Generator) -> Selection:
        """Choose n slots. Raises ``expstore.errors.FailedPrecondition`` if it cannot."""

    def rejected(self) -> np.ndarray:
        """Slots (int64) the selector asks the table to remove; cleared when read.

        A selector may refuse items it holds but will never choose (the group sampler's
        members beyond ``group_size`` and its zero-variance groups). They stay held, and
        counted in ``len``, until the table removes them through ``remove`` as usual.
        The table reads this after every ``insert``. This default, inherited by
        selectors that subclass ``Selector``, never rejects anything.
        """
        return np.empty(0, dtype=np.int64)

    def stats(self) -> dict[str, float]:
        """Selector-specific gauges for the table's stats (``sampler.<key>``)."""
        return {}

    def explain(self, n: int) -> str:
        """Why ``sample(n)`` cannot be served now, when the selector can say more than
        its size ("" otherwise); the table puts it in its wait message."""
        return ""


class Codebook:
    """Dense integer codes for strings (tasks, group ids), shared by a table and its
    selectors so that per-item labels travel as int64 arrays."""

    def __init__(self) -> None:
        self._codes: dict[str, int] = {}
        self._names: list[str] = []

    def encode(self, values: pa.Array | pa.ChunkedArray) -> np.ndarray:
        """int64 codes for a string array (null -> -1), assigning codes to new strings.

        Python touches each distinct value once, never each row.
        """
        if values.null_count == len(values):  # no labels (e.g. no tasks): ~1 us, not ~20
            return np.full(len(values), -1, np.int64)
        if isinstance(values, pa.ChunkedArray):  # one chunk as a rule: taken, not copied
            values = values.chunk(0) if values.num_chunks == 1 else values.combine_chunks()
        encoded = pc.dictionary_encode(values)
        names = encoded.dictionary.to_pylist()
        lookup = np.empty(len(names) + 1, np.int64)
        lookup[:-1] = list(map(self.code, names))
        lookup[-1] = -1  # index -1 (a null row) maps to code -1
        indices = encoded.indices
        if indices.null_count:
            indices = indices.fill_null(-1)
        return lookup[indices.to_numpy()]

    def find(self, value: str) -> int:
        """The code of a string, or -1 if it has none (assigns nothing: safe to call
        without the table's lock, a dict read)."""
        return self._codes.get(value, -1)

    def code(self, value: str) -> int:
        """The code of a string, assigning the next one if it has none."""
        code = self._codes.get(value)
        if code is None:
            code = self._codes[value] = len(self._names)
            self._names.append(value)
        return code

    def name(self, code: int) -> str:
        return self._names[code]

    @property
    def names(self) -> list[str]:
        """Every string with a code, in code order (a copy)."""
        return list(self._names)

    def __len__(self) -> int:
        return len(self._names)
