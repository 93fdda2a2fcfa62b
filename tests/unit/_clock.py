"""An injected wall clock for the engine's time-driven rules (leases, windows, timeouts)."""

T0 = 1_000_000.0


class Wall:
    """A wall clock (seconds) that moves only when a test sets ``now``."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
