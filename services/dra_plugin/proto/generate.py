"""Generate the Python code of the kubelet protos here: `dra_v1.proto`, `dra_v1beta1.proto`,
`pluginregistration_v1.proto`, `dra_health_v1alpha1.proto` and `dra_health_v1.proto` (needs grpcio-tools, the `test` extra).

    python -m services.dra_plugin.proto.generate            # rewrite the checked-in files
    python -m services.dra_plugin.proto.generate --out DIR  # write them elsewhere (the currency test)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shared.protogen import ProtoPackage

HERE = Path(__file__).resolve().parent
PACKAGES = (
    ProtoPackage(HERE, "dra_v1.proto"),
    ProtoPackage(HERE, "dra_v1beta1.proto"),
    ProtoPackage(HERE, "pluginregistration_v1.proto"),
    # the DRA health service (KEP 4680), both versions the kubelets of 1.34-1.37 ask for
    ProtoPackage(HERE, "dra_health_v1alpha1.proto"),
    ProtoPackage(HERE, "dra_health_v1.proto"),
)


def generate(out: Path) -> list[Path]:
    return [path for package in PACKAGES for path in package.generate(out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: next to the .protos)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
