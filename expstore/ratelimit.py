"""Reverb's rate limiter: pure arithmetic over four numbers and three counters.

Let ``size = inserts - deletes`` and ``diff = inserts * samples_per_insert - samples``
(reverb/cc/rate_limiter.cc). Every admission is judged on the state *after* the call:

* ``can_sample(n)``: ``size >= min_size_to_sample`` and ``diff - n >= min_diff``.
* ``can_insert(n)``: ``size + n <= min_size_to_sample`` (the min-size bypass: what only
  fills the table up to its minimum always goes in) or ``diff + n*spi <= max_diff``.
* ``insert/sample/delete(n)`` commit without checking. ``delete`` counts every item that
  leaves the sampling window (remover, max_times_sampled, staleness, explicit delete).

Invariants: a committed sample leaves ``diff >= min_diff``; a committed insert leaves
``diff <= max_diff`` unless the bypass admitted it. With the presets' bounds
(``min_diff <= spi*min_size <= max_diff``) and no deletes a fresh limiter keeps ``diff`` in
``[min(0, min_diff), max_diff]``, and in ``[min_diff, max_diff]`` once at min size.

Not thread-safe; no clocks, no threads. The table holds its lock around check and
commit, and owns waiting, deadlines and wait statistics::

    if not rl.can_insert(n):
        rl.check_insert_batch(n)   # InvalidArgument now instead of waiting forever
        ...wait for rl.can_insert(n) or the deadline, re-checking after each wake-up
    rl.insert(n)

Dangerous combinations:

* ``max_diff - min_diff < 1 + spi`` can leave no single insert or sample admitted
  (stuck). Presets demand Reverb's ``2 * max(1, spi)``, which is >= 1 + spi.
* A producer of batches ``n_i`` and a consumer of batches ``n_s`` can stall each other
  when ``max_diff - min_diff < n_i*spi + n_s``, though each batch passes its check alone.
* Below min size the bypass takes only a batch that fits under the minimum: a lone
  producer of batches ``n_i > 1`` can stick below min size (nobody may sample yet) unless
  ``max_diff >= spi * (min_size_to_sample + n_i - 1)``.
* Deletes can reopen the bypass, which admits inserts whatever the diff: with
  ``spi > 1`` and ``max_times_sampled = 1`` the diff climbs past max_diff (as in Reverb).
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import fields
from typing import Any, Callable, Mapping

from .errors import InvalidArgument
from .spec import RateLimiterSpec

BIG = sys.float_info.max  # Reverb's MinSize uses +-max float for "no bound"
UNBOUNDED = 2**62  # what max_*_batch report when nothing but memory bounds a batch
_USES = {  # the RateLimiterSpec fields each preset reads, in its signature's order
    "min_size": ("min_size_to_sample",), "queue": ("size",), "stack": ("size",),
    "sample_to_insert_ratio": ("samples_per_insert", "min_size_to_sample", "error_buffer"),
    "custom": ("samples_per_insert", "min_size_to_sample", "min_diff", "max_diff")}
_REMEDY = {"queue": "raise size", "stack": "raise size",
           "sample_to_insert_ratio": "widen error_buffer"}


class RateLimiter:
    """Admission arithmetic for one table; see the module docstring for the semantics.

    The constructor is the ``custom`` preset: it refuses ``min_size_to_sample < 1``,
    ``samples_per_insert`` not finite and > 0, a NaN bound, and ``min_diff > max_diff``;
    an infinite bound is stored as ``+-BIG``. It does not refuse windows that deadlock.
    """

    __slots__ = ("kind", "samples_per_insert", "min_size_to_sample", "min_diff", "max_diff",
                 "inserts", "samples", "deletes")

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float,
                 max_diff: float, *, kind: str = "custom"):
        self.kind = kind
        self.samples_per_insert = _positive(samples_per_insert)
        self.min_size_to_sample = _count("rate_limiter.min_size_to_sample", min_size_to_sample)
        self.min_diff, self.max_diff = _bound("min_diff", min_diff), _bound("max_diff", max_diff)
        _require(self.min_diff <= self.max_diff, f"rate_limiter: min_diff ({self.min_diff:g}) "
                 f"must be <= max_diff ({self.max_diff:g})")
        self.inserts = self.samples = self.deletes = 0

    @classmethod
    def min_size(cls, min_size_to_sample: int) -> RateLimiter:
        """Block sampling until the table holds ``min_size_to_sample`` items; never blocks
        inserts."""
        return cls(1.0, min_size_to_sample, -BIG, BIG, kind="min_size")

    @classmethod
    def sample_to_insert_ratio(cls, samples_per_insert: float, min_size_to_sample: int,
                               error_buffer: float | tuple[float, float]) -> RateLimiter:
        """Keep ``samples / inserts`` near ``samples_per_insert`` once min size is reached.

        The diff stays within ``spi*min_size +- error_buffer``; a ``(min_diff, max_diff)``
        pair is used as is. Refused: ``max_diff - min_diff < 2*max(1, spi)`` (single calls
        could block each other); ``min_diff > spi*min_size`` (sampling could not start at
        min size, Reverb's "deadlock"); ``max_diff < spi*min_size`` (inserts block the moment
        min size is reached, so one thread that inserts then samples hangs; Reverb warns).
        """
        spi = _positive(samples_per_insert)
        m = _count("rate_limiter.min_size_to_sample", min_size_to_sample)
        offset = spi * m
        if isinstance(error_buffer, (tuple, list)):
            _require(len(error_buffer) == 2, "rate_limiter.error_buffer must be a number or a "
                     f"[min_diff, max_diff] pair, got {error_buffer!r}")
            lo, hi = (_bound(f"error_buffer[{i}]", v) for i, v in enumerate(error_buffer))
        else:
            eb = _number("error_buffer", error_buffer)
            _require(math.isfinite(eb), "rate_limiter.error_buffer must be finite; for no "
                     "upper bound use the min_size rate limiter")
            lo, hi = offset - eb, offset + eb
        need = 2 * max(1.0, spi)
        _require(hi - lo >= need, f"rate_limiter.error_buffer too small: max_diff - min_diff = "
                 f"{hi - lo:g} < 2*max(1, samples_per_insert) = {need:g}, so single inserts and "
                 f"samples could block each other; use error_buffer >= {need / 2:g}")
        _require(lo <= offset, f"rate_limiter: min_diff ({lo:g}) > samples_per_insert * "
                 f"min_size_to_sample ({offset:g}): sampling could not start once min size is "
                 f"reached; lower min_diff to <= {offset:g}")
        _require(hi >= offset, f"rate_limiter: max_diff ({hi:g}) < samples_per_insert * "
                 f"min_size_to_sample ({offset:g}): inserts block as soon as min size is "
                 f"reached and a caller that inserts then samples deadlocks; raise max_diff "
                 f"to >= {offset:g}")
        return cls(spi, m, lo, hi, kind="sample_to_insert_ratio")

    @classmethod
    def queue(cls, size: int, *, kind: str = "queue") -> RateLimiter:
        """At most ``size`` unsampled items; use with fifo sampler and remover and
        max_times_sampled=1. A full queue blocks inserts, an empty one blocks samples."""
        return cls(1.0, 1, 0.0, float(_count("rate_limiter.size", size)), kind=kind)

    @classmethod
    def stack(cls, size: int) -> RateLimiter:
        """The queue's numbers for lifo sampler and remover (max_times_sampled=1)."""
        return cls.queue(size, kind="stack")

    @classmethod
    def custom(cls, samples_per_insert: float, min_size_to_sample: int, min_diff: float,
               max_diff: float) -> RateLimiter:
        """The four numbers as given; see the class docstring for what is refused."""
        return cls(samples_per_insert, min_size_to_sample, min_diff, max_diff)

    @classmethod
    def from_spec(cls, spec: RateLimiterSpec) -> RateLimiter:
        """Dispatch on ``spec.type``; a field the preset does not read must keep its default."""
        uses, defaults = _USES[spec.type], {f.name: f.default for f in fields(RateLimiterSpec)}
        extra = [f"{k}={getattr(spec, k)!r}" for k in defaults
                 if k != "type" and k not in uses and getattr(spec, k) != defaults[k]]
        _require(not extra, f"rate_limiter type {spec.type!r} does not use {', '.join(extra)}; "
                 f"it takes {', '.join(uses)}")
        missing = [k for k in uses if getattr(spec, k) is None]
        _require(not missing, f"rate_limiter type {spec.type!r} needs {', '.join(missing)}")
        return getattr(cls, spec.type)(*(getattr(spec, k) for k in uses))  # in signature order

    @property
    def size(self) -> int:
        return self.inserts - self.deletes

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, n: int = 1) -> bool:
        if self.size + n <= self.min_size_to_sample:
            return True
        return (self.inserts + n) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, n: int = 1) -> bool:
        return self.size >= self.min_size_to_sample and self.diff - n >= self.min_diff

    def insert(self, n: int = 1) -> None:  # the commits: no checks, the table checked
        self.inserts += n

    def sample(self, n: int = 1) -> None:
        self.samples += n

    def delete(self, n: int = 1) -> None:
        self.deletes += n

    def max_insert_batch(self) -> int:
        """The largest insert any future state admits, not forecasting deletes (they only
        reopen the bypass): ``min_size - size`` items via the bypass now, or ``n`` with
        ``lo + n*spi <= max_diff`` where ``lo = min(diff, min_diff)`` is the lowest diff
        samples can bring (they never go below min_diff). Exact when the diff's lattice
        (multiples of 1/q for spi = p/q) holds min_diff; else one step optimistic."""
        lo, spi, hi = min(self.diff, self.min_diff), self.samples_per_insert, self.max_diff
        by_diff = _largest((hi - lo) / spi, lambda k: lo + k * spi <= hi)
        return max(self.min_size_to_sample - self.size, by_diff)

    def max_sample_batch(self) -> int:
        """The largest sample any future state admits: ``n`` with ``top - n >= min_diff``,
        where ``top`` is the highest diff inserts can reach: max_diff, or more through the
        bypass, which fills to min size whatever the diff (``diff + (min_size - size)*spi``),
        or the diff now. Exact when the lattice holds max_diff; else one step optimistic."""
        top, lo = self._top(), self.min_diff
        return _largest(top - lo, lambda k: top - k >= lo)

    def _top(self) -> float:
        bypass = max(0, self.min_size_to_sample - self.size) * self.samples_per_insert
        return max(self.diff + bypass, self.max_diff)

    def check_insert_batch(self, n: int) -> None:
        """InvalidArgument if an insert of ``n`` can never be admitted (max_insert_batch)."""
        n, limit = _count("an insert batch size", n), self.max_insert_batch()
        _require(n <= limit, f"an insert of {n} items can never pass the {self.kind} rate limiter: "
                 f"it raises the diff by {n * self.samples_per_insert:g}, the diff can only fall "
                 f"to {min(self.diff, self.min_diff):g} and must stay <= max_diff "
                 f"({self.max_diff:g}); {self._remedy(limit)}")

    def check_sample_batch(self, n: int) -> None:
        """InvalidArgument if a sample of ``n`` can never be admitted (max_sample_batch)."""
        n, limit = _count("a sample batch size", n), self.max_sample_batch()
        _require(n <= limit, f"a sample of {n} items can never pass the {self.kind} rate limiter: "
                 f"it lowers the diff by {n}, inserts can only raise the diff to "
                 f"{self._top():g} and it must stay >= min_diff ({self.min_diff:g}); "
                 f"{self._remedy(limit)}")

    def _remedy(self, limit: int) -> str:
        widen = _REMEDY.get(self.kind, "widen [min_diff, max_diff]")
        return f"split it into batches of at most {limit} items or {widen}" if limit else widen

    def state(self) -> dict[str, Any]:
        """Counters and parameters (plain numbers) for stats and persistence."""
        return {"kind": self.kind, "samples_per_insert": self.samples_per_insert,
                "min_size_to_sample": self.min_size_to_sample, "min_diff": self.min_diff,
                "max_diff": self.max_diff, "inserts": self.inserts, "samples": self.samples,
                "deletes": self.deletes, "diff": self.diff}

    def restore(self, counters: Mapping[str, Any]) -> None:
        """Set inserts, samples and deletes (e.g. from ``state()``; other keys are ignored:
        the parameters come from the table's current config)."""
        got = {k: _count(f"rate limiter counter {k}", counters.get(k), 0)
               for k in ("inserts", "samples", "deletes")}
        _require(got["deletes"] <= got["inserts"], f"rate limiter counters: deletes "
                 f"({got['deletes']}) > inserts ({got['inserts']})")
        self.inserts, self.samples, self.deletes = got["inserts"], got["samples"], got["deletes"]

    def __repr__(self) -> str:
        return (f"RateLimiter({self.kind}: samples_per_insert={self.samples_per_insert:g}, "
                f"min_size_to_sample={self.min_size_to_sample}, min_diff={self.min_diff:g}, "
                f"max_diff={self.max_diff:g}; inserts={self.inserts}, samples={self.samples}, "
                f"deletes={self.deletes})")


def _largest(guess: float, ok: Callable[[int], bool]) -> int:
    """The largest k >= 0 with ok(k) (ok monotone), starting from a float estimate."""
    if not guess < UNBOUNDED:
        return UNBOUNDED
    k = max(0, math.floor(guess))
    for _ in range(4):  # undo float rounding in the estimate
        k = k - 1 if k > 0 and not ok(k) else k + 1 if ok(k + 1) else k
    return k


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidArgument(message)


def _count(name: str, v: Any, lo: int = 1) -> int:
    ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= lo
    _require(ok, f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _number(name: str, v: Any) -> float:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)
    _require(ok, f"rate_limiter.{name} must be a number, got {v!r}")
    return float(v)


def _positive(v: Any) -> float:
    x = _number("samples_per_insert", v)
    _require(math.isfinite(x) and x > 0, f"rate_limiter.samples_per_insert must be a finite "
             f"number > 0, got {v!r}")
    return x


def _bound(name: str, v: Any) -> float:  # +-inf is stored as +-BIG
    return max(-BIG, min(BIG, _number(name, v)))
