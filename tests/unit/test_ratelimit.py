"""Rate limiter: Reverb's arithmetic, the min-size bypass, batch feasibility, presets.

No threads and no sleeps: the limiter is arithmetic, so every test drives counters by hand.
Parameters in the property tests sit on a binary grid (samples_per_insert = k/8) so float
arithmetic is exact and a failure is a logic error, not rounding.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from expstore.errors import InvalidArgument
from expstore.ratelimit import BIG, UNBOUNDED, RateLimiter
from expstore.spec import RateLimiterSpec

R = RateLimiter


def run(rl: RateLimiter, steps) -> None:
    """Apply ("i" | "s" | "d", n) steps: the commits, without checks."""
    for op, n in steps:
        {"i": rl.insert, "s": rl.sample, "d": rl.delete}[op](n)


def expect(rl: RateLimiter, ins: dict[int, bool], smp: dict[int, bool]) -> None:
    assert {n: rl.can_insert(n) for n in ins} == ins, rl
    assert {n: rl.can_sample(n) for n in smp} == smp, rl


# --- exact semantics -----------------------------------------------------------------------

def test_semantics_table_sample_to_insert_ratio():
    # spi 2, min size 3, error buffer 4: offset 6, window [2, 10]
    rl = R.sample_to_insert_ratio(2, 3, 4)
    assert (rl.min_diff, rl.max_diff) == (2.0, 10.0)
    table = [  # (steps, size, diff, can_insert, can_sample)
        ([], 0, 0, {1: True, 3: True, 4: True, 5: True, 6: False}, {1: False}),
        ([("i", 3)], 3, 6, {1: True, 2: True, 3: False}, {1: True, 4: True, 5: False}),
        ([("i", 2)], 5, 10, {1: False}, {8: True, 9: False}),
        ([("s", 5)], 5, 5, {2: True, 3: False}, {3: True, 4: False}),
        # deletes lower size, not diff: below min size sampling stops, the bypass reopens
        ([("d", 3)], 2, 5, {1: True, 2: True, 3: False}, {1: False}),
        ([("i", 1)], 3, 7, {1: True, 2: False}, {5: True, 6: False}),
    ]
    for steps, size, diff, ins, smp in table:
        run(rl, steps)
        assert (rl.size, rl.diff) == (size, diff)
        expect(rl, ins, smp)


def test_semantics_table_min_size():
    rl = R.min_size(3)
    expect(rl, {1: True, 10**9: True}, {1: False})
    run(rl, [("i", 2)])
    expect(rl, {1: True}, {1: False})
    run(rl, [("i", 1)])
    expect(rl, {10**9: True}, {1: True, 10**9: True})
    run(rl, [("s", 10**6)])  # samples never block once at min size
    expect(rl, {1: True}, {10**9: True})
    run(rl, [("d", 1)])  # below min size again
    expect(rl, {1: True}, {1: False})


@pytest.mark.parametrize("make", [R.queue, R.stack])
def test_semantics_table_queue(make):
    rl = make(2)  # a sample also deletes (max_times_sampled=1)
    expect(rl, {1: True, 2: True, 3: False}, {1: False})
    run(rl, [("i", 2)])
    expect(rl, {1: False}, {1: True, 2: True, 3: False})
    run(rl, [("s", 1), ("d", 1)])
    expect(rl, {1: True, 2: False}, {1: True, 2: False})
    run(rl, [("s", 1), ("d", 1)])
    expect(rl, {1: True, 2: True}, {1: False})


def test_min_size_bypass_ignores_the_diff():
    rl = R.custom(1, 5, -10, 0)  # max_diff 0: only the bypass can ever insert
    expect(rl, {5: True, 6: False}, {1: False})
    run(rl, [("i", 5)])
    assert rl.diff == 5 > rl.max_diff
    expect(rl, {1: False}, {1: True, 15: True, 16: False})
    run(rl, [("d", 2)])  # deletes reopen the bypass: 2 more fit, whatever the diff
    expect(rl, {2: True, 3: False}, {1: False})


def test_deletes_below_min_size_let_the_diff_pass_max_diff():
    # spi 2 with max_times_sampled=1: every sample deletes, the bypass refills (as in Reverb)
    rl = R.sample_to_insert_ratio(2, 3, 4)
    run(rl, [("i", 3)])
    for _ in range(10):
        assert rl.can_sample(1)
        run(rl, [("s", 1), ("d", 1)])
        assert rl.can_insert(1)
        rl.insert(1)
    assert rl.diff == 16 > rl.max_diff


def test_error_buffer_window():
    rl = R.sample_to_insert_ratio(1, 10, 3)  # window [7, 13]
    run(rl, [("i", 10)])
    admitted = 0
    while rl.can_insert(1):
        rl.insert(1)
        admitted += 1
    assert (admitted, rl.diff) == (3, 13)
    admitted = 0
    while rl.can_sample(1):
        rl.sample(1)
        admitted += 1
    assert (admitted, rl.diff) == (6, 7)
    pair = R.sample_to_insert_ratio(1, 10, (5, 12))  # a pair is used as is
    assert (pair.min_diff, pair.max_diff) == (5.0, 12.0)


def test_fractional_samples_per_insert():
    rl = R.sample_to_insert_ratio(0.5, 4, 1)  # offset 2, window [1, 3]
    run(rl, [("i", 4)])
    expect(rl, {1: True, 2: True, 3: False}, {1: True, 2: False})
    run(rl, [("i", 2), ("s", 2)])
    assert rl.diff == 1.0
    expect(rl, {4: True, 5: False}, {1: False})


# --- batch feasibility ---------------------------------------------------------------------

def test_insert_batch_feasibility():
    rl = R.sample_to_insert_ratio(1, 100, 10)  # window [90, 110]
    assert rl.max_insert_batch() == 110  # fresh: diff 0 + 110 <= 110
    rl.check_insert_batch(110)
    run(rl, [("i", 100)])
    assert rl.max_insert_batch() == 20
    rl.check_insert_batch(20)
    assert not rl.can_insert(20)
    run(rl, [("s", 10)])  # the right operations: sample down to min_diff
    assert rl.can_insert(20) and not rl.can_insert(21)
    with pytest.raises(InvalidArgument, match=r"insert of 21 items can never pass.*"
                       r"split it into batches of at most 20 items or widen error_buffer"):
        rl.check_insert_batch(21)


def test_sample_batch_feasibility():
    rl = R.sample_to_insert_ratio(1, 100, 10)
    run(rl, [("i", 100)])
    rl.check_sample_batch(20)
    assert not rl.can_sample(20)
    run(rl, [("i", 10)])  # insert up to max_diff
    assert rl.can_sample(20) and not rl.can_sample(21)
    with pytest.raises(InvalidArgument, match=r"sample of 21 items can never pass.*>= min_diff "
                       r"\(90\); split it into batches of at most 20 items or widen error_buffer"):
        rl.check_sample_batch(21)


def test_sample_batch_counts_the_bypass():
    rl = R.custom(1, 50, 0, 10)  # the bypass fills to diff 50, far past max_diff
    assert rl.max_sample_batch() == 50
    rl.check_sample_batch(50)
    run(rl, [("i", 50)])
    assert rl.can_sample(50)
    run(rl, [("s", 50)])
    assert rl.max_sample_batch() == 10  # from now on only max_diff counts
    with pytest.raises(InvalidArgument, match=r"at most 10 items or widen \[min_diff, max_diff\]"):
        rl.check_sample_batch(11)


def test_batch_checks_for_queue_and_min_size():
    q = R.queue(8)
    q.check_insert_batch(8)
    q.check_sample_batch(8)
    with pytest.raises(InvalidArgument, match=r"queue rate limiter.*at most 8 items or raise size"):
        q.check_insert_batch(9)
    with pytest.raises(InvalidArgument, match=r"at most 8 items or raise size"):
        R.stack(8).check_sample_batch(9)
    m = R.min_size(10)
    assert m.max_insert_batch() == m.max_sample_batch() == UNBOUNDED
    m.check_insert_batch(10**12)
    m.check_sample_batch(10**12)


def test_no_batch_fits_a_window_narrower_than_one_insert():
    rl = R.custom(4, 1, 0, 3)
    run(rl, [("i", 1), ("s", 4)])
    assert rl.max_insert_batch() == 0
    with pytest.raises(InvalidArgument, match=r"never pass.*; widen \[min_diff, max_diff\]$"):
        rl.check_insert_batch(1)


def test_batch_limit_agrees_with_can_insert_under_float_rounding():
    rl = R.custom(0.1, 1, 0, 1.7)  # 1.7 / 0.1 == 17.0, but 17 * 0.1 > 1.7 in floats
    assert rl.max_insert_batch() == 16
    assert rl.can_insert(16) and not rl.can_insert(17)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, "2"])
def test_batch_size_must_be_a_positive_integer(bad):
    rl = R.queue(4)
    with pytest.raises(InvalidArgument, match="insert batch size must be an integer >= 1"):
        rl.check_insert_batch(bad)
    with pytest.raises(InvalidArgument, match="sample batch size must be an integer >= 1"):
        rl.check_sample_batch(bad)


def test_each_batch_passing_alone_can_still_stall_a_pair():
    # documented danger: width 20 < n_i*spi + n_s = 40
    rl = R.sample_to_insert_ratio(1, 100, 10)
    while rl.can_insert(20):
        rl.insert(20)
    assert rl.diff == 100
    rl.check_insert_batch(20)
    rl.check_sample_batch(20)
    assert not rl.can_insert(20) and not rl.can_sample(20)


def test_batch_producer_can_stick_below_min_size():
    # documented danger: max_diff 10 < spi * (min_size + n_i - 1) = 12
    rl = R.sample_to_insert_ratio(1, 10, (-10, 10))
    while rl.can_insert(3):
        rl.insert(3)
    assert rl.size == 9 and not rl.can_sample(1)
    rl.check_insert_batch(3)  # not "never": an insert of 1 unblocks it
    rl.insert(1)
    rl.sample(10)
    assert rl.can_insert(3)


# --- exactness of the batch checks against brute force ----------------------------------------

def reachable(rl: RateLimiter) -> set[tuple[int, Fraction]]:
    """Every (min(size, min_size), diff) reachable from rl's state by inserts and samples
    (no deletes). Unit steps suffice: a batch's intermediate states are admitted too."""
    spi, m = Fraction(rl.samples_per_insert), rl.min_size_to_sample
    lo, hi = Fraction(rl.min_diff), Fraction(rl.max_diff)
    start = (min(rl.size, m), rl.inserts * spi - rl.samples)
    seen, todo = {start}, [start]
    while todo:
        s, d = todo.pop()
        nxt = []
        if s + 1 <= m or d + spi <= hi:
            nxt.append((min(s + 1, m), d + spi))
        if s >= m and d - 1 >= lo:
            nxt.append((s, d - 1))
        for x in nxt:
            if x not in seen:
                seen.add(x)
                todo.append(x)
        assert len(seen) < 50_000
    return seen


