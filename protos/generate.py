"""Regenerates the checked-in gRPC stubs from protos/diloco.proto.

`python -m protos.generate` rewrites diloco_pb2.py, diloco_pb2_grpc.py and diloco_pb2.pyi;
`python -m protos.generate --check` exits 1 if the checked-in files differ from what the
current .proto produces (the test suite runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "protos/diloco.proto"
OUTPUTS = ("diloco_pb2.py", "diloco_pb2_grpc.py", "diloco_pb2.pyi")


def generate(out_dir: Path) -> None:
    """Runs protoc (grpcio-tools) with the .pyi plugin into out_dir/protos/."""
    from grpc_tools import protoc  # dev dependency, imported only here

    (out_dir / "protos").mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(ROOT / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in OUTPUTS
            if not (ROOT / "protos" / name).exists()
            or not filecmp.cmp(Path(tmp) / "protos" / name, ROOT / "protos" / name, shallow=False)
        ]
        if args.check:
            if stale:
                print(f"stale generated stubs: {', '.join(stale)}; run python -m protos.generate")
                return 1
            return 0
        for name in OUTPUTS:
            shutil.copyfile(Path(tmp) / "protos" / name, ROOT / "protos" / name)
            os.chmod(ROOT / "protos" / name, 0o644)
    return 0


if __name__ == "__main__":
    sys.exit(main())
