"""Commands that look at the tables as a whole: ``tables``, ``describe``, ``stats``
(``--watch``: the live view of ``expstore_server.watch``) and ``manifest``."""

from __future__ import annotations

import json

from .output import print_rows


def cmd_tables(b, args, out) -> int:
    rows = b.tables()
    print_rows(out, rows, list(rows[0]) if rows else ["name"])
    return 0


def cmd_describe(b, args, out) -> int:
    config, schema = b.describe(args.table)
    out.write(json.dumps(config, indent=2, default=str) + "\n")
    from expstore.query import DERIVED_COLUMNS, SERVER_COLUMNS

    rows = [{"column": f.name, "type": str(f.type), "null": "" if f.nullable else "not null", "origin": "stored"}
            for f in schema]
    if "item_id" not in schema.names:
        rows += [{"column": f.name, "type": str(f.type), "null": "", "origin": "server"} for f in SERVER_COLUMNS]
        if all(n in schema.names for n in ("tokens", "loss_mask", "turns")):
            rows += [{"column": f.name, "type": str(f.type), "null": "", "origin": "derived"} for f in DERIVED_COLUMNS]
    print_rows(out, rows, ["column", "type", "null", "origin"])
    return 0


def cmd_stats(b, args, out) -> int:
    if args.watch:
        from ..watch import watch

        return watch(lambda: b.stats(args.table), out, interval=args.interval, count=args.count)
    for name, values in b.stats(args.table).items():
        out.write(f"{name}\n")
        width = max((len(k) for k in values), default=0)
        for k in sorted(values):
            v = values[k]
            out.write(f"  {k:<{width}}  {int(v) if float(v).is_integer() and abs(v) < 1e15 else format(v, 'g')}\n")
    return 0


def cmd_manifest(b, args, out) -> int:
    ids, versions = b.manifest(args.table, args.step)
    out.write(f"step {args.step}: {len(ids)} items\n")
    print_rows(out, [{"item_id": int(i), "policy_version": int(v)} for i, v in zip(ids, versions)],
               ["item_id", "policy_version"])
    return 0
