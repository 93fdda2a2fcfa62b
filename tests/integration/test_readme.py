"""The README's quick start runs as written, against a real server."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quick_start_runs(server_factory, capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    server = server_factory()
    exec(compile(code.replace("127.0.0.1:50051", server.address), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "256.0"  # the items of "rollouts"