def feasible(rl: RateLimiter, states, op: str, n: int) -> bool:
    spi, m = Fraction(rl.samples_per_insert), rl.min_size_to_sample
    if op == "i":
        return any(s + n <= m or d + n * spi <= Fraction(rl.max_diff) for s, d in states)
    return any(s >= m and d - n >= Fraction(rl.min_diff) for s, d in states)


@st.composite
def grid_limiter(draw, presets_only: bool = True):
    """A limiter whose numbers lie on the diff's lattice (multiples of 1/q, spi = p/q)."""
    kind = draw(st.sampled_from(["ratio", "ratio_pair", "queue", "stack"]
                                + ([] if presets_only else ["custom"])))
    if kind in ("queue", "stack"):
        return getattr(R, kind)(draw(st.integers(1, 12)))
    spi = Fraction(draw(st.integers(1, 24)), 8)
    q, m = spi.denominator, draw(st.integers(1, 6))
    if kind == "custom":
        a, b = sorted(draw(st.lists(st.integers(-40, 40), min_size=2, max_size=2)))
        return R.custom(float(spi), m, a / q, b / q)
    offset = spi * m
    if kind == "ratio":
        eb = draw(st.integers(0, 20)) / q
        assume(2 * eb >= 2 * max(1, spi))
        return R.sample_to_insert_ratio(float(spi), m, eb)
    a, b = draw(st.integers(0, 20)), draw(st.integers(0, 20))
    assume(Fraction(a + b, q) >= 2 * max(1, spi))
    return R.sample_to_insert_ratio(float(spi), m, (float(offset - Fraction(a, q)),
                                                    float(offset + Fraction(b, q))))


