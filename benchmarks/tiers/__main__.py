"""``python -m benchmarks.tiers [--quick]``: run section 7, print its tables (stderr) and JSON (stdout)."""

import json
import sys

from . import build_restart_dir, render, run

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--build-restart":
        build_restart_dir(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
    result = run("--quick" in sys.argv)
    print(render(result), file=sys.stderr, flush=True)
    print(json.dumps(result))
