"""Regenerate the committed protobuf/gRPC stubs (`make proto`).

The proto tree mirrors the Python package (client/expstore_proto/v1/expstore.proto ->
expstore_proto.v1.expstore_pb2, in the expstore-client distribution), so generated imports
work as they are. With --check, generate into a temporary directory and fail if the
committed stubs differ.
"""

from __future__ import annotations

import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent / "client"  # the import root of expstore_proto
PROTOS = ["expstore_proto/v1/expstore.proto"]
OUTPUTS = ["expstore_pb2.py", "expstore_pb2.pyi", "expstore_pb2_grpc.py"]


def generate(out: Path) -> None:
    for proto in PROTOS:
        args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--pyi_out={out}",
                f"--grpc_python_out={out}", str(ROOT / proto)]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")


def stale() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        different = []
        for proto in PROTOS:
            folder = Path(proto).parent
            for name in OUTPUTS:
                fresh, committed = Path(tmp) / folder / name, ROOT / folder / name
                if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                    different.append(str(folder / name))
        return different


if __name__ == "__main__":
    if "--check" in sys.argv:
        bad = stale()
        if bad:
            raise SystemExit(f"stale generated stubs: {bad}; run `make proto`")
        print("generated stubs are up to date")
    else:
        generate(ROOT)
