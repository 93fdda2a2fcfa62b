"""One trajectory turn by turn, its GRPO group, a table's recent items, a step's manifest.

Every row is read with SQL (the Query RPC, role reader) through the session, so the
console shows what ``expstore show`` and ``expstore query`` show: the stored columns,
the server's (``item_id``, ``tier``, ...) and the derived ones (``num_generated``, ...).
Tokens are decoded with the tokenizer the table's ``metadata.tokenizer`` names
(``tokenizers``); without one, or when it refuses an id, the page shows ids.
"""

from __future__ import annotations

import json
from typing import Any

from expstore.schema import TRAJECTORY_V1

from .. import cli
from .store import Session
from .tokenizers import KEY, TokenizerError, Tokenizers, decode_pieces, decode_text
from .values import jsonable, sql_string

MAX_TOKENS = 20_000    # tokens of one item the viewer gets (the rest is counted, not sent)
MAX_SIBLINGS = 64      # items of a GRPO group shown side by side
SIBLING_TOKENS = 2_000  # generated tokens decoded per sibling
LIST_ROWS = 200        # items a listing shows
MANIFEST_IDS = 100_000
FACTS = ("item_id", "traj_id", "task", "prompt_id", "group_id", "group_size", "policy_version", "finish_reason",
         "tier", "priority", "times_sampled", "inserted_at", "num_tokens", "num_generated", "num_turns",
         "num_tool_calls")
PER_TOKEN = ("tokens", "loss_mask", "logprobs", "token_policy_version", "advantages", "values")
LISTED = ("item_id", "traj_id", "task", "group_id", "policy_version", "reward", "finish_reason", "num_generated",
          "num_turns", "tier")


def tokenizer_of(config: dict, tokenizers: Tokenizers) -> tuple[Any, dict]:
    """(decoder or None, what the page says about it) for a table's config."""
    spec = (config.get("metadata") or {}).get(KEY)
    if not spec:
        return None, {"spec": None, "note": "no tokenizer declared (table metadata 'tokenizer'): token ids"}
    try:
        return tokenizers.get(spec), {"spec": spec, "note": f"decoded with {spec}"}
    except TokenizerError as e:
        return None, {"spec": spec, "note": f"tokenizer {spec}: {e}; showing token ids"}


def item_view(session: Session, tokenizers: Tokenizers, table: str, item_id: int) -> dict:
    info = session.client.describe(table)
    row = cli.item(session.backend, table, item_id)
    out: dict[str, Any] = {"table": table, "item_id": item_id, "kind": info.config.get("kind", "trajectory"),
                           "facts": {k: jsonable(row[k]) for k in FACTS if k in row}}
    if "tokens" not in row or "loss_mask" not in row:  # a generic table: its columns
        out["columns"] = {k: jsonable(v) for k, v in row.items()}
        return out
    tok, out["tokenizer"] = tokenizer_of(info.config, tokenizers)
    tokens = row["tokens"] or []
    n = min(len(tokens), MAX_TOKENS)
    per_token = {k: (row.get(k) or [])[:n] if row.get(k) is not None else None for k in PER_TOKEN}
    if tok is not None:
        pieces, problem = decode_pieces(tok, per_token["tokens"])
        per_token["pieces"] = pieces
        if problem:
            out["tokenizer"]["note"] += f" (some ids it cannot decode: {problem}; those show as ids)"
    out["tokens"] = jsonable(per_token)
    out["num_tokens"], out["tokens_shown"] = len(tokens), n
    out["segments"] = []
    for title, turn, lo, hi in cli.token_segments(row.get("turns") or [], len(tokens)):
        seg = {"title": title, "start": lo, "end": hi, "role": turn["role"] if turn else None,
               "tool": None, "text": decode_text(tok, tokens[lo:hi]) if tok is not None else None}
        if turn is not None and turn.get("tool_name"):
            seg["tool"] = {k: jsonable(turn.get(k)) for k in ("tool_name", "tool_args", "tool_result", "tool_status",
                                                                 "latency_ms")}
        out["segments"].append(seg)
    out["reward"] = jsonable(row.get("reward"))
    out["reward_components"] = jsonable(dict(row["reward_components"])) if row.get("reward_components") else None
    out["step_rewards"] = jsonable(row.get("step_rewards"))
    out["metadata"] = _pretty(row.get("metadata"))
    out["extra"] = {k: jsonable(v) for k, v in row.items() if k not in TRAJECTORY_V1.names and k not in FACTS}
    return out


