"""The web console: a browser view of a running store (docs/console.md).

A client of the store, never part of it: its own process (``expstore console --server
HOST:PORT --http-port 8080``, or started by ``expstore-server --http-port N`` as a child
against itself on loopback) that talks gRPC to the server like the CLI does, with the
browser user's bearer token, so it has exactly the roles and limits of the RPCs and can
never slow the server's own threads but through the RPCs it makes.

Modules, one job each:

- ``store``: the gRPC side: one CLI ``Online`` backend per token, the stats history
  behind the live rates, cached query results for the paged grid.
- ``tokenizers``: the decoder a table's ``metadata.tokenizer`` names (allow-listed).
- ``trajectory``: one item turn by turn, its GRPO group, a manifest's items.
- ``hacking``: reward-hacking views per policy version, each one SQL statement.
- ``audits``: audit results tables, their reports (``expstore.audit``), running one.
- ``app``: the Starlette application: pages, JSON API, auth cookie, security headers.
- ``serve``: ``expstore console``: the HTTP server (uvicorn) on a bound socket.
- ``child``: ``expstore-server --http-port``: the console as the server's child process.

Everything the pages show from the store is untrusted text: the API returns it as JSON
and the pages put it in the DOM as text nodes only (``static/console.js``), under a
Content-Security-Policy that allows no inline script.

Concurrency model: uvicorn's event loop runs the routes; each route's gRPC calls and
Arrow work run in Starlette's thread pool (plain ``def`` handlers). A session (one per
token) guards its caches with its own lock; calls to the store are not serialised.
"""
