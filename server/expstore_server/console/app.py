"""The console's Starlette application: pages, a JSON API, auth and security headers.

Pages are fixed HTML shells (no data in them) whose scripts fetch ``/api/...`` and build
the DOM with text nodes only. The API takes the user's bearer token from the
``Authorization: Bearer`` header or, for browsers, from the ``expstore_token`` cookie
that ``POST /api/login`` sets (HttpOnly, SameSite=Strict, Secure under TLS), and makes
every gRPC call with it: a refused call is the store's own status and message (the
CLI's wording), as HTTP 401 / 403 / 404 / 400 / 503 / 504.

State-changing requests (login, logout, running an audit) and SQL are POSTs that must
carry the header ``X-Expstore-Console: 1``, which no cross-site form can send. When the
console listens on a loopback address, requests must name a loopback host (``Host``),
so a web page cannot reach it through DNS rebinding.
"""

from __future__ import annotations

import csv
import io
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import grpc
import pyarrow as pa
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .. import cli
from . import audits, hacking, trajectory
from .store import Gateway, Session
from .tokenizers import Tokenizers
from .values import cell_text

COOKIE = "expstore_token"
CSRF_HEADER = "x-expstore-console"
MAX_BODY = 1 << 20
PAGE_ROWS = 100
STATIC = Path(__file__).resolve().parent / "static"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'")
HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
           (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]
HTTP_STATUS = {grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
               grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.INVALID_ARGUMENT: 400,
               grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.FAILED_PRECONDITION: 409,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}
# (path, title, script, plots): the pages
PAGES = [("/", "Tables", "tables", True), ("/sql", "SQL", "sql", False), ("/items", "Trajectories", "items", False),
         ("/item", "Trajectory", "item", True), ("/group", "GRPO group", "group", False),
         ("/manifest", "Manifests", "manifest", False), ("/audits", "Reward audits", "audits", False),
         ("/audit", "Audit report", "audit", True), ("/hacking", "Reward hacking", "hacking", True)]


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Console:
    """What the routes share."""

    gateway: Gateway
    tokenizers: Tokenizers
    runner: audits.Runner
    loopback_only: bool = True
    secure_cookie: bool = False


def create_app(console: Console) -> Starlette:
    routes = [Route(path, _page(title, script, plots)) for path, title, script, plots in PAGES]
    routes += [
        Route("/static/plotly.min.js", _plotly),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/api/login", _login(console), methods=["POST"]),
        Route("/api/logout", _logout, methods=["POST"]),
        Route("/api/tables", _api(console, lambda s, q, b: {"tables": s.tables()})),
        Route("/api/query", _api(console, _query), methods=["POST"]),
        Route("/api/result", _api(console, _result)),
        Route("/api/download", _download(console)),
        Route("/api/items", _api(console, lambda s, q, b: trajectory.recent(
            s, _arg(q, "table"), q.get("where") or None, _int(q, "limit", 50)))),
        Route("/api/item", _api(console, lambda s, q, b: trajectory.item_view(
            s, console.tokenizers, _arg(q, "table"), _int(q, "id")))),
        Route("/api/group", _api(console, lambda s, q, b: trajectory.group_view(
            s, console.tokenizers, _arg(q, "table"), _arg(q, "group_id")))),
        Route("/api/manifest", _api(console, lambda s, q, b: trajectory.manifest_view(
            s, _arg(q, "table"), _int(q, "step")))),
        Route("/api/audits", _api(console, lambda s, q, b: {**audits.listing(s), "rewards": console.runner.rewards})),
        Route("/api/audit", _api(console, lambda s, q, b: audits.report(
            s, _arg(q, "results_table"), _arg(q, "audit_id")))),
        Route("/api/audit/run", _api(console, lambda s, q, b: console.runner.run(
            s, _field(b, "table"), _field(b, "reward"), where=b.get("where") or None,
            limit=_opt_int(b.get("limit"), "limit"), out=b.get("out") or "audits")), methods=["POST"]),
        Route("/api/hacking", _api(console, lambda s, q, b: s.cached(
            ("hacking", _arg(q, "table"), _int(q, "versions", hacking.DEFAULT_VERSIONS)),
            lambda: hacking.views(s, _arg(q, "table"), _int(q, "versions", hacking.DEFAULT_VERSIONS))))),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(_Guard, loopback_only=console.loopback_only)
    return app


# -- pages ----------------------------------------------------------------------------

def _shell(title: str, script: str, plots: bool) -> str:
    scripts = (['<script src="/static/plotly.min.js" defer></script>'] if plots else []) + [
        '<script src="/static/console.js" defer></script>', f'<script src="/static/{script}.js" defer></script>']
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>expstore · {title}</title><link rel=\"icon\" href=\"data:,\">"
            "<link rel=\"stylesheet\" href=\"/static/console.css\">" + "".join(scripts) +
            f"</head><body data-page=\"{script}\"><header id=\"nav\"></header><div id=\"banner\"></div>"
            "<main id=\"main\"></main></body></html>\n")


