"""Tools a policy may call, each run in the sandbox, and the text format of calls and
observations.

A call in the generated text is ``<tool>NAME ARGS</tool>``, or, as chat models trained
on Hermes-style tool use write it, ``<tool_call>{"name": NAME, "arguments": ARGS}
</tool_call>`` (ARGS a string, or an object whose one value, or else whose JSON, is the
arguments string). Its observation text is the tool's output on success and its status
otherwise (e.g. "error"); the chat format frames it (CharTokenizer: ``<obs>RESULT</obs>``
in the toy alphabet; a chat template: a "tool" message).

Only tools in the allowlist given to ``call`` run; any other name is answered with
status "denied" without starting a process.

Each entry of ``TOOLS`` is also a plain function of the arguments string that returns the
tool's output, what a trajectory records as ``tool_result``: the form ``expstore replay
TABLE ITEM --tools expstore_rl.tools`` expects, so recorded calls can be re-run and diffed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from . import sandbox

CALL = re.compile(r"<tool>\s*([a-z_]+)\s*(.*?)</tool>", re.S)
JSON_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

_CALC = r"""
import ast, sys
from fractions import Fraction
OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
       ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}
def ev(n):
    if isinstance(n, ast.Expression): return ev(n.body)
    if isinstance(n, ast.Constant) and type(n.value) is int: return Fraction(n.value)
    if isinstance(n, ast.BinOp) and type(n.op) in OPS: return OPS[type(n.op)](ev(n.left), ev(n.right))
    if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub): return -ev(n.operand)
    raise ValueError("only integers, + - * / and parentheses")
try:
    print(ev(ast.parse(sys.stdin.read(), mode="eval")))
except Exception as e:
    sys.exit(f"error: {type(e).__name__}")
"""


@dataclass(frozen=True)
class Tool:
    """A tool is a fixed program; the call's arguments arrive on its stdin."""
    name: str
    argv: tuple[str, ...]
    limits: sandbox.Limits = sandbox.Limits()

    def __call__(self, args: str) -> str:
        """Run the tool in the sandbox on ``args``; its output (``ToolResult.output``, the
        recorded ``tool_result``), whatever its status."""
        return sandbox.run(list(self.argv), stdin=args, limits=self.limits).output


TOOLS = {
    "calc": Tool("calc", (sandbox.PYTHON, "-I", "-S", "-c", _CALC),
                 sandbox.Limits(cpu_s=1, wall_s=3.0, output_bytes=256)),
    "python": Tool("python", (sandbox.PYTHON, "-I", "-S", "-"), sandbox.Limits()),
}
"""calc: exact arithmetic over integers (a non-integer result prints as a fraction, 7/2).
python: runs the arguments as a Python program (stdlib only, no network)."""


@dataclass(frozen=True)
class ToolResult:
    name: str
    args: str
    status: str  # the sandbox's status, or "denied"
    output: str
    latency_ms: float


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, args) of the first tool call in ``text`` (either form), or None. A
    ``<tool_call>`` whose body is not a JSON object with a string "name" is no call: the
    turn goes to the environment's ``step`` like any answer."""
    toy, hermes = CALL.search(text), JSON_CALL.search(text)
    if toy and not (hermes and hermes.start() < toy.start()):
        return toy.group(1), toy.group(2).strip()
    if not hermes:
        return None
    try:
        call = json.loads(hermes.group(1))
        name, args = call["name"], call.get("arguments", "")
        if not isinstance(name, str):
            raise TypeError(name)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if isinstance(args, dict) and len(args) == 1 and isinstance(next(iter(args.values())), str):
        args = next(iter(args.values()))
    return name, args if isinstance(args, str) else json.dumps(args)


async def call(name: str, args: str, allow=("calc",)) -> ToolResult:
    """Run tool ``name`` if it is allowed; never raises for what the tool does."""
    tool = TOOLS.get(name)
    if tool is None or name not in allow:
        return ToolResult(name, args, "denied", f"tool {name!r} is not allowed", 0.0)
    r = await sandbox.run_async(list(tool.argv), stdin=args, limits=tool.limits)
    return ToolResult(name, args, r.status, r.output, r.latency_ms)


def observation(result: ToolResult) -> str:
    """The observation text of a call: its output, or its status when it failed (the chat
    format frames it)."""
    return result.output.strip() if result.status == "ok" else result.status.replace("_", " ")
