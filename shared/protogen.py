"""Generating the checked-in gRPC code of the kubelet's protos (needs grpcio-tools, the `test` extra).

Every kubelet API bcd speaks (pod-resources v1 for kube_reaper, device plugin
v1beta1 for the device plugin) is a .proto checked in beside its generated
Python code. `ProtoPackage.generate(out)` runs grpc_tools.protoc on it and makes
the gRPC module import its messages relatively: protoc writes
`import <name>_pb2`, which works only with that folder on sys.path, not as a
package. `normalised` drops what differs between patch releases of grpcio-tools
without changing the code (the versions stamped into the files), so a test can
hold the checked-in code to a fresh generation.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_STAMPS = [
    (re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M), "GRPC_GENERATED_VERSION = '<grpc>'"),
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: <protobuf>"),
    (
        re.compile(r"(_runtime_version\.ValidateProtobufRuntimeVersion\(\n\s+_runtime_version\.Domain\.PUBLIC,\n)\s+\d+,\n\s+\d+,\n\s+\d+,\n"),
        r"\1<protobuf>\n",
    ),
]


def normalised(text: str) -> str:
    for pattern, replacement in _STAMPS:
        text = pattern.sub(replacement, text)
    return text


@dataclass(frozen=True)
class ProtoPackage:
    """One checked-in .proto in `here` and the two modules protoc makes of it."""

    here: Path
    proto: str

    @property
    def stem(self) -> str:
        return self.proto.removesuffix(".proto")

    @property
    def modules(self) -> tuple[str, str]:
        return (f"{self.stem}_pb2.py", f"{self.stem}_pb2_grpc.py")

    def generate(self, out: Path) -> list[Path]:
        from grpc_tools import protoc  # the `test` extra; imported here so no service ever needs it

        out.mkdir(parents=True, exist_ok=True)
        code = protoc.main(
            ["grpc_tools.protoc", f"-I{self.here}", f"--python_out={out}", f"--grpc_python_out={out}", str(self.here / self.proto)]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code}")
        grpc_module = out / self.modules[1]
        text = grpc_module.read_text()
        absolute, relative = f"import {self.stem}_pb2 as ", f"from . import {self.stem}_pb2 as "
        if absolute not in text:
            raise RuntimeError(f"{grpc_module}: protoc's import of the messages module changed; update shared/protogen.py")
        grpc_module.write_text(text.replace(absolute, relative))
        return [out / m for m in self.modules]

    def main(self, argv: list[str] | None = None, description: str = "") -> int:
        parser = argparse.ArgumentParser(description=description or f"generate the Python code of {self.proto}")
        parser.add_argument("--out", type=Path, default=self.here, help="output folder (default: next to the .proto)")
        args = parser.parse_args(argv)
        for path in self.generate(args.out):
            print(path)
        return 0


__all__ = ["ProtoPackage", "normalised"]


if __name__ == "__main__":  # pragma: no cover - the packages' own generate modules are the entry points
    sys.exit(2)
