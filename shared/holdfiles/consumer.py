"""The consumer copy of a hold spec, for the runtimes whose CDI library cannot read the hold spec, and where it goes.

The copy says to a container exactly what the hold spec says and nothing of
the record, so it is made only from the hold spec itself: `consumer_spec` from
its decoded JSON here, `consumer_file_bytes` from its bytes in files.py (it
first checks, with `parse_hold`, that they are a hold's; ondisk digests each
hold's copy with `consumer_spec`, so this module does not import ondisk).

Decisions:

* The consumer copy (docs/cdi-runtimes.md). Annotations need cdiVersion
  0.6.0, and a CDI library older than v0.6 (podman before 4.7, containerd
  before 1.7.12, CRI-O before 1.28) refuses the whole hold spec. So beside
  each hold spec bcd writes `consumer_spec(hold spec)`: the same kind,
  device names and edits, no annotations, at the lowest cdiVersion its
  content needs (0.3.0 unless the vendor's edits need more), into a spec
  directory a runtime ranks above the hold's (`/var/run/cdi` above
  `/etc/cdi`): a runtime that reads both takes the copy's devices, one that
  cannot read the hold spec still finds them. The copy is a pure function of
  the hold spec's bytes (`consumer_file_bytes`), so both files always say
  the same to a container; the hold spec stays the record.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .cdi import dicts, json_copy, min_cdi_version
from .content import KIND

#: where a runtime looks for generated CDI specs, ranked above /etc/cdi (the CDI library's
#: DefaultDynamicDir; every runtime's default spec dirs are /etc/cdi, then /var/run/cdi).
DEFAULT_CONSUMER_DIR = "/var/run/cdi"


def default_consumer_dir(run_dir: Path | str, *, fake_host: bool) -> Path:
    """Where consumer copies go when `--cdi-consumer-dir` is not given: /var/run/cdi on a real
    host; `<run_dir>/cdi` on a fake host, which must never write the real host's spec dirs."""
    return Path(run_dir) / "cdi" if fake_host else Path(DEFAULT_CONSUMER_DIR)


def checked_consumer_dir(cdi_dir: Path | str, consumer_dir: Path | str) -> Path:
    """`consumer_dir` when it can hold consumer copies beside `cdi_dir`'s holds; ValueError says why not.

    It must be absolute and another directory than the CDI dir: in one directory (one
    priority level) a runtime finds each device name twice and drops both."""
    path = Path(consumer_dir)
    if not str(consumer_dir) or not path.is_absolute():
        raise ValueError(f"--cdi-consumer-dir {str(consumer_dir)!r} is not an absolute path")
    if os.path.realpath(path) == os.path.realpath(cdi_dir):
        raise ValueError(
            f"--cdi-consumer-dir {consumer_dir} is the CDI dir itself: a runtime would find every device twice "
            "in one directory and drop both; give a spec dir it ranks above it (/var/run/cdi above /etc/cdi)"
        )
    return path


def consumer_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer copy of a hold spec: the same kind, devices and edits, without the
    spec's and the devices' annotations, at the lowest cdiVersion of what is left."""
    devices = [{k: json_copy(v) for k, v in d.items() if k != "annotations"} for d in dicts(spec.get("devices"))]
    out: dict[str, Any] = {"cdiVersion": "", "kind": spec.get("kind", KIND), "devices": devices}
    if "containerEdits" in spec:
        out["containerEdits"] = json_copy(spec["containerEdits"])
    out["cdiVersion"] = min_cdi_version(out)
    return out