def group_view(session: Session, tokenizers: Tokenizers, table: str, group_id: str) -> dict:
    """The items of a GRPO group, best reward first, each with its generated text."""
    info = session.client.describe(table)
    tok, note = tokenizer_of(info.config, tokenizers)
    rows = session.query_rows(
        f"SELECT item_id, traj_id, policy_version, reward, reward_components, finish_reason, num_generated, "
        f"tokens, loss_mask, turns FROM {cli.quote(table)} WHERE group_id = {sql_string(group_id)} "
        f"ORDER BY reward DESC NULLS LAST, item_id LIMIT {MAX_SIBLINGS + 1}", MAX_SIBLINGS + 1)
    out = []
    for r in rows[:MAX_SIBLINGS]:
        start = _generated_start(r)
        ids = (r["tokens"] or [])[start:start + SIBLING_TOKENS]
        out.append({"item_id": r["item_id"], "traj_id": r["traj_id"], "policy_version": r["policy_version"],
                    "reward": jsonable(r["reward"]), "finish_reason": r["finish_reason"],
                    "num_generated": r["num_generated"],
                    "reward_components": jsonable(dict(r["reward_components"])) if r["reward_components"] else None,
                    "text": decode_text(tok, ids) if tok is not None else None,
                    "ids": None if tok is not None else ids[:200]})
    rewards = [s["reward"] for s in out if isinstance(s["reward"], (int, float))]
    return {"table": table, "group_id": group_id, "items": out, "truncated": len(rows) > MAX_SIBLINGS,
            "tokenizer": note, "zero_variance": len(rewards) > 1 and max(rewards) == min(rewards)}


def _generated_start(row: dict) -> int:
    """Where the model's part starts: the first turn, else the first loss_mask 1 token."""
    turns = row.get("turns") or []
    if turns:
        return int(turns[0]["start"])
    mask = row.get("loss_mask") or []
    return next((i for i, m in enumerate(mask) if m), len(mask))


def recent(session: Session, table: str, where: str | None, limit: int) -> dict:
    """The newest items of ``table`` (optionally those matching the SQL condition ``where``)."""
    info = session.client.describe(table)
    names = {f.name for f in info.schema} | {"item_id", "tier", "num_generated", "num_turns"}
    cols = [c for c in LISTED if c in names] if "tokens" in names else ["*"]
    limit = max(1, min(int(limit), LIST_ROWS))
    sql = (f"SELECT {', '.join(cols)} FROM {cli.quote(table)}" + (f" WHERE {where}" if where else "")
           + f" ORDER BY item_id DESC LIMIT {limit}")
    t = session.query(sql, limit).read_all()
    return {"table": table, "columns": t.schema.names, "rows": [[jsonable(v) for v in r.values()] for r in t.to_pylist()]}


def manifest_view(session: Session, table: str, step: int) -> dict:
    """What training step ``step`` sampled: ids and versions (GetManifest), each item's
    facts (SQL), and the count of ids no longer in the table."""
    ids, versions = session.backend.manifest(table, step)
    ids, versions = ids[:MANIFEST_IDS].tolist(), versions[:MANIFEST_IDS].tolist()
    facts: dict[int, dict] = {}
    if ids:
        names = {f.name for f in session.client.describe(table).schema}
        cols = [c for c in ("traj_id", "task", "group_id", "reward", "finish_reason", "num_generated") if
                c in names or c == "num_generated" and "tokens" in names]
        in_list = ", ".join(str(int(i)) for i in sorted(set(ids)))
        lo, hi = min(versions), max(versions)  # prunes chunks: only these versions are read
        pruning = f"policy_version BETWEEN {lo} AND {hi} AND " if "policy_version" in names else ""
        for r in session.query_rows(f"SELECT item_id, {', '.join(cols) or 'tier'} FROM {cli.quote(table)} "
                                    f"WHERE {pruning}item_id IN ({in_list})"):
            facts[r["item_id"]] = {k: jsonable(v) for k, v in r.items()}
    rows = [{"item_id": i, "policy_version": v, **facts.get(i, {"gone": True})} for i, v in zip(ids, versions)]
    draws: dict[int, int] = {}
    for i in ids:
        draws[i] = draws.get(i, 0) + 1
    return {"table": table, "step": step, "items": rows, "distinct": len(draws),
            "gone": sum(1 for r in rows if r.get("gone"))}


def _pretty(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, TypeError):
        return text