def _page(title: str, script: str, plots: bool) -> Callable:
    html = _shell(title, script, plots)  # constant: no request data in it

    async def page(request: Request) -> Response:
        return HTMLResponse(html, headers={"cache-control": "no-store"})
    return page


async def _plotly(request: Request) -> Response:
    """plotly.js from the installed ``plotly`` package: the console needs no CDN."""
    try:
        path = resources.files("plotly") / "package_data" / "plotly.min.js"
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        return Response("// plotly is not installed: pip install 'expstore[console]'\n", 404,
                        media_type="text/javascript")
    return FileResponse(str(path), media_type="text/javascript", headers={"cache-control": "max-age=86400"})


# -- the API --------------------------------------------------------------------------

def _token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.startswith("Bearer "):
        return header[len("Bearer "):] or None
    return request.cookies.get(COOKIE) or None


async def _body(request: Request) -> dict:
    if request.headers.get(CSRF_HEADER) != "1":
        raise HttpError(403, f"a POST to the console must carry the header '{CSRF_HEADER}: 1'")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY:
            raise HttpError(413, f"request body over {MAX_BODY} bytes")
    if not data:
        return {}
    try:
        import json

        body = json.loads(data)
    except ValueError as e:
        raise HttpError(400, f"request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


def _error(console: Console, e: BaseException) -> JSONResponse:
    if isinstance(e, HttpError):
        status, message, code = e.status, str(e), None
    elif isinstance(e, grpc.RpcError):
        code = e.code()
        status, message, code = HTTP_STATUS.get(code, 502), cli.error_message(e, console.gateway.server), code.name
    elif isinstance(e, audits.AuditBusy):
        status, message, code = 409, str(e), None
    elif isinstance(e, LookupError):
        status, message, code = 404, str(e), None
    elif isinstance(e, cli.CliError) and "no item with id" in str(e):
        status, message, code = 404, str(e), None
    elif isinstance(e, (ValueError, cli.CliError)):
        status, message, code = 400, " ".join(str(e).split()), None
    else:
        raise e
    return JSONResponse({"error": message, "code": code}, status, headers={"cache-control": "no-store"})


def _api(console: Console, work: Callable[[Session, dict, dict], Any]) -> Callable:
    async def endpoint(request: Request) -> Response:
        try:
            body = await _body(request) if request.method == "POST" else {}
            session = console.gateway.session(_token(request))
            result = await run_in_threadpool(work, session, dict(request.query_params), body)
        except Exception as e:
            return _error(console, e)
        if isinstance(result, Response):
            return result
        return JSONResponse(result, headers={"cache-control": "no-store"})
    return endpoint


def _login(console: Console) -> Callable:
    async def login(request: Request) -> Response:
        try:
            body = await _body(request)
            token = body.get("token")
            if not isinstance(token, str) or not token.strip():
                raise HttpError(400, "give a bearer token")
            token = token.strip()
            session = console.gateway.session(token)
            tables = await run_in_threadpool(lambda: [t.name for t in session.client.list_tables()])
        except Exception as e:
            return _error(console, e)
        response = JSONResponse({"ok": True, "tables": tables})
        response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=console.secure_cookie, path="/")
        return response
    return login


async def _logout(request: Request) -> Response:
    if request.headers.get(CSRF_HEADER) != "1":
        return JSONResponse({"error": f"a POST to the console must carry the header '{CSRF_HEADER}: 1'"}, 403)
    response = JSONResponse({"ok": True})
    response.delete_cookie(COOKIE, path="/")
    return response


