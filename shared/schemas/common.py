"""Constrained scalar types every schema shares.

Every string that may end up in a file name, a NATS subject, a KV key or an
env file is constrained here once, so a bad value is refused when a message is
decoded and never reaches a path. msgspec checks `pattern` with `re.search`,
where `$` also matches before a trailing newline; every anchored pattern
therefore ends in `$(?!\\n)`, which means plain end-of-string in both Python
and the ECMA dialect JSON Schema uses.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Literal

import msgspec

END = r"$(?!\n)"

ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}" + END
ID_RE = re.compile(ID_PATTERN)

#: allocation ids, reservation ids, node ids, instance ids: a subject token,
#: a KV key and a file-name part all at once.
Id = Annotated[
    str,
    msgspec.Meta(
        pattern=ID_PATTERN,
        description="lowercase letters, digits, '_' and '-', starting alphanumeric, 1-63 characters",
    ),
]

#: canonical PCI address as sysfs spells it, lowercase hex.
PCI_PATTERN = r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]" + END
PCI_RE = re.compile(PCI_PATTERN)
PciAddress = Annotated[
    str, msgspec.Meta(pattern=PCI_PATTERN, description="canonical PCI address, e.g. 0000:3b:00.0")
]

#: an atom id as the control plane sends it. Its class is judged by the
#: converger (unsupported-device), so decoding only bounds it to printable
#: ASCII without spaces.
ATOM_PATTERN = r"^[!-~]{1,200}" + END
AtomId = Annotated[str, msgspec.Meta(pattern=ATOM_PATTERN, description="atom id, e.g. GPU-<uuid>/gi1/ci0")]

#: Linux cpulist / nodelist syntax: "0-3,8,10-11".
CPULIST_PATTERN = r"^[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,255}" + END
CpuList = Annotated[
    str, msgspec.Meta(pattern=CPULIST_PATTERN, description="Linux cpulist syntax, e.g. 0-3,8")
]
#: a cpulist or "" (not known). Not `CpuList | Literal[""]`: msgspec checks a
#: string against the constrained str branch only, so "" would never decode.
CPULIST_OR_EMPTY_PATTERN = r"^([0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,255})?" + END
CpuListOrEmpty = Annotated[
    str, msgspec.Meta(pattern=CPULIST_OR_EMPTY_PATTERN, description='Linux cpulist syntax, or "" when unknown')
]

ENV_KEY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*" + END
ENV_KEY_RE = re.compile(ENV_KEY_PATTERN)
#: KEY=VALUE; the value holds no control character (C0, DEL, C1: newline, CR,
#: VT, FF, NEL, tab, NUL, ...) and no Unicode line or paragraph separator, so
#: no reader of the env file (a shell, systemd's EnvironmentFile, Python's
#: splitlines) can see a line of its own inside a value.
ENV_VALUE_FORBIDDEN = r"\x00-\x1f\x7f-\x9f\u2028\u2029"
ENV_LINE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}=[^" + ENV_VALUE_FORBIDDEN + r"]{0,4096}" + END
EnvLine = Annotated[
    str,
    msgspec.Meta(
        pattern=ENV_LINE_PATTERN,
        description="KEY=VALUE: KEY of letters, digits and '_', not starting with a digit, at most 128; "
        "VALUE at most 4096 characters, with no control character or line separator",
    ),
]

#: characters of an env value that the env file's consumers read differently.
#: The env file (`<run_dir>/allocations/<id>.env`) is read by a shell (`. file`:
#: quotes, `\\`, `$` and backticks are processed, a space ends the assignment,
#: `; & | < > ( )` end the command), by `docker run --env-file` (the value as
#: written after the first `=`; newer docker/cli, pkg/kvfile's trimQuotes, also
#: drops one pair of matching surrounding quotes) and by systemd's `EnvironmentFile=`
#: (src/basic/env-file.c: `\\` escapes, a leading quote starts a quoted value,
#: leading and trailing whitespace is dropped). No quoting reads the same to
#: all three (docker keeps quotes), so a value bcd writes holds none of these.
ENV_VALUE_SPECIAL = " \"'`\\$;&|<>()"
_ENV_VALUE_SPECIAL_NAMES = {" ": "a space", '"': "a double quote", "'": "a single quote", "`": "a backtick", "\\": "a backslash"}


def env_value_problem(value: str) -> str:
    """"" when a shell, `docker run --env-file` and systemd's `EnvironmentFile=` all read
    `KEY=<value>` as `value`; otherwise what stops them (for a refusal message).

    Refused: the characters of ENV_VALUE_SPECIAL, a `~` first or right after a
    `:` (a shell expands it to a home directory in an assignment), control
    characters (a line of their own to some reader) and text that is not
    UTF-8 (docker refuses the file, systemd ignores the line). Anything else,
    non-ASCII letters included, is read as written by all three.
    """
    for ch in value:
        if ch in ENV_VALUE_SPECIAL:
            name = _ENV_VALUE_SPECIAL_NAMES.get(ch, repr(ch))
            return (
                f"the value holds {name}, which a shell sourcing the env file, docker --env-file and "
                "systemd EnvironmentFile= read differently (not allowed: spaces, quotes, backticks, "
                "backslashes, '$', ';', '&', '|', '<', '>', '(', ')')"
            )
        if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or ch in "\u2028\u2029":
            return f"the value holds the control character {ch!r}"
    if value.startswith("~") or ":~" in value:
        return "the value has a '~' first or after ':', which a shell sourcing the env file expands to a home directory"
    try:
        value.encode()
    except UnicodeEncodeError:
        return "the value is not valid Unicode text"
    return ""


#: env keys bcd writes itself; a spec may not set them.
RESERVED_ENV_KEYS = frozenset({"NVIDIA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY"})
RESERVED_ENV_PREFIX = "BCD_"


def reserved_env_key(key: str) -> bool:
    return key.startswith(RESERVED_ENV_PREFIX) or key in RESERVED_ENV_KEYS


# Env keys no spec may set (issue 40), besides bcd's own: the ones something other than the workload
# reads. A hold's env goes into its CDI spec, which every OCI hook of the container sees (the NVIDIA
# toolkit's prestart hook runs as root and reads the container's env), and into its env file, which
# processes outside any container source (a shell's `. file`, systemd's EnvironmentFile= of a unit
# that may run as root). A deny-list, not an allow-list: workloads name their own variables freely
# (JAVA_OPTS, PYTHONPATH, HF_HOME, CUDA_VISIBLE_DEVICES...); what is denied is what steers the loader,
# libc, the container runtime's GPU hook, the MPS client or a shell, by name or by prefix. Keys are
# case-sensitive, as every reader below reads them (`ld_preload` steers nothing).
#
# Sources: glibc's UNSECURE_ENVVARS (sysdeps/generic/unsecvars.h: what ld.so drops for a setuid
# program; all of LD_*, and MALLOC_* for the allocator's tunables), the NVIDIA container toolkit
# (internal/config/image/envvars.go and internal/modifier/cdi.go: NVIDIA_VISIBLE_DEVICES,
# NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*, NVIDIA_DISABLE_REQUIRE, NVIDIA_MIG_CONFIG_DEVICES,
# NVIDIA_MIG_MONITOR_DEVICES, NVIDIA_IMEX_CHANNELS, NVIDIA_GDS, NVIDIA_MOFED, NVIDIA_NVSWITCH,
# NVIDIA_GDRCOPY, CUDA_VERSION; its swarm-resource setting, DOCKER_RESOURCE_GPU; and NVIDIA_CTK_* /
# NVIDIA_CONTAINER_* for its own tools: the whole NVIDIA_ prefix is denied, so a key the next
# toolkit release reads is denied already), CUDA MPS (CUDA_MPS_*: which server a client talks to,
# where it logs, its thread and memory limits: bcd sets the pipe directory, the daemon the limits),
# and bash/dash (what a sourcing shell, or every shell started under that env, runs or how it
# splits words). Left allowed, a judgement: an interpreter's own search paths and options
# (PYTHONPATH, PERL5LIB, NODE_OPTIONS) steer that one interpreter, not the loader, libc or the
# runtime, and workloads set them routinely.

#: key prefix -> what reads it (bcd's own, BCD_, is reserved_env_key's).
DENIED_ENV_PREFIXES: tuple[tuple[str, str], ...] = (
    ("LD_", "steers the dynamic loader"),
    ("NVIDIA_", "is read by the NVIDIA container toolkit's root hook"),
    ("CUDA_MPS_", "steers the CUDA MPS client (its server, its limits)"),
    ("MALLOC_", "tunes glibc's allocator"),
    ("DOCKER_RESOURCE_", "names the GPUs the NVIDIA container toolkit's root hook exposes (its swarm-resource)"),
)
#: key -> what reads it.
DENIED_ENV_KEYS: dict[str, str] = {
    # glibc (UNSECURE_ENVVARS, those not under LD_ or MALLOC_)
    "GLIBC_TUNABLES": "tunes glibc and the dynamic loader",
    "GCONV_PATH": "makes glibc load code from the directory it names (iconv modules)",
    "GETCONF_DIR": "steers glibc's getconf",
    "HOSTALIASES": "steers glibc's resolver",
    "LOCALDOMAIN": "steers glibc's resolver",
    "RES_OPTIONS": "steers glibc's resolver",
    "RESOLV_HOST_CONF": "steers glibc's resolver",
    "NIS_PATH": "steers glibc's NIS lookups",
    "LOCPATH": "makes glibc load locale data from the directory it names",
    "NLSPATH": "makes glibc load message catalogs from the path it names",
    "TMPDIR": "moves where glibc and programs make temporary files (glibc drops it across a privilege boundary)",
    "TZDIR": "makes glibc load time zone data from the directory it names",
    # the NVIDIA container toolkit: a legacy CUDA image (CUDA_VERSION, no NVIDIA_REQUIRE_CUDA) gets every GPU
    "CUDA_VERSION": "is read by the NVIDIA container toolkit's root hook (a legacy CUDA image is given every GPU)",
    # a shell: sourcing the env file, or every shell started with its env
    "PATH": "decides which program a command name runs",
    "BASH_ENV": "names a file every non-interactive bash runs first",
    "ENV": "names a file an interactive sh runs first",
    "SHELLOPTS": "sets the options of every bash started with it",
    "BASHOPTS": "sets the options of every bash started with it",
    "PS4": "is expanded (and its commands run) by a shell tracing its commands",
    "PROMPT_COMMAND": "is run by an interactive bash before each prompt",
    "IFS": "changes how the shell that sources the env file splits words",
}


#: the EnvLine lines whose key env_key_problem refuses, as one anchored pattern (ECMA-262 and Python
#: alike) for the JSON Schema's `not`, so a control plane's own validator refuses them too; built
#: from the same lists, so the two cannot differ (tests/unit/test_env_boundary.py checks it)
DENIED_ENV_LINE_PATTERN = (
    "^(?:(?:"
    + "|".join((RESERVED_ENV_PREFIX, *(p for p, _ in DENIED_ENV_PREFIXES)))
    + ")[A-Za-z0-9_]*|"
    + "|".join(sorted((*RESERVED_ENV_KEYS, *DENIED_ENV_KEYS)))
    + ")=[^"
    + ENV_VALUE_FORBIDDEN
    + "]*"
    + END
)


def env_key_problem(key: str) -> str:
    """"" when a spec may set env key `key`; else why not, one phrase that starts with the key
    (`LD_PRELOAD steers the dynamic loader`). The keys bcd sets itself are "set by bcd"."""
    if reserved_env_key(key):
        return f"{key} is set by bcd"
    why = DENIED_ENV_KEYS.get(key)
    if why is None:
        why = next((w for prefix, w in DENIED_ENV_PREFIXES if key.startswith(prefix)), None)
    return f"{key} {why}" if why is not None else ""


#: Every integer of every schema is a Go int64 (the upstream contract, docs/upstream.md): a control
#: plane typing a field int64 reads every value bcd sends, and bcd refuses at decode what such a
#: control plane could not have sent (a JSON number past 2^63 - 1 would otherwise decode to a Python
#: int of any size and be written into files whose readers refuse it).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0, le=INT64_MAX)]
Generation = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX, description="a non-negative int64; increases")]

#: What a hold's limits may book (the spec's Limits and the root helper's HelperLimits share them,
#: so the helper takes every limit a spec can carry): CPUs and NUMA nodes numbered up to these,
#: a CPU quota of that many CPUs, memory up to 1 PiB, huge pages up to 16 GiB a page, 2^32 of them.
LIMITS_MAX_CPU = 8191
LIMITS_MAX_NUMA_NODE = 1023
LIMITS_MAX_CPU_MILLIS = (LIMITS_MAX_CPU + 1) * 1000
LIMITS_MAX_MEMORY_BYTES = 2**50
HUGEPAGE_MIN_KIB = 4
HUGEPAGE_MAX_KIB = 16 * 1024 * 1024
HUGEPAGES_MAX_COUNT = 2**32

#: event ids are derived by the caller (hex digests), so a replay keeps its id.
EVENT_ID_PATTERN = r"^[a-z0-9][a-z0-9_.:-]{0,199}" + END
EventId = Annotated[
    str,
    msgspec.Meta(
        pattern=EVENT_ID_PATTERN,
        description="lowercase letters, digits, '_', '.', ':' and '-', starting alphanumeric, 1-200 characters",
    ),
]

KEY_ID_PATTERN = r"^[0-9a-f]{16}" + END
KeyId = Annotated[str, msgspec.Meta(pattern=KEY_ID_PATTERN, description="first 16 hex digits of sha256(raw public key)")]

ConditionStatus = Literal["True", "False", "Unknown"]

#: a short free-text field (reasons, messages) with a hard cap.
TEXT_MAX = 4096
Text = Annotated[str, msgspec.Meta(max_length=TEXT_MAX)]
NAME_MAX = 256
Name = Annotated[str, msgspec.Meta(max_length=NAME_MAX)]


def clip(text: str, limit: int = TEXT_MAX) -> str:
    """`text` cut to `limit` characters, saying so ("..." at the end) when cut."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def summarise(items: list[str], limit: int = TEXT_MAX, *, sep: str = "\n") -> str:
    """`items` joined by `sep`, as many as fit in `limit` characters, then "... and N more".

    Every producer of a bounded text field that lists things (a section's
    failures, a condition's allocations) goes through here, so what it emits
    always fits its own schema, whatever the spec made the list.
    """
    out: list[str] = []
    used = 0
    for i, item in enumerate(items):
        item = clip(item, limit)
        more = len(items) - i - 1
        # room for this item, and for the "... and N more" a later item may need
        tail = len(f"{sep}... and {more} more") if more else 0
        cost = len(item) + (len(sep) if out else 0)
        if used + cost + tail > limit:
            rest = len(items) - i
            note = f"... and {rest} more"
            return sep.join([*out, note]) if out else clip(note, limit)
        out.append(item)
        used += cost
    return sep.join(out)


class Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base of every bcd schema: frozen, keyword-only.

    Unknown fields are ignored so a newer peer may add fields (DESIGN 4:
    new fields get defaults, a field's type never changes).
    """


class Condition(Struct, kw_only=True):
    """A Kubernetes-style condition, on a node or on a PhysicalGPU."""

    type: Name
    status: ConditionStatus
    reason: Name = ""
    message: Text = ""
    since: datetime


__all__ = [
    "END",
    "ID_PATTERN",
    "ID_RE",
    "Id",
    "PCI_PATTERN",
    "PCI_RE",
    "PciAddress",
    "AtomId",
    "CpuList",
    "CpuListOrEmpty",
    "ENV_KEY_RE",
    "EnvLine",
    "RESERVED_ENV_KEYS",
    "ENV_VALUE_SPECIAL",
    "env_value_problem",
    "reserved_env_key",
    "DENIED_ENV_KEYS",
    "DENIED_ENV_PREFIXES",
    "DENIED_ENV_LINE_PATTERN",
    "env_key_problem",
    "NonNegInt",
    "PositiveInt",
    "Generation",
    "EventId",
    "KeyId",
    "ConditionStatus",
    "TEXT_MAX",
    "Text",
    "NAME_MAX",
    "Name",
    "clip",
    "summarise",
    "Struct",
    "Condition",
]
