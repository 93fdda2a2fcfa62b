"""The CLI's errors: each is one line on stderr, ``expstore: ...``, and exit code 2."""

from __future__ import annotations

import importlib


class CliError(Exception):
    """An error to report as one line, exit code 2."""


def error_message(e: BaseException, server: str) -> str:
    """One line for an error, as the CLI prints it (and the console shows it)."""
    import grpc

    if isinstance(e, grpc.RpcError):
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in (e.details() or "").lower():
            return f"cannot reach the server at {server}: {e.details()}"
        return f"{code.name}: {e.details()}"
    text = " ".join(str(e).split()) or type(e).__name__
    return text


def import_module(name: str, flag: str):
    """The module a flag names (``--tools``), or a CliError naming the flag."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise CliError(f"{flag} {name}: cannot import it: {e}") from None


def load_callable(spec: str, flag: str):
    """The ``MODULE:CALLABLE`` a flag names (``--tokenizer``), or a CliError naming the flag."""
    module, _, attr = spec.partition(":")
    fn = getattr(import_module(module, flag), attr, None) if attr else None
    if not callable(fn):
        raise CliError(f"{flag} {spec}: expected MODULE:CALLABLE")
    return fn
