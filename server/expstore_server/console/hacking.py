"""Reward-hacking views: per policy version, the figures that drift when a policy games
its reward.

One SQL statement over the store (the Query RPC, role reader) reads a compact row per
item of the last ``versions`` policy versions (a ``policy_version`` bound the query
engine turns into chunk pruning; at most ``MAX_ROWS`` rows): its version, reward,
generated length (``num_generated``), finish_reason, group_id, reward_components and
its count of tool calls and of those not ``ok``. The views are then SQL over those rows
in the console's own DuckDB (``VIEWS``), so the store scans once per refresh and does no
aggregation for the console:

- drift: mean reward, mean generated length and their correlation; rewards that rise
  with length alone suggest length is being rewarded. scatter: up to SCATTER items for a
  reward-vs-length plot.
- collapse: the share of GRPO groups (rows sharing a ``group_id``, more than one) whose
  rewards are all equal: they carry no advantage signal.
- components: mean abs value of each ``reward_components`` entry; one component
  dominating the total is a hint the policy found a cheap one.
- finish: the ``finish_reason`` mix (a policy that learns to stop at the length limit).
- tools: tool calls (turns with a ``tool_name``) and those whose ``tool_status`` is not ``ok``.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from .. import cli
from .store import Session
from .values import jsonable

SCATTER = 2_000
DEFAULT_VERSIONS = 50
MAX_ROWS = 50_000

ROWS = """SELECT item_id, policy_version AS version, reward, num_generated AS length, finish_reason, group_id,
    reward_components,
    len(list_filter(turns, lambda t: t.tool_name IS NOT NULL)) AS calls,
    len(list_filter(turns, lambda t: t.tool_name IS NOT NULL AND t.tool_status IS DISTINCT FROM 'ok')) AS errors
    FROM {table} WHERE policy_version >= {first} LIMIT {limit}"""

VIEWS = {
    "drift": """SELECT version, count(*) AS items, avg(reward) AS reward, avg(length) AS length,
        corr(reward, length) AS correlation FROM rows WHERE reward IS NOT NULL GROUP BY version ORDER BY version""",
    "scatter": f"""SELECT item_id, version, length, reward FROM rows WHERE reward IS NOT NULL
        ORDER BY hash(item_id) LIMIT {SCATTER}""",
    "collapse": """SELECT version, count(*) AS groups, count(*) FILTER (WHERE hi = lo) AS zero_variance
        FROM (SELECT version, group_id, count(*) AS n, max(reward) AS hi, min(reward) AS lo FROM rows
              WHERE group_id IS NOT NULL AND reward IS NOT NULL GROUP BY version, group_id)
        WHERE n > 1 GROUP BY version ORDER BY version""",
    "components": """SELECT version, component, avg(abs(value)) AS mean_abs, count(*) AS items
        FROM (SELECT version, unnest(map_keys(reward_components)) AS component,
                     unnest(map_values(reward_components)) AS value FROM rows WHERE reward_components IS NOT NULL)
        GROUP BY version, component ORDER BY version, component""",
    "finish": """SELECT version, finish_reason, count(*) AS items FROM rows
        GROUP BY version, finish_reason ORDER BY version, finish_reason""",
    "tools": """SELECT version, sum(calls)::BIGINT AS calls, sum(errors)::BIGINT AS errors FROM rows
        GROUP BY version HAVING sum(calls) > 0 ORDER BY version""",
}


def views(session: Session, table: str, versions: int = DEFAULT_VERSIONS) -> dict:
    """Every view of ``table`` over its last ``versions`` policy versions, as columns."""
    info = session.client.describe(table)
    if info.config.get("kind", "trajectory") != "trajectory":
        raise ValueError(f"table {table!r} is a generic table: the reward-hacking views need trajectories")
    first = max(0, info.policy_version - max(1, int(versions)) + 1)
    rows = session.query(ROWS.format(table=cli.quote(table), first=first, limit=MAX_ROWS + 1)).read_all()
    out = {"table": table, "policy_version": info.policy_version, "first_version": first,
           "rows": min(rows.num_rows, MAX_ROWS), "truncated": rows.num_rows > MAX_ROWS}
    out.update(aggregate(rows.slice(0, MAX_ROWS)))
    return out


def aggregate(rows: pa.Table) -> dict:
    """The VIEWS over ``rows`` (the ROWS statement's result), each as {column: values}."""
    con = duckdb.connect()
    try:
        con.register("rows", rows)
        out = {}
        for name, sql in VIEWS.items():
            t = con.sql(sql).to_arrow_table()
            out[name] = {c: [jsonable(v) for v in t.column(c).to_pylist()] for c in t.schema.names}
        return out
    finally:
        con.close()
