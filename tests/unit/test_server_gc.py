"""The server process's garbage collector: the imports frozen, cycles collected less often."""

from __future__ import annotations

import subprocess
import sys


def test_the_server_freezes_its_imports_and_collects_less_often():
    code = ("import gc, sys\nfrom unittest import mock\nfrom expstore_server import main\n"
            "with mock.patch.object(main, 'serve', lambda *a: None), mock.patch.object(main, 'run_event_loop'):\n"
            "    assert main.main(['--data-dir', sys.argv[1]]) == 0\n"
            "print(gc.get_threshold(), gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code, "unused-data-dir"], capture_output=True, text=True, check=True)
    threshold, frozen = out.stdout.rsplit(")", 1)
    assert threshold + ")" == "(5000, 20, 50)" and int(frozen) > 50_000, out.stdout
