"""``expstore console``: the web console's HTTP server.

Binds its socket itself (so ``--http-port 0`` picks a free port and the URL printed is
the real one), prints ``expstore console on URL`` as its first line on stdout, then
serves with uvicorn until SIGTERM or SIGINT. HTTPS with ``--tls-cert``/``--tls-key``.
"""

from __future__ import annotations

import json
import logging
import socket
import sys

from .. import cli
from .audits import DEFAULT_REWARDS
from .tokenizers import DEFAULT_MODULES

BANNER = "expstore console on "


def add_arguments(p) -> None:
    """The ``console`` command's flags (docs/cli.md)."""
    p.add_argument("--http-host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8080, help="port to serve on; 0 picks a free one (default 8080)")
    p.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate chain (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--reward", action="append", metavar="MODULE:FUNC",
                   help=f"a reward function audits may run (repeatable; default: {', '.join(DEFAULT_REWARDS)})")
    p.add_argument("--tokenizer-module", action="append", metavar="MODULE",
                   help="a module whose tokenizers table metadata may name (repeatable; default: "
                        f"{', '.join(DEFAULT_MODULES)})")
    p.add_argument("--audit-workers", type=int, help="processes per audit (default: CPUs, at most 8)")


def socket_for(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise cli.CliError(f"console: cannot bind {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url(host: str, port: int, tls: bool) -> str:
    return f"{'https' if tls else 'http'}://{'[' + host + ']' if ':' in host else host}:{port}"


def run(args) -> int:
    import uvicorn

    from .app import Console, create_app
    from .child import exit_with_parent
    from .audits import Runner
    from .store import Gateway
    from .tokenizers import Tokenizers

    exit_with_parent()
    if (args.tls_cert is None) != (args.tls_key is None):
        raise cli.CliError("console: --tls-cert and --tls-key go together")
    gateway = Gateway(args.server, tls_ca=args.tls_ca, timeout=args.timeout)
    rewards = tuple(args.reward) if args.reward else _importable(DEFAULT_REWARDS)
    console = Console(gateway, Tokenizers(tuple(args.tokenizer_module or DEFAULT_MODULES)),
                      Runner(rewards, args.audit_workers),
                      loopback_only=args.http_host in ("127.0.0.1", "localhost", "::1"),
                      secure_cookie=args.tls_cert is not None)
    sock = socket_for(args.http_host, args.http_port)
    port = sock.getsockname()[1]
    _json_logs()
    config = uvicorn.Config(create_app(console), log_config=None, log_level="warning", access_log=False,
                            ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key, timeout_graceful_shutdown=5,
                            lifespan="off")
    print(BANNER + url(args.http_host, port, args.tls_cert is not None), flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        gateway.close()
    return 0


def _importable(specs: tuple[str, ...]) -> tuple[str, ...]:
    import importlib.util

    return tuple(s for s in specs if importlib.util.find_spec(s.partition(":")[0].partition(".")[0]) is not None)


def _json_logs() -> None:
    """uvicorn's warnings and errors as JSON lines on stderr, like the server's logs."""
    class Json(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            entry = {"ts": round(record.created, 6), "level": record.levelname.lower(), "logger": record.name,
                     "msg": record.getMessage()}
            if record.exc_info:
                entry["exc"] = self.formatException(record.exc_info)
            return json.dumps(entry, default=str)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Json())
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
        logger.setLevel(logging.WARNING)
