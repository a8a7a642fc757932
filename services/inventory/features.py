"""GPU feature labels: what a scheduler or a nodeSelector can use (issue 43).

This room owns two kinds of labels, both derived from the published Inventory and nothing else:

- **the node's feature file**: the labels NVIDIA's gpu-feature-discovery (GFD, now in
  NVIDIA/k8s-device-plugin, `internal/lm`) writes, with its names and value formats, as one
  `name=value` a line in a file of NFD's local feature source
  (`/etc/kubernetes/node-feature-discovery/features.d/`), so a cluster's NFD worker publishes
  them on the Node (`nvidia.com/gpu.count`, `nvidia.com/mig.capable`, ...). `node_labels` is the
  pure part; `FeatureFile` writes it atomically, only on change, never through a symlink or over
  something that is not a regular file, and removes it when the inventory stops;
- **each card's labels** (seed 003: the PhysicalGPU's `gpu.deckhouse.io/vendor`, `device`,
  `node` and the sharing strategies it supports, `sharing.mps`, `sharing.ts`): `card_labels`,
  carried on each `Gpu` of the inventory.

Every label is checked against Kubernetes' label syntax (`label_problem`); one that fails is
left out and named, never written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.schemas import Gpu, Inventory

#: where NFD's local feature source reads feature files on a real host
NFD_FEATURES_DIR = Path("/etc/kubernetes/node-feature-discovery/features.d")
#: bcd's file in it (GFD's is `gfd`: both may sit side by side; a node runs one of them)
FEATURE_FILE = "bcd-gpu"
#: GFD's `--mig-strategy`: bcd's device plugin advertises one resource per MIG profile (mixed)
MIG_STRATEGIES = ("none", "single", "mixed")
MIB = 1024 * 1024

NVIDIA = "nvidia.com"
DECKHOUSE = "gpu.deckhouse.io"

# Kubernetes' label syntax (k8s.io/apimachinery validation: IsQualifiedName, IsValidLabelValue)
_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_problem(name: str, value: str) -> str:
    """Why `name=value` is no valid Kubernetes label ("" when it is one)."""
    prefix, slash, part = name.rpartition("/")
    if slash:
        if not prefix or len(prefix) > 253 or not all(_DNS_LABEL.match(p) for p in prefix.split(".")):
            return f"label {name!r}: the prefix must be a DNS subdomain (lowercase, at most 253 characters)"
    if not part or len(part) > 63 or not _NAME_PART.match(part):
        return f"label {name!r}: the name must be 1-63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric"
    if len(value) > 63 or not _VALUE.match(value):
        return f"label {name}={value!r}: the value must be empty or 1-63 characters of [A-Za-z0-9-_.], starting and ending alphanumeric"
    return ""


@dataclass
class Labels:
    """Labels that passed the syntax check, and those left out with the reason."""

    labels: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def put(self, name: str, value: object) -> None:
        text = str(value).lower() if isinstance(value, bool) else str(value)
        problem = label_problem(name, text)
        if problem:
            self.skipped.append(problem)
            self.labels.pop(name, None)
        else:
            self.labels[name] = text


def sanitise(text: str) -> str:
    """GFD's `sanitise`: drop what is not [A-Za-z0-9-_. ], then join the words with '-'."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def _product(*parts: str) -> str:
    return "-".join(sanitise(p) for p in parts if p and sanitise(p))


def arch_family(major: int, minor: int) -> str:
    """GFD's getArchFamily."""
    table = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell", 12: "blackwell", 13: "rubin"}
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return table.get(major, "undefined")


def _compute(gpu: Gpu) -> bool:
    """A card its compute driver runs: what NVML (and so GFD) sees."""
    return gpu.status.driver_binding.mode == "Compute" and bool(gpu.uuid)


def _mig_capable(gpu: Gpu) -> bool:
    return gpu.mig_mode or bool(gpu.mig_profiles)


def sharing_supported(gpu: Gpu, *, sharer: bool) -> tuple[bool, bool]:
    """(MPS, time-slicing) the card supports: whole cards on their compute driver, on an adapter
    that runs the sharing steps (the inventory.sharing endpoint's own rule)."""
    ok = sharer and _compute(gpu) and not gpu.mig_mode
    return ok, ok


