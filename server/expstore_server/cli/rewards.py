"""``expstore audit``: recompute rewards and diff them with the stored ones (a *reward*
audit, ``expstore_client.reward_audit``; not the server's security audit log). Exit 1
when more items than ``--max-mismatch`` did not reproduce."""

from __future__ import annotations

from expstore_client.reward_audit import reward_audit

from .errors import CliError


def cmd_reward_audit(b, args, out) -> int:
    report = run_reward_audit(b, args.table, args.reward, where=args.where, limit=args.limit,
                              tolerance=args.tolerance, workers=args.workers, item_timeout=args.item_timeout,
                              progress=args.progress)
    out.write(report.format() + "\n")
    if args.out:
        if args.out.endswith(".parquet"):
            report.write_parquet(args.out)
        else:
            b.save(args.out, report.results)
        out.write(f"results: {args.out}\n")
    return 1 if report.failures > args.max_mismatch else 0


def run_reward_audit(b, table: str, reward: str, *, where: str | None = None, limit: int | None = None,
                     tolerance: float = 1e-6, workers: int | None = None, item_timeout: float = 30.0,
                     progress: bool | None = None):
    """Recompute the rewards of the rows of ``table`` (``where``: a SQL condition;
    ``limit``: the lowest item ids) on backend ``b``: what ``expstore audit`` and the
    console run. A reward that cannot be loaded is a CliError."""
    try:
        return reward_audit(lambda sql, timeout: b.query(sql, 0, timeout), table, reward, where=where, limit=limit,
                            tolerance=tolerance, workers=workers, item_timeout=item_timeout, progress=progress)
    except ValueError as e:
        raise CliError(str(e)) from None
