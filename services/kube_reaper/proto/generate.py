"""Generate the Python code of `podresources_v1.proto` (needs grpcio-tools, the `test` extra).

    python -m services.kube_reaper.proto.generate            # rewrite the checked-in files
    python -m services.kube_reaper.proto.generate --out DIR  # write them elsewhere (the currency test)

The work is `shared.protogen.ProtoPackage` (protoc, then the gRPC module's import
of its messages made relative, so the code works as `services.kube_reaper.proto`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.protogen import ProtoPackage

HERE = Path(__file__).resolve().parent
PACKAGE = ProtoPackage(HERE, "podresources_v1.proto")
generate = PACKAGE.generate


def main(argv: list[str] | None = None) -> int:
    return PACKAGE.main(argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