def card_labels(gpu: Gpu, *, node_id: str, sharer: bool) -> Labels:
    """Seed 003's labels of one PhysicalGPU. `device` is the sanitised product name: the
    inventory does not read the PCI device id."""
    out = Labels()
    mps, ts = sharing_supported(gpu, sharer=sharer)
    if gpu.vendor:
        out.put(f"{DECKHOUSE}/vendor", gpu.vendor)
    if sanitise(gpu.name):
        out.put(f"{DECKHOUSE}/device", sanitise(gpu.name))
    out.put(f"{DECKHOUSE}/node", node_id)
    out.put(f"{DECKHOUSE}/sharing.mps", mps)
    out.put(f"{DECKHOUSE}/sharing.ts", ts)
    return out


# ------------------------------------------------------------------ the node's feature labels


def _split_version(text: str, lo: int, hi: int) -> list[str] | None:
    parts = text.split(".") if text else []
    return parts if lo <= len(parts) <= hi and all(p.isdigit() for p in parts) else None


def _versions(inv: Inventory, out: Labels) -> None:
    """GFD's version labeler (both its deprecated and its new names)."""
    driver = _split_version(inv.driver_version, 2, 3)
    if driver is not None:
        major, minor, rev = driver[0], driver[1], driver[2] if len(driver) > 2 else ""
        for name, value in (
            ("cuda.driver.major", major),
            ("cuda.driver.minor", minor),
            ("cuda.driver.rev", rev),
            ("cuda.driver-version.major", major),
            ("cuda.driver-version.minor", minor),
            ("cuda.driver-version.revision", rev),
            ("cuda.driver-version.full", inv.driver_version),
        ):
            out.put(f"{NVIDIA}/{name}", value)
    cuda = _split_version(inv.cuda_driver_version, 2, 2)
    if cuda is not None:
        major, minor = str(int(cuda[0])), str(int(cuda[1]))
        for name, value in (
            ("cuda.runtime.major", major),
            ("cuda.runtime.minor", minor),
            ("cuda.runtime-version.major", major),
            ("cuda.runtime-version.minor", minor),
            ("cuda.runtime-version.full", f"{major}.{minor}"),
        ):
            out.put(f"{NVIDIA}/{name}", value)


def _chosen_product(cards: list[Gpu]) -> str:
    """The card model the `nvidia.com/gpu.*` labels describe. GFD labels every model and the
    last one written wins (full cards over MIG-enabled ones); here, deterministically: the model
    most whole cards have (else most cards), ties to the lowest index."""
    full = [g for g in cards if not g.mig_mode] or cards
    counts = Counter(g.name for g in full)
    return max(full, key=lambda g: (counts[g.name], -g.index)).name


def _sharing(full: list[Gpu]) -> tuple[int, str]:
    """(replicas, sharing-strategy) of the whole cards: GFD's config applies to every card, so
    only cards all shared alike (N > 1 slots each; MPS on all, or on none) read as shared."""
    counts = {len(g.slots) for g in full}
    if len(counts) != 1 or (n := counts.pop()) < 2:
        return 1, "none"
    if all(g.mps_running for g in full):
        return n, "mps"
    if not any(g.mps_running for g in full):
        return n, "time-slicing"
    return 1, "none"


