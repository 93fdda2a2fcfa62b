"""The shards of a sharded client: a list of addresses, "a,b,c", or ``dns:///host:port``.

``dns:///host:port`` is resolved once, at construction, with ``socket.getaddrinfo``:
every IPv4 address of the name becomes a shard named ``ip:port`` (IPv6 addresses only
when it has no IPv4 one: a dual-stack pod would otherwise count twice). Pod IPs change when pods
are rescheduled, and the shard names decide placement, so for a Kubernetes StatefulSet
list its stable pod names instead (``expstore-0.expstore:50051,expstore-1.expstore:50051``).
"""

from __future__ import annotations

import socket
from typing import Sequence

DNS_SCHEME = "dns:///"


def resolve(servers: str | Sequence[str]) -> list[str]:
    """Shard addresses, sorted; ValueError for an empty list or a repeated address."""
    entries = servers.split(",") if isinstance(servers, str) else list(servers)
    out: list[str] = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        out += _dns(entry[len(DNS_SCHEME):]) if entry.startswith(DNS_SCHEME) else [entry]
    if not out:
        raise ValueError(f"no server addresses in {servers!r}")
    repeated = sorted({a for a in out if out.count(a) > 1})
    if repeated:
        raise ValueError(f"server address listed twice: {', '.join(repeated)} (each shard once)")
    return sorted(out)


def _dns(target: str) -> list[str]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{DNS_SCHEME}{target}: expected {DNS_SCHEME}HOST:PORT")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"{DNS_SCHEME}{target}: cannot resolve {host!r}: {e}") from None
    v4 = {info[4][0] for info in infos if info[0] == socket.AF_INET}
    ips = sorted(v4 or {info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]
