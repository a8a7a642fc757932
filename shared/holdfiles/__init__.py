"""The files of a hold, one module per format: its CDI spec, the spec's consumer copy, its env file.

A hold is `<cdi_dir>/bcd-<allocation>.json` (the record), its consumer copy in
a spec directory a runtime ranks above that one, and
`<run_dir>/allocations/<allocation>.env`. Pure builders, a parser and
validators; no I/O except what a caller hands in as bytes (and `VendorCache`,
which reads the vendor spec). Shared by the converger (which plans, writes as
root or on a fake host, and reads holds back) and the root helper (which
writes for an unprivileged converger).

The modules, lowest first (each imports only modules above it):

* `envfile`  - the env file: its lines and bytes.
* `content`  - what a hold is (HoldDevice, HoldContent) and the ids, names,
  bindings and annotation keys it goes by.
* `cdi`      - the hold's CDI spec, built from the content and the vendor spec,
  and its cdiVersion.
* `consumer` - the spec's consumer copy, for runtimes too old for the hold spec.
* `ondisk`   - reading a hold back from its spec (`parse_hold`).
* `files`    - what a writer writes: each file's path and bytes, the vendor spec.
* `rules`    - the CDI rules and the official JSON schema, checked (tests).
* `wire`     - a hold to and from the root helper, as typed fields only.

Each decision of DESIGN 5 ("CDI rules", "Env file") is told in the module it
is about. What callers use is re-exported here.
"""

from __future__ import annotations

from shared.fsutil import SETTLED_S, Remembered, content_digest, file_identity, remembered_value
from shared.slices import slice_name
from shared.vendorcdi import VendorSpecError

from .cdi import (
    CDI_VERSIONS,
    COPIED_EDITS,
    MPS_MOUNT_OPTIONS,
    MPS_SHM_DIR,
    VFIO_CONTAINER_NODE,
    build_cdi_spec,
    device_env_key,
    min_cdi_version,
    mps_mounts,
    qualified_names,
    render_cdi_spec,
)
from .consumer import DEFAULT_CONSUMER_DIR, checked_consumer_dir, consumer_spec, default_consumer_dir
from .content import (
    ANN_ALLOCATION,
    ANN_BINDING,
    ANN_CGROUP_PARENT,
    ANN_DEVICE_ID,
    ANN_GENERATION,
    ANN_LIMITS,
    ANN_RESERVATION,
    BINDING_CLAIM,
    BINDING_HOLD,
    BINDING_KUBERNETES,
    CLAIM_HOLD_PREFIX,
    DEFAULT_MPS_ROOT,
    DISK_BINDINGS,
    HOLD_BINDINGS,
    KIND,
    HoldContent,
    HoldDevice,
    checked_id,
    claim_hold_id,
    claim_mps_pipe_dir,
    default_mps_root,
    device_name,
    env_file_name,
    hold_file_name,
)
from .envfile import env_lines, render_env_file
from .files import ENV_SUBDIR, FILE_KINDS, VendorCache, consumer_file_bytes, hold_file_bytes, hold_file_path
from .ondisk import HOLD_FILE_MAX_BYTES, HoldOnDisk, NotAHold, parse_hold
from .rules import check_cdi_rules, validate_against_schema
from .wire import (
    device_from_wire,
    device_to_wire,
    gpu_atom_of,
    hold_from_wire,
    hold_to_wire,
    limits_from_wire,
    limits_to_wire,
)

__all__ = [
    # content
    "KIND",
    "ANN_ALLOCATION",
    "ANN_RESERVATION",
    "ANN_GENERATION",
    "ANN_CGROUP_PARENT",
    "ANN_BINDING",
    "ANN_LIMITS",
    "ANN_DEVICE_ID",
    "BINDING_HOLD",
    "BINDING_KUBERNETES",
    "HOLD_BINDINGS",
    "BINDING_CLAIM",
    "DISK_BINDINGS",
    "CLAIM_HOLD_PREFIX",
    "claim_hold_id",
    "hold_file_name",
    "env_file_name",
    "checked_id",
    "device_name",
    "HoldDevice",
    "HoldContent",
    "DEFAULT_MPS_ROOT",
    "default_mps_root",
    "claim_mps_pipe_dir",
    # cdi
    "COPIED_EDITS",
    "CDI_VERSIONS",
    "VFIO_CONTAINER_NODE",
    "device_env_key",
    "build_cdi_spec",
    "render_cdi_spec",
    "MPS_SHM_DIR",
    "MPS_MOUNT_OPTIONS",
    "mps_mounts",
    "qualified_names",
    "min_cdi_version",
    # consumer
    "DEFAULT_CONSUMER_DIR",
    "checked_consumer_dir",
    "default_consumer_dir",
    "consumer_spec",
    # envfile
    "env_lines",
    "render_env_file",
    # ondisk
    "HOLD_FILE_MAX_BYTES",
    "HoldOnDisk",
    "NotAHold",
    "parse_hold",
    # files
    "FILE_KINDS",
    "ENV_SUBDIR",
    "hold_file_path",
    "VendorCache",
    "hold_file_bytes",
    "consumer_file_bytes",
    # rules
    "check_cdi_rules",
    "validate_against_schema",
    # wire
    "gpu_atom_of",
    "device_from_wire",
    "device_to_wire",
    "limits_from_wire",
    "limits_to_wire",
    "hold_from_wire",
    "hold_to_wire",
    # owned elsewhere, re-exported for the callers that import them from here
    "slice_name",
    "SETTLED_S",
    "file_identity",
    "content_digest",
    "Remembered",
    "remembered_value",
    "VendorSpecError",
]