def _gpu_labels(cards: list[Gpu], out: Labels) -> tuple[int, str]:
    """GFD's full-GPU labeler for the chosen model; returns its (replicas, strategy)."""
    name = _chosen_product(cards)
    same = [g for g in cards if g.name == name]
    full = [g for g in same if not g.mig_mode]
    replicas, strategy = _sharing(full) if full else (0, "none")
    first = full[0] if full else same[0]
    out.put(f"{NVIDIA}/gpu.product", _product(name, "SHARED" if replicas > 1 else ""))
    out.put(f"{NVIDIA}/gpu.count", len(same))
    out.put(f"{NVIDIA}/gpu.replicas", replicas)
    out.put(f"{NVIDIA}/gpu.sharing-strategy", strategy)
    if first.memory_bytes // MIB:
        out.put(f"{NVIDIA}/gpu.memory", first.memory_bytes // MIB)
    cc = _split_version(first.compute_capability, 2, 2)
    if cc is not None and int(cc[0]) > 0:
        major, minor = int(cc[0]), int(cc[1])
        out.put(f"{NVIDIA}/gpu.family", arch_family(major, minor))
        out.put(f"{NVIDIA}/gpu.compute.major", major)
        out.put(f"{NVIDIA}/gpu.compute.minor", minor)
    return replicas, strategy


@dataclass
class _MigType:
    card: Gpu
    profile: str
    memory_bytes: int
    gi_profile: str
    count: int = 0


def _mig_types(cards: Iterable[Gpu]) -> dict[str, _MigType]:
    """Every MIG device on MIG-enabled cards, by profile (a `+` of NVML's is a `.`, as GFD)."""
    types: dict[str, _MigType] = {}
    for g in cards:
        gis = {i.gi: i.profile for i in g.gpu_instances}
        for m in g.mig_instances:
            profile = m.profile.replace("+", ".")
            t = types.setdefault(profile, _MigType(g, profile, m.memory_bytes, gis.get(m.gi, "")))
            t.count += 1
    return types


def _mig_attributes(t: _MigType, key: str, out: Labels) -> None:
    """GFD's MIG attribute labels, from the GPU instance's profile where the inventory knows it:
    multiprocessors and slices.ci only where the compute instance spans the whole GPU instance
    (a `<n>c.` profile gives slices.ci only)."""
    if t.memory_bytes // MIB:
        out.put(f"{key}.memory", t.memory_bytes // MIB)
    gi = next((p for p in t.card.mig_profiles if p.name == (t.gi_profile or t.profile)), None)
    if gi is None:
        return
    out.put(f"{key}.slices.gi", gi.slices)
    whole = t.profile == gi.name
    ci = re.match(r"^(\d+)c\.", t.profile)
    if whole:
        out.put(f"{key}.slices.ci", gi.slices)
        out.put(f"{key}.multiprocessors", gi.multiprocessors)
    elif ci:
        out.put(f"{key}.slices.ci", int(ci.group(1)))
    for name, value in (
        ("engines.copy", gi.copy_engines),
        ("engines.decoder", gi.decoders),
        ("engines.encoder", gi.encoders),
        ("engines.jpeg", gi.jpeg_engines),
        ("engines.ofa", gi.ofa_engines),
    ):
        out.put(f"{key}.{name}", value)


def _mig_labels(cards: list[Gpu], strategy: str, out: Labels) -> None:
    if strategy == "none":
        return
    out.put(f"{NVIDIA}/mig.strategy", strategy)
    enabled = [g for g in cards if g.mig_mode]
    types = _mig_types(enabled)
    if strategy == "mixed":
        for profile in sorted(types):
            t = types[profile]
            key = f"{NVIDIA}/mig-{profile}"
            out.put(f"{key}.product", _product(t.card.name, "MIG", profile))
            out.put(f"{key}.count", t.count)
            out.put(f"{key}.replicas", 1)
            out.put(f"{key}.sharing-strategy", "none")
            _mig_attributes(t, key, out)
        return
    # single: the nvidia.com/gpu.* labels describe the one MIG type, or say INVALID
    if not enabled:
        return
    empty = any(not g.mig_instances for g in enabled)
    if empty or len(enabled) != len(cards) or len(types) != 1:
        out.put(f"{NVIDIA}/gpu.product", _product(enabled[0].name, "MIG", "INVALID"))
        # GFD's newInvalidMigStrategyLabeler (internal/lm/mig-strategy.go): product, count, replicas and
        # memory; the whole cards' sharing-strategy stays as their labeler put it
        for name, value in (("count", 0), ("replicas", 0), ("memory", 0)):
            out.put(f"{NVIDIA}/gpu.{name}", value)
        return
    (t,) = types.values()
    for name in [n for n in out.labels if n.startswith(f"{NVIDIA}/gpu.memory")]:
        del out.labels[name]
    out.put(f"{NVIDIA}/gpu.product", _product(t.card.name, "MIG", t.profile))
    out.put(f"{NVIDIA}/gpu.count", t.count)
    out.put(f"{NVIDIA}/gpu.replicas", 1)
    out.put(f"{NVIDIA}/gpu.sharing-strategy", "none")
    _mig_attributes(t, f"{NVIDIA}/gpu", out)


def node_labels(inv: Inventory, *, mig_strategy: str = "mixed") -> Labels:
    """The node's GFD labels for this inventory (no GPU its compute driver runs: none at all,
    as GFD). No `gfd.timestamp`: the file changes only when the GPUs do. Besides GFD's, the
    seed's `gpu.deckhouse.io/sharing.mps` and `.ts`: "true" where any card supports it."""
    if mig_strategy not in MIG_STRATEGIES:
        raise ValueError(f"MIG strategy must be one of {', '.join(MIG_STRATEGIES)}, not {mig_strategy!r}")
    out = Labels()
    cards = [g for g in inv.gpus if _compute(g)]
    if not cards:
        return out
    _versions(inv, out)
    out.put(f"{NVIDIA}/mig.capable", any(_mig_capable(g) for g in cards))
    _, strategy = _gpu_labels(cards, out)
    # GFD: MPS-capable only where the device plugin shares by MPS and no card is MIG-enabled
    out.put(f"{NVIDIA}/mps.capable", strategy == "mps" and not any(g.mig_mode for g in cards))
    _mig_labels(cards, mig_strategy, out)
    for key in ("sharing.mps", "sharing.ts"):
        out.put(f"{DECKHOUSE}/{key}", any(g.labels.get(f"{DECKHOUSE}/{key}") == "true" for g in cards))
    return out


def render(labels: Mapping[str, str]) -> bytes:
    """The feature file: a comment, then `name=value` a line, sorted (the same labels give the
    same bytes). No `# +expiry-time`: the file is rewritten only on change, and removed at stop."""
    lines = ["# GPU feature labels written by bcd's inventory (GFD's names); NFD's local source reads this file"]
    lines += [f"{k}={v}" for k, v in sorted(labels.items())]
    return ("\n".join(lines) + "\n").encode()


# ------------------------------------------------------------------ the file


@dataclass(frozen=True)
class Outcome:
    """What a sync or a removal did: written, unchanged, removed, absent, refused, error."""

    what: str
    message: str = ""


class FeatureFile:
    """`<directory>/bcd-gpu`, written atomically (a dot-file NFD ignores, fsync, rename, fsync of
    the directory), only when its bytes change. The directory is opened without following a
    symlink, and is made only where its parent exists (no Kubernetes tree on a host without one);
    a file name that is a symlink, a FIFO or anything but a regular file is refused and left."""

    def __init__(self, directory: Path | str, name: str = FEATURE_FILE) -> None:
        self.directory = Path(directory)
        self.name = name
        self.path = self.directory / name

    def _open_dir(self, *, make: bool) -> int:
        try:
            return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if not make:
                raise
            os.mkdir(self.directory, 0o755)  # the parent must exist: no tree is made
            return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _Refused(f"{self.directory} is not a directory (a symlink is never followed)") from None
            raise

    def _kind(self, dfd: int) -> int | None:
        """The file's type bits (lstat), None when there is none."""
        try:
            return stat.S_IFMT(os.stat(self.name, dir_fd=dfd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None

    def _current(self, dfd: int) -> bytes | None:
        kind = self._kind(dfd)
        if kind is None:
            return None
        if kind != stat.S_IFREG:
            raise _Refused(f"{self.path} is not a regular file ({_kind_name(kind)}): left as it is, nothing written")
        # O_NONBLOCK: something swapped in after the lstat (a FIFO) must not block the service
        fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _Refused(f"{self.path} is not a regular file: left as it is, nothing written")
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def sync(self, content: bytes) -> Outcome:
        try:
            dfd = self._open_dir(make=True)
        except _Refused as exc:
            return Outcome("refused", str(exc))
        except FileNotFoundError:
            # no NFD tree on this host (not a Kubernetes worker): nothing to say but once, at INFO
            return Outcome("not written", f"{self.directory.parent} does not exist (no node-feature-discovery here)")
        except OSError as exc:
            return Outcome("error", f"{self.directory}: {exc.strerror or exc}")
        tmp = f".{self.name}.{os.getpid()}.tmp"
        try:
            if self._current(dfd) == content:
                return Outcome("unchanged")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
            try:
                os.write(fd, content)
                os.fsync(fd)
            finally:
                os.close(fd)
            # checked again just before the rename: what appeared meanwhile is not replaced
            kind = self._kind(dfd)
            if kind not in (None, stat.S_IFREG):
                os.unlink(tmp, dir_fd=dfd)
                return Outcome("refused", f"{self.path} is not a regular file ({_kind_name(kind)}): left as it is, nothing written")
            os.rename(tmp, self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            return Outcome("written")
        except _Refused as exc:
            return Outcome("refused", str(exc))
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            return Outcome("error", f"{self.path}: {exc.strerror or exc}")
        finally:
            os.close(dfd)

    def remove(self) -> Outcome:
        try:
            dfd = self._open_dir(make=False)
        except FileNotFoundError:
            return Outcome("absent")
        except _Refused as exc:
            return Outcome("refused", str(exc))
        except OSError as exc:
            return Outcome("error", f"{self.directory}: {exc.strerror or exc}")
        try:
            kind = self._kind(dfd)
            if kind is None:
                return Outcome("absent")
            if kind != stat.S_IFREG:
                return Outcome("refused", f"{self.path} is not a regular file ({_kind_name(kind)}): not bcd's, left as it is")
            os.unlink(self.name, dir_fd=dfd)
            os.fsync(dfd)
            return Outcome("removed")
        except OSError as exc:
            return Outcome("error", f"{self.path}: {exc.strerror or exc}")
        finally:
            os.close(dfd)


class _Refused(Exception):
    pass


def _kind_name(kind: int) -> str:
    return {stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}.get(kind, "a device")


class FeatureKeeper:
    """The inventory's one handle on the feature file: `sync` after every evaluation, `stop` at
    a clean stop. Each new outcome is logged once (a refused file is not said every scan)."""

    def __init__(self, directory: Path | str, *, mig_strategy: str, log: object) -> None:
        if mig_strategy not in MIG_STRATEGIES:
            raise ValueError(f"--feature-mig-strategy must be one of {', '.join(MIG_STRATEGIES)}, not {mig_strategy!r}")
        self.file = FeatureFile(directory)
        self.mig_strategy = mig_strategy
        self.log = log
        self.said: tuple[str, ...] = ()

    def sync(self, inv: Inventory) -> Outcome:
        labels = node_labels(inv, mig_strategy=self.mig_strategy)
        outcome = self.file.sync(render(labels.labels))
        self._say(outcome, labels.skipped, count=len(labels.labels))
        return outcome

    def stop(self) -> Outcome:
        outcome = self.file.remove()
        self._say(outcome, [], count=0)
        return outcome

    def _say(self, outcome: Outcome, skipped: list[str], *, count: int) -> None:
        said = (outcome.what, outcome.message, *skipped)
        if outcome.what == "unchanged" or said == self.said:
            return
        self.said = said
        log = self.log
        if outcome.what in ("refused", "error"):
            log.error("GPU feature file not kept", path=str(self.file.path), outcome=outcome.what, error=outcome.message)  # type: ignore[attr-defined]
        else:
            log.info("GPU feature file " + outcome.what, path=str(self.file.path), labels=count, **({"why": outcome.message} if outcome.message else {}))  # type: ignore[attr-defined]
        for problem in skipped:
            log.warning("GPU feature label left out", problem=problem)  # type: ignore[attr-defined]


__all__ = [
    "NFD_FEATURES_DIR",
    "FEATURE_FILE",
    "MIG_STRATEGIES",
    "label_problem",
    "Labels",
    "sanitise",
    "arch_family",
    "sharing_supported",
    "card_labels",
    "node_labels",
    "render",
    "Outcome",
    "FeatureFile",
    "FeatureKeeper",
]
