"""Generate the Python code of `podresources_v1.proto` (needs grpcio-tools, the `test` extra).

    python -m services.kube_reaper.proto.generate            # rewrite the checked-in files
    python -m services.kube_reaper.proto.generate --out DIR  # write them elsewhere (the currency test)

protoc writes `import podresources_v1_pb2` into the gRPC module, which only
works with this folder on sys.path; it is rewritten to a relative import so the
code works as `services.kube_reaper.proto`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "podresources_v1.proto"
MODULES = ("podresources_v1_pb2.py", "podresources_v1_pb2_grpc.py")
_ABSOLUTE_IMPORT = "import podresources_v1_pb2 as "
_RELATIVE_IMPORT = "from . import podresources_v1_pb2 as "


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # the `test` extra; imported here so the service never needs it

    out.mkdir(parents=True, exist_ok=True)
    code = protoc.main(
        ["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out}", f"--grpc_python_out={out}", str(HERE / PROTO)]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    grpc_module = out / MODULES[1]
    text = grpc_module.read_text()
    if _ABSOLUTE_IMPORT not in text:
        raise RuntimeError(f"{grpc_module}: protoc's import of the messages module changed; update generate.py")
    grpc_module.write_text(text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT))
    return [out / m for m in MODULES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: next to the .proto)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