def _page_of(result, page: int, size: int) -> dict:
    t = result.table
    size = max(1, min(size, 1000))
    pages = max(1, -(-t.num_rows // size))
    page = max(0, min(page, pages - 1))
    rows = t.slice(page * size, size).to_pylist()
    return {"result_id": result.id, "columns": [{"name": f.name, "type": str(f.type)} for f in t.schema],
            "rows": [[cell_text(v) for v in r.values()] for r in rows], "page": page, "pages": pages,
            "page_rows": size, "total_rows": t.num_rows, "truncated": result.truncated}


def _query(session: Session, query: dict, body: dict) -> dict:
    sql = _field(body, "sql")
    return _page_of(session.run_query(sql), 0, _opt_int(body.get("page_rows"), "page_rows") or PAGE_ROWS)


def _result(session: Session, query: dict, body: dict) -> dict:
    result = session.result(_arg(query, "id"))
    if result is None:
        raise LookupError("that result is no longer kept: run the statement again")
    return _page_of(result, _int(query, "page", 0), _int(query, "page_rows", PAGE_ROWS))


def _download(console: Console) -> Callable:
    """GET /api/download?sql=...&format=csv|parquet: every row of the statement (the
    Query RPC's limits; not the grid's GRID_ROWS)."""
    async def download(request: Request) -> Response:
        q = dict(request.query_params)
        try:
            sql, fmt = _arg(q, "sql"), q.get("format", "csv")
            if fmt not in ("csv", "parquet"):
                raise HttpError(400, f"format must be csv or parquet, got {fmt!r}")
            session = console.gateway.session(_token(request))
            reader = await run_in_threadpool(session.stream, sql)  # bad SQL fails here, before any byte
            if fmt == "parquet":
                spool = await run_in_threadpool(_parquet, reader)
        except Exception as e:
            return _error(console, e)
        headers = {"content-disposition": f'attachment; filename="query.{fmt}"', "cache-control": "no-store"}
        if fmt == "csv":
            return StreamingResponse(_csv(reader), media_type="text/csv; charset=utf-8", headers=headers)
        return StreamingResponse(_chunks(spool), media_type="application/vnd.apache.parquet", headers=headers)
    return download


def _csv(reader: pa.RecordBatchReader):
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(reader.schema.names)
    for batch in reader:
        for row in batch.to_pylist():
            w.writerow([cli.csv_cell(v) for v in row.values()])
        yield buf.getvalue().encode()
        buf.seek(0)
        buf.truncate()
    yield buf.getvalue().encode()


def _parquet(reader: pa.RecordBatchReader):
    import pyarrow.parquet as pq

    spool = tempfile.SpooledTemporaryFile(max_size=64 << 20)
    with pq.ParquetWriter(spool, reader.schema) as w:
        for batch in reader:
            w.write_batch(batch)
    spool.seek(0)
    return spool


def _chunks(f, size: int = 1 << 20):
    try:
        while chunk := f.read(size):
            yield chunk
    finally:
        f.close()


# -- arguments ------------------------------------------------------------------------

def _arg(q: dict, name: str) -> str:
    v = q.get(name)
    if not v:
        raise HttpError(400, f"missing parameter {name!r}")
    return v


def _field(body: dict, name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v.strip():
        raise HttpError(400, f"missing {name!r}")
    return v


def _int(q: dict, name: str, default: int | None = None) -> int:
    v = q.get(name)
    if v in (None, ""):
        if default is None:
            raise HttpError(400, f"missing parameter {name!r}")
        return default
    try:
        return int(v)
    except ValueError:
        raise HttpError(400, f"parameter {name!r} must be an integer, got {v[:40]!r}") from None


def _opt_int(v: Any, name: str) -> int | None:
    if v in (None, ""):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise HttpError(400, f"{name!r} must be an integer")
    return _int({name: str(v)}, name)


# -- middleware -----------------------------------------------------------------------

class _Guard:
    """Security headers on every response; on a loopback console, a loopback Host only."""

    def __init__(self, app, loopback_only: bool) -> None:
        self.app, self.loopback_only = app, loopback_only

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.loopback_only and _host(scope) not in LOOPBACK:
            response = Response("this console answers on its loopback address only\n", 421,
                                media_type="text/plain", headers={"content-security-policy": CSP})
            return await response(scope, receive, send)

        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + HEADERS
            await send(message)
        await self.app(scope, receive, with_headers)


def _host(scope) -> str:
    host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host
