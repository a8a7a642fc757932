"""Generate the Python code of `deviceplugin_v1beta1.proto` (needs grpcio-tools, the `test` extra).

    python -m services.device_plugin.proto.generate            # rewrite the checked-in files
    python -m services.device_plugin.proto.generate --out DIR  # write them elsewhere (the currency test)
"""

from __future__ import annotations

import sys
from pathlib import Path

from shared.protogen import ProtoPackage

HERE = Path(__file__).resolve().parent
PACKAGE = ProtoPackage(HERE, "deviceplugin_v1beta1.proto")
generate = PACKAGE.generate


def main(argv: list[str] | None = None) -> int:
    return PACKAGE.main(argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
