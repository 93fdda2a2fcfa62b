"""Reward-hacking views: per policy version, the figures that drift when a policy games
its reward. Each is one SQL statement over the store (the Query RPC, role reader):

- drift: mean reward, mean generated length (``num_generated``) and their correlation;
  rewards that rise with length alone suggest length is being rewarded. With a sample
  of up to SCATTER items for a reward-vs-length scatter.
- collapse: the share of GRPO groups (rows sharing a ``group_id``, more than one) whose
  rewards are all equal: they carry no advantage signal.
- components: mean |value| of each ``reward_components`` entry; one component
  dominating the total is a hint the policy found a cheap one.
- finish: the ``finish_reason`` mix (a policy that learns to stop at the length limit).
- tools: the share of tool calls (turns with a ``tool_name``) whose ``tool_status`` is
  not ``ok``.

Only the last ``versions`` policy versions are read (a comparison on ``policy_version``
that the query engine turns into chunk pruning).
"""

from __future__ import annotations

from .. import cli
from .store import Session
from .values import jsonable

SCATTER = 2_000
DEFAULT_VERSIONS = 50

QUERIES = {
    "drift": """SELECT policy_version AS version, count(*) AS items, avg(reward) AS reward,
        avg(num_generated) AS length, corr(reward, num_generated) AS correlation
        FROM {t} WHERE {since} AND reward IS NOT NULL GROUP BY version ORDER BY version""",
    "scatter": """SELECT item_id, policy_version AS version, num_generated AS length, reward
        FROM {t} WHERE {since} AND reward IS NOT NULL ORDER BY hash(item_id) LIMIT {scatter}""",
    "collapse": """SELECT version, count(*) AS groups, count(*) FILTER (WHERE hi = lo) AS zero_variance
        FROM (SELECT policy_version AS version, group_id, count(*) AS n, max(reward) AS hi, min(reward) AS lo
              FROM {t} WHERE {since} AND group_id IS NOT NULL AND reward IS NOT NULL
              GROUP BY version, group_id)
        WHERE n > 1 GROUP BY version ORDER BY version""",
    "components": """SELECT version, component, avg(abs(value)) AS mean_abs, count(*) AS items
        FROM (SELECT policy_version AS version, unnest(map_keys(reward_components)) AS component,
                     unnest(map_values(reward_components)) AS value
              FROM {t} WHERE {since} AND reward_components IS NOT NULL)
        GROUP BY version, component ORDER BY version, component""",
    "finish": """SELECT policy_version AS version, finish_reason, count(*) AS items
        FROM {t} WHERE {since} GROUP BY version, finish_reason ORDER BY version, finish_reason""",
    "tools": """SELECT version, count(*) AS calls, count(*) FILTER (WHERE status IS DISTINCT FROM 'ok') AS errors
        FROM (SELECT version, turn.tool_name AS name, turn.tool_status AS status
              FROM (SELECT policy_version AS version, unnest(turns) AS turn FROM {t}
                    WHERE {since} AND turns IS NOT NULL))
        WHERE name IS NOT NULL GROUP BY version ORDER BY version""",
}


def views(session: Session, table: str, versions: int = DEFAULT_VERSIONS) -> dict:
    """Every view of ``table`` over its last ``versions`` policy versions, as columns."""
    info = session.client.describe(table)
    if info.config.get("kind", "trajectory") != "trajectory":
        raise ValueError(f"table {table!r} is a generic table: the reward-hacking views need trajectories")
    first = max(0, info.policy_version - max(1, int(versions)) + 1)
    out = {"table": table, "policy_version": info.policy_version, "first_version": first}
    for name, sql in QUERIES.items():
        text = sql.format(t=cli.quote(table), since=f"policy_version >= {first}", scatter=SCATTER)
        t = session.query(text).read_all()
        out[name] = {c: [jsonable(v) for v in t.column(c).to_pylist()] for c in t.schema.names}
    return out
