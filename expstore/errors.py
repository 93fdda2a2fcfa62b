"""One error hierarchy for the whole engine.

Each class names the gRPC status code it maps to (``code``); the server maps errors to
statuses in exactly one place (``expstore_server.errors``), so the engine never imports gRPC.
Messages say what to fix and name the table, row and column at fault where there is one.
"""

from __future__ import annotations


class ExpstoreError(Exception):
    """Base class; ``code`` is the name of a ``grpc.StatusCode`` member."""

    code = "INTERNAL"


class InvalidArgument(ExpstoreError, ValueError):
    """The request is malformed: schema, validation, impossible parameters."""

    code = "INVALID_ARGUMENT"


class NotFound(ExpstoreError, KeyError):
    """A table, item or consumer group does not exist."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(ExpstoreError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(ExpstoreError):
    """The request is well-formed but the table's state or config forbids it."""

    code = "FAILED_PRECONDITION"


class ResourceExhausted(ExpstoreError):
    """A byte or item budget is full."""

    code = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(ExpstoreError, TimeoutError):
    """A blocking call (rate limiter, empty stream) ran out of time.

    ``retry_after`` is a hint, in seconds, of when waiting again could succeed even
    without any other change to the table (a visibility timeout expiring); None if only
    a change to the table can help.
    """

    code = "DEADLINE_EXCEEDED"

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(ExpstoreError):
    """The table is closing, the server is draining, or a tier cannot be reached."""

    code = "UNAVAILABLE"


class DataLoss(ExpstoreError):
    """Stored bytes failed their checksum: reported, never handed to a caller as data.

    ``damage`` says what a read found damaged, for quarantine: chunk id -> the row ranges
    ``[lo, hi)`` of the chunk that are unreadable, or None when the whole chunk is."""

    code = "DATA_LOSS"

    def __init__(self, message: str, damage: dict[int, list[tuple[int, int]] | None] | None = None):
        super().__init__(message)
        self.damage = damage or {}


class Unauthenticated(ExpstoreError):
    code = "UNAUTHENTICATED"


class PermissionDenied(ExpstoreError):
    code = "PERMISSION_DENIED"
