"""One trajectory at a time: ``show`` (turn by turn, token by token, with the loss mask
and logprobs) and ``replay`` (re-run its tool calls, diff the results). ``item`` and
``token_segments`` are shared with the console's trajectory view."""

from __future__ import annotations

import os

from .errors import CliError, import_module, load_callable
from .output import cell
from .sql import quote


def item(b, table: str, item_id: int) -> dict:
    """One item's row (its columns, the server's and the derived ones) as Python values."""
    rows = b.query(f"SELECT * FROM {quote(table)} WHERE item_id = {int(item_id)}", 1).read_all().to_pylist()
    if not rows:
        raise CliError(f"table {table!r}: no item with id {item_id}")
    return rows[0]


def token_segments(turns: list[dict], num_tokens: int) -> list[tuple[str, dict | None, int, int]]:
    """(title, turn or None, start, end) covering the tokens: each turn, and the prompt or
    the tokens between and after the turns."""
    segments, pos = [], 0
    for k, t in enumerate(turns):
        if t["start"] > pos:
            segments.append(("prompt" if pos == 0 else "(between turns)", None, pos, t["start"]))
        segments.append((f"turn {k}: {t['role']}", t, t["start"], t["end"]))
        pos = t["end"]
    if pos < num_tokens:
        segments.append(("prompt" if pos == 0 else "(after the turns)", None, pos, num_tokens))
    return segments


def cmd_show(b, args, out) -> int:
    row = item(b, args.table, args.item_id)
    tok = load_callable(args.tokenizer, "--tokenizer")() if args.tokenizer else None
    color = out.isatty() and not os.environ.get("NO_COLOR")

    def paint(text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if color else text

    for k in ("item_id", "traj_id", "task", "prompt_id", "group_id", "policy_version", "finish_reason", "reward",
              "reward_components", "tier", "priority", "times_sampled", "num_tokens", "num_generated"):
        if k in row:
            v = dict(row[k]) if k == "reward_components" and row[k] is not None else row[k]
            out.write(f"{k:<18} {v}\n")
    tokens, mask, logprobs = row.get("tokens") or [], row.get("loss_mask") or [], row.get("logprobs") or []
    turns = row.get("turns") or []
    for title, turn, lo, hi in token_segments(turns, len(tokens)):
        out.write(paint(f"\n== {title}  tokens [{lo}, {hi})", "1") + "\n")
        if turn is not None and turn.get("tool_name"):
            out.write(paint(f"   tool {turn['tool_name']}({turn.get('tool_args') or ''})", "36") + "\n")
            out.write(f"   -> [{turn.get('tool_status')}] {turn.get('tool_result')!r}  "
                      f"({turn.get('latency_ms')} ms)\n")
        for i in range(lo, hi):
            piece = repr(tok.decode([tokens[i]])) if tok is not None else str(tokens[i])
            line = f"   {i:>6}  {piece:<12}  mask {mask[i] if i < len(mask) else '-'}  " \
                   f"logprob {logprobs[i] if i < len(logprobs) else float('nan'):.4f}"
            out.write((paint(line, "32") if i < len(mask) and mask[i] else paint(line, "2")) + "\n")
    return 0


def cmd_replay(b, args, out) -> int:
    row = item(b, args.table, args.item_id)
    module = import_module(args.tools, "--tools")
    registry = getattr(module, "TOOLS", None)
    calls = [(k, t) for k, t in enumerate(row.get("turns") or []) if t.get("tool_name")]
    if not calls:
        out.write(f"item {args.item_id}: no tool calls to replay\n")
        return 0
    first = None
    for k, t in calls:
        name, stored = t["tool_name"], t.get("tool_result")
        fn = registry.get(name) if isinstance(registry, dict) else getattr(module, name, None)
        if not callable(fn):
            got, note = None, f"no tool {name!r} in {args.tools}"
        else:
            try:
                got, note = str(fn(t.get("tool_args") or "")), None
            except Exception as e:
                got, note = None, f"raised {type(e).__name__}: {e}"
        same = note is None and got == stored
        out.write(f"turn {k}: {name}({cell(t.get('tool_args'))}) {'same' if same else 'DIVERGED'}\n")
        if not same:
            first = k if first is None else first
            out.write(f"   stored: {stored!r}\n   now:    {note or repr(got)}\n")
            if note is None and stored is not None:
                at = next((i for i, (a, c) in enumerate(zip(stored, got)) if a != c), min(len(stored), len(got)))
                out.write(f"   first difference at character {at}\n")
    if first is None:
        out.write(f"all {len(calls)} tool calls reproduced\n")
        return 0
    out.write(f"first divergence: turn {first}\n")
    return 1