def legal_walk(rl: RateLimiter, ops) -> None:
    for op, n in ops:
        if op == "i" and rl.can_insert(n):
            rl.insert(n)
        elif op == "s" and rl.can_sample(n):
            rl.sample(n)
        elif op == "d" and n <= rl.size:
            rl.delete(n)


walks = st.lists(st.tuples(st.sampled_from("iisd"), st.integers(1, 6)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(grid_limiter(presets_only=False), walks, st.data())
def test_batch_checks_are_sound_and_exact_on_the_lattice(rl, ops, data):
    legal_walk(rl, ops)
    states = reachable(rl)
    exact = rl.kind != "custom"  # presets' windows are wide enough to reach every bound
    for op, limit, check in (("i", rl.max_insert_batch(), rl.check_insert_batch),
                             ("s", rl.max_sample_batch(), rl.check_sample_batch)):
        for n in {1, max(1, limit), limit + 1, data.draw(st.integers(1, limit + 5))}:
            ok = feasible(rl, states, op, n)
            if n > limit:
                assert not ok, (op, n, rl)  # sound: never refuses a batch that could fit
                with pytest.raises(InvalidArgument, match="never pass"):
                    check(n)
            else:
                assert ok or not exact, (op, n, rl)
                check(n)


# --- presets never deadlock; refusals ------------------------------------------------------

@st.composite
def any_preset(draw):
    """Loose arguments for every preset; the ones a preset refuses are skipped."""
    grid = st.integers(-8, 200).map(lambda k: k / 8)
    kind = draw(st.sampled_from(["min_size", "ratio", "ratio_pair", "queue", "stack"]))
    try:
        if kind == "min_size":
            return R.min_size(draw(st.integers(0, 10)))
        if kind in ("queue", "stack"):
            return getattr(R, kind)(draw(st.integers(0, 10)))
        spi, m = draw(st.integers(0, 32)) / 8, draw(st.integers(0, 10))
        eb = draw(grid) if kind == "ratio" else (spi * m - draw(grid), spi * m + draw(grid))
        return R.sample_to_insert_ratio(spi, m, eb)
    except InvalidArgument:
        assume(False)


def stuck(rl: RateLimiter) -> bool:
    return not rl.can_insert(1) and not rl.can_sample(1)


@settings(max_examples=300, deadline=None)
@given(any_preset(), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_accepted_presets_have_no_stuck_state_at_all(rl, inserts, samples, deletes):
    # proof: both blocked means size >= min size and max_diff - spi < diff < min_diff + 1,
    # impossible once max_diff - min_diff >= 1 + spi; presets demand 2*max(1, spi)
    rl.restore({"inserts": inserts + deletes, "samples": samples, "deletes": deletes})
    assert not stuck(rl), rl


@settings(max_examples=300, deadline=None)
@given(any_preset(), st.lists(st.booleans(), max_size=300), st.booleans())
def test_alternating_producer_consumer_never_sticks_and_diff_stays_in_window(rl, prefs, first):
    lo, hi, m = rl.min_diff, rl.max_diff, rl.min_size_to_sample
    for prefer_insert in [first] * 50 + prefs:  # also "insert when you can, else sample"
        assert not stuck(rl), rl
        if rl.can_insert(1) and (prefer_insert or not rl.can_sample(1)):
            rl.insert(1)
        else:
            rl.sample(1)
        # derived bounds: a fresh limiter never goes below 0 before sampling starts, samples
        # stop at min_diff, inserts past min size stop at max_diff, and min_diff <= spi*m
        assert min(0.0, lo) <= rl.diff <= hi, rl
        assert rl.size < m or lo <= rl.diff, rl


@settings(max_examples=200, deadline=None)
@given(any_preset(), st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=300))
def test_alternating_with_deletes_never_sticks(rl, plan):
    for prefer_insert, deletes in plan:
        assert not stuck(rl), rl
        if rl.can_insert(1) and (prefer_insert or not rl.can_sample(1)):
            rl.insert(1)
        else:
            rl.sample(1)
            assert rl.diff >= rl.min_diff
            rl.delete(min(deletes, rl.size))  # remover / max_times_sampled


@settings(max_examples=200, deadline=None)
@given(grid_limiter(), st.integers(1, 4), st.integers(1, 4), st.lists(st.booleans(), max_size=200))
def test_batch_pair_never_sticks_when_the_window_fits_both(rl, n_i, n_s, prefs):
    spi, m = rl.samples_per_insert, rl.min_size_to_sample
    assume(rl.max_diff - rl.min_diff >= n_i * spi + n_s)  # the documented conditions
    assume(rl.max_diff >= spi * (m + n_i - 1))
    for prefer_insert in [True] * 20 + prefs:
        ins, smp = rl.can_insert(n_i), rl.can_sample(n_s)
        assert ins or smp, (n_i, n_s, rl)
        rl.insert(n_i) if ins and (prefer_insert or not smp) else rl.sample(n_s)


def test_refused_window_can_stick():
    # width 1.7 < 1 + spi = 2.5: after one insert and one sample nothing is admitted
    rl = R.custom(1.5, 1, 0, 1.7)
    rl.insert(1)
    assert not rl.can_insert(1)
    rl.sample(1)
    assert stuck(rl)
    with pytest.raises(InvalidArgument, match="error_buffer too small"):
        R.sample_to_insert_ratio(1.5, 1, (0, 1.7))


def test_width_guard_is_conservative_above_spi_1():
    # Reverb's 2*max(1, spi) refuses width 5 at spi 3, though width >= 1 + spi never sticks
    with pytest.raises(InvalidArgument, match=r"= 5 < 2\*max\(1, samples_per_insert\) = 6"):
        R.sample_to_insert_ratio(3, 2, (4, 9))
    rl = R.custom(3, 2, 4, 9)
    for i in range(60):
        for s in range(60):
            rl.restore({"inserts": i, "samples": s, "deletes": 0})
            assert not stuck(rl)


@pytest.mark.parametrize("call, message", [
    (lambda: R.min_size(0), r"min_size_to_sample must be an integer >= 1, got 0"),
    (lambda: R.min_size(2.5), r"min_size_to_sample must be an integer >= 1, got 2.5"),
    (lambda: R.min_size(True), r"min_size_to_sample must be an integer >= 1"),
    (lambda: R.sample_to_insert_ratio(0, 10, 5), r"samples_per_insert must be a finite number > 0"),
    (lambda: R.sample_to_insert_ratio(-1, 10, 5), r"samples_per_insert must be a finite number"),
    (lambda: R.sample_to_insert_ratio(math.inf, 10, 5), r"samples_per_insert must be a finite"),
    (lambda: R.sample_to_insert_ratio(math.nan, 10, 5), r"samples_per_insert must be a number"),
    (lambda: R.sample_to_insert_ratio(1, 0, 5), r"min_size_to_sample must be an integer >= 1"),
    (lambda: R.sample_to_insert_ratio(1, 10, 0.5),
     r"error_buffer too small: max_diff - min_diff = 1 < 2\*max\(1, samples_per_insert\) = 2.*"
     r"use error_buffer >= 1"),
    (lambda: R.sample_to_insert_ratio(3, 10, 2.9), r"= 6.*use error_buffer >= 3"),
    (lambda: R.sample_to_insert_ratio(1, 10, -5), r"error_buffer too small"),
    (lambda: R.sample_to_insert_ratio(1, 10, (11, 20)),
     r"min_diff \(11\) > samples_per_insert \* min_size_to_sample \(10\).*lower min_diff to <= 10"),
    (lambda: R.sample_to_insert_ratio(1, 10, (0, 9)),
     r"max_diff \(9\) < samples_per_insert \* min_size_to_sample \(10\).*deadlocks; "
     r"raise max_diff to >= 10"),
    (lambda: R.sample_to_insert_ratio(1, 10, (20, 0)), r"error_buffer too small"),
    (lambda: R.sample_to_insert_ratio(1, 10, math.inf), r"error_buffer must be finite.*min_size"),
    (lambda: R.sample_to_insert_ratio(1, 10, math.nan), r"error_buffer must be a number"),
    (lambda: R.sample_to_insert_ratio(1, 10, (1, 2, 3)), r"or a \[min_diff, max_diff\] pair"),
    (lambda: R.sample_to_insert_ratio(1, 10, "5"), r"error_buffer must be a number"),
    (lambda: R.queue(0), r"rate_limiter.size must be an integer >= 1, got 0"),
    (lambda: R.stack(-3), r"rate_limiter.size must be an integer >= 1, got -3"),
    (lambda: R.queue(None), r"rate_limiter.size must be an integer >= 1, got None"),
    (lambda: R.custom(1, 1, 5, 4), r"min_diff \(5\) must be <= max_diff \(4\)"),
    (lambda: R.custom(1, 0, 0, 4), r"min_size_to_sample must be an integer >= 1"),
    (lambda: R.custom(0, 1, 0, 4), r"samples_per_insert must be a finite number > 0"),
    (lambda: R.custom(math.inf, 1, 0, 4), r"samples_per_insert must be a finite number > 0"),
    (lambda: R.custom(1, 1, math.nan, 4), r"min_diff must be a number"),
])
def test_preset_refusals(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()


def test_boundaries_are_accepted():
    R.sample_to_insert_ratio(1, 10, 1)  # width 2 == 2*max(1, 1)
    R.sample_to_insert_ratio(3, 10, 3)
    R.sample_to_insert_ratio(0.25, 4, (1, 3))  # width 2, min_diff == offset
    R.sample_to_insert_ratio(1, 10, (8, 10))  # max_diff == offset
    rl = R.custom(1, 1, -math.inf, math.inf)
    assert (rl.min_diff, rl.max_diff) == (-BIG, BIG)


# --- from_spec -----------------------------------------------------------------------------

@pytest.mark.parametrize("kw, numbers", [
    (dict(type="min_size", min_size_to_sample=7), (1.0, 7, -BIG, BIG)),
    (dict(type="sample_to_insert_ratio", samples_per_insert=4, min_size_to_sample=10,
          error_buffer=8), (4.0, 10, 32.0, 48.0)),
    (dict(type="sample_to_insert_ratio", error_buffer=[0, 5]), (1.0, 1, 0.0, 5.0)),  # TOML array
    (dict(type="queue", size=16), (1.0, 1, 0.0, 16.0)),
    (dict(type="stack", size=3), (1.0, 1, 0.0, 3.0)),
    (dict(type="custom", samples_per_insert=0.5, min_size_to_sample=2, min_diff=-1, max_diff=9),
     (0.5, 2, -1.0, 9.0)),
])
def test_from_spec(kw, numbers):
    rl = R.from_spec(RateLimiterSpec(**kw))
    assert rl.kind == kw["type"]
    assert (rl.samples_per_insert, rl.min_size_to_sample, rl.min_diff, rl.max_diff) == numbers


@pytest.mark.parametrize("kw, message", [
    (dict(type="min_size", size=5), r"'min_size' does not use size=5; it takes min_size_to_sample"),
    (dict(type="min_size", samples_per_insert=2.0), r"does not use samples_per_insert=2.0"),
    (dict(type="queue", size=4, min_size_to_sample=3), r"'queue' does not use min_size_to_sample"),
    (dict(type="stack", size=4, error_buffer=2, max_diff=3), r"error_buffer=2, max_diff=3"),
    (dict(type="sample_to_insert_ratio", error_buffer=3, min_diff=1), r"does not use min_diff=1"),
    (dict(type="custom", min_diff=0, max_diff=4, error_buffer=1), r"does not use error_buffer=1"),
    (dict(type="sample_to_insert_ratio"), r"'sample_to_insert_ratio' needs error_buffer"),
    (dict(type="queue"), r"'queue' needs size"),
    (dict(type="custom", min_diff=0), r"'custom' needs max_diff"),
    (dict(type="sample_to_insert_ratio", error_buffer=0.5), r"error_buffer too small"),
])
def test_from_spec_refusals(kw, message):
    with pytest.raises(InvalidArgument, match=message):
        R.from_spec(RateLimiterSpec(**kw))


# --- state ---------------------------------------------------------------------------------

def test_state_restore_and_repr():
    rl = R.sample_to_insert_ratio(2, 3, 4)
    run(rl, [("i", 5), ("s", 3), ("d", 1)])
    state = rl.state()
    assert state == {"kind": "sample_to_insert_ratio", "samples_per_insert": 2.0,
                     "min_size_to_sample": 3, "min_diff": 2.0, "max_diff": 10.0,
                     "inserts": 5, "samples": 3, "deletes": 1, "diff": 7.0}
    again = R.sample_to_insert_ratio(2, 3, 4)
    again.restore(state)
    assert again.state() == state
    assert repr(again) == ("RateLimiter(sample_to_insert_ratio: samples_per_insert=2, "
                           "min_size_to_sample=3, min_diff=2, max_diff=10; inserts=5, "
                           "samples=3, deletes=1)")


@pytest.mark.parametrize("counters, message", [
    ({"inserts": 1, "samples": 0}, r"counter deletes must be an integer >= 0, got None"),
    ({"inserts": -1, "samples": 0, "deletes": 0}, r"counter inserts must be an integer >= 0"),
    ({"inserts": 1, "samples": 0.5, "deletes": 0}, r"counter samples must be an integer >= 0"),
    ({"inserts": 1, "samples": 0, "deletes": 2}, r"deletes \(2\) > inserts \(1\)"),
])
def test_restore_refuses_bad_counters(counters, message):
    rl = R.queue(3)
    with pytest.raises(InvalidArgument, match=message):
        rl.restore(counters)
    assert (rl.inserts, rl.samples, rl.deletes) == (0, 0, 0)
