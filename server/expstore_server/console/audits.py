"""Reward audits in the console: results tables, their reports, and running one.

An audit is ``expstore.audit`` run by the CLI's ``run_reward_audit`` (the same code as
``expstore audit``); its results go to a generic table of the store (``expstore audit
--out TABLE`` writes the same rows), so every audit stays queryable and linkable. A
results table is any table whose columns include ``expstore.audit.RESULT_SCHEMA``'s.

Reports are ``AuditReport.summary()`` over the rows of one ``audit_id``. The results
name the audited item (``source_item_id``) but not its table: the report finds it by
looking the top offender up in the trajectory tables (by item id, traj_id and version).

Running an audit needs what ``expstore audit --out TABLE`` needs: role ``reader`` to
read the rows, ``admin`` to create the results table (checked first, before any work)
and ``producer`` to insert the results. Reward functions run in the console's worker
processes, and only those the console was started with (``--reward``): a browser never
names code to import. One audit runs at a time.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.compute as pc

from expstore import audit as audit_mod

from .. import cli
from .store import Session
from .values import jsonable, sql_string

DEFAULT_REWARDS = ("expstore_rl.rewards:exact_match", "expstore_rl.rewards:numeric_answer",
                   "expstore_rl.rewards:code_unit_tests")
MAX_LIMIT = 100_000
TOP = 20


class AuditBusy(Exception):
    """Another audit is running in this console."""


def is_results_table(schema: pa.Schema) -> bool:
    return set(audit_mod.RESULT_SCHEMA.names) <= set(schema.names)


def listing(session: Session) -> dict:
    """Every results table and its audits (newest first), and the trajectory tables."""
    infos = session.client.list_tables()
    trajectory = sorted(i.name for i in infos if i.config.get("kind", "trajectory") == "trajectory")
    audits = []
    for info in sorted(infos, key=lambda i: i.name):
        if not is_results_table(info.schema):
            continue
        rows = session.query_rows(
            f"SELECT audit_id, any_value(reward_fn) AS reward_fn, any_value(reward_digest) AS reward_digest, "
            f"count(*) AS items, count(*) FILTER (WHERE status = 'ok') AS ok, "
            f"count(*) FILTER (WHERE status = 'mismatch') AS mismatch, "
            f"count(*) FILTER (WHERE status IN ('error', 'timeout')) AS errors, "
            f"min(inserted_at) AS inserted_at FROM {cli.quote(info.name)} GROUP BY audit_id "
            f"ORDER BY inserted_at DESC NULLS LAST")
        audits += [{"results_table": info.name, **{k: jsonable(v) for k, v in r.items()}} for r in rows]
    return {"audits": audits, "trajectory_tables": trajectory}


def report(session: Session, results_table: str, audit_id: str) -> dict:
    """``AuditReport.summary()`` of one audit, and the table its items came from."""
    t = session.query(f"SELECT * FROM {cli.quote(results_table)} WHERE audit_id = {sql_string(audit_id)} "
                      f"ORDER BY item_id").read_all()
    if t.num_rows == 0:
        raise LookupError(f"table {results_table!r}: no audit {audit_id!r}")
    reward_fn = t.column("reward_fn")[0].as_py()
    summary = audit_mod.AuditReport(t, reward_fn, t.column("reward_digest")[0].as_py(), None).summary(top=TOP)
    summary.pop("tolerance")  # not stored with the results
    out = jsonable(summary)
    probe = summary["top_offenders"] or summary["errors"]
    out["source_table"] = _source_table(session, t, probe[0]["source_item_id"]) if probe else None
    out["results_table"] = results_table
    return out


def _source_table(session: Session, results: pa.Table, item_id: int) -> str | None:
    """The trajectory table holding item ``item_id`` with the traj_id the audit recorded."""
    row = results.filter(pc.equal(results.column("source_item_id"), item_id)).slice(0, 1).to_pylist()[0]
    for info in sorted(session.client.list_tables(), key=lambda i: i.name):
        if info.config.get("kind", "trajectory") != "trajectory":
            continue
        version = f"policy_version = {int(row['policy_version'])} AND " if row["policy_version"] is not None else ""
        found = session.query_rows(f"SELECT count(*) AS n FROM {cli.quote(info.name)} WHERE {version}"
                                   f"item_id = {int(item_id)} AND traj_id = {sql_string(row['traj_id'])}")
        if found and found[0]["n"]:
            return info.name
    return None


class Runner:
    """Runs audits for the console, one at a time, with the rewards it allows."""

    def __init__(self, rewards: tuple[str, ...], workers: int | None = None) -> None:
        self.rewards = rewards
        self.workers = workers
        self._busy = threading.Lock()

    def run(self, session: Session, table: str, reward: str, *, where: str | None, limit: int | None,
            out: str, tolerance: float = 1e-6) -> dict:
        if reward not in self.rewards:
            raise ValueError(f"reward {reward!r} is not one this console runs (--reward; allowed: "
                             f"{', '.join(self.rewards) or 'none'})")
        if limit is not None and not 1 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be in 1..{MAX_LIMIT}, got {limit}")
        if not self._busy.acquire(blocking=False):
            raise AuditBusy("an audit is already running in this console; try again when it ends")
        try:
            # the results table first: a token without admin is refused before any work
            session.client.create_table(out, kind="generic", schema=audit_mod.RESULT_SCHEMA, if_not_exists=True)
            rep = cli.run_reward_audit(session.backend, table, reward, where=where, limit=limit,
                                       tolerance=tolerance, workers=self.workers, progress=False)
            if rep.results.num_rows:
                session.backend.save(out, rep.results)
        finally:
            self._busy.release()
        counts = rep.counts()
        audit_id = rep.results.column("audit_id")[0].as_py() if rep.results.num_rows else None
        return {"results_table": out, "audit_id": audit_id, "source_table": table, "items": rep.results.num_rows,
                **counts}
