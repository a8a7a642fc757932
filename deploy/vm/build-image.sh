#!/usr/bin/env bash
# The Debian bookworm guest of the VM suites (tests/vm, issue 18): `make vm-image`.
#
# Three layers under the cache dir ($BCD_VM_CACHE, default .scratch/vm-cache), each
# cached by content (a second run with nothing changed costs seconds: it rebuilds
# only the project's wheel, to hash it):
#
#   base-<key>/rootfs   debootstrap (Debian's packages only: systemd, the kernel and
#                       its initramfs, python3, python3-venv, dbus, udev, ...);
#                       key = suite, package list, the "base" section of this script
#   sys-<key>/rootfs    a copy of the base with the guest's settings and /opt/bcd/venv
#                       holding bcd's dependencies, installed offline from wheels
#                       built here; key = base, pyproject.toml (+ python, pystemd),
#                       the "sys" section of this script
#   image-<key>/        disk.raw (ext4 made by mkfs.ext4 -d: no loop mount), vmlinuz,
#                       initrd.img (taken from the guest's /boot), manifest.json; the
#                       project's wheel installed into the venv, /opt/bcd/src (docs/,
#                       deploy/), /opt/bcd/wheels, the guest agent (deploy/vm/guest);
#                       key = sys, the wheel's content, docs/ and deploy/, this script
#
# The base is built with `debootstrap --foreign` and its second stage run in a chroot
# with systemd-tmpfiles shimmed out: no systemd-tmpfiles (nor systemd) runs on the
# build host; the guest's systemd-tmpfiles-setup.service does that work at boot.
#
# Needs root (debootstrap, chroot), debootstrap, mkfs.ext4 (e2fsprogs 1.43+) and .venv
# (make venv) only when a layer has to be built. Prints the image dir on its last line.
# Exit status: 0 built or cached; 3 it cannot be built here (not root, a tool missing,
# the Debian mirror unreachable); 1 anything else.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
SCRIPT="$ROOT/deploy/vm/build-image.sh"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SUITE="${BCD_VM_SUITE:-bookworm}"
CACHE="${BCD_VM_CACHE:-$ROOT/.scratch/vm-cache}"
# the guest's python3 must be the CPython minor the wheels are built for (3.11 on bookworm);
# polkitd (with libpam-systemd: it provides the logind polkitd depends on, which debootstrap
# does not resolve) decides what an ordinary user may ask systemd: the VM suite checks that
# bcd-inventory may ask it nothing (its DRA sharing units go through bcd-sharing.socket)
PACKAGES="systemd,systemd-sysv,udev,dbus,kmod,linux-image-amd64,initramfs-tools,zstd,python3,python3-venv,iproute2,procps,pciutils,acl,libpam-systemd,polkitd"
# the ext4 image: what the rootfs holds plus this much room for the tests' writes (sparse)
FREE_MB="${BCD_VM_FREE_MB:-2048}"

say() { echo "vm-image: $*" >&2; }
cannot() { say "$*"; exit 3; }
hash_of() { sha256sum | cut -c1-16; }
section() { sed -n "/^# ---- $1 begin/,/^# ---- $1 end/p" "$SCRIPT"; }
need_root() { [ "$(id -u)" = 0 ] || cannot "building the $1 layer needs root (debootstrap, chroot)"; }
mirror() {
    # the mirror apt already uses on this host, else Debian's own (as deploy/images/build.sh)
    local uri
    uri="$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | grep -v security | head -1 | awk '{print $2}')" || true
    echo "${uri:-http://deb.debian.org/debian}"
}
# unmount whatever a (failed) chroot step left mounted below $1, deepest first
umount_below() {
    local dir
    dir="$(realpath "$1")"
    awk -v d="$dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done
}
remove_tree() { [ -e "$1" ] || return 0; umount_below "$1"; rm -rf --one-file-system "$1"; }
# keep the newest $2 dirs matching $1 (and the current one, $3); a guest may still boot an older image
prune() {
    local keep="$2" current="$3" d
    { ls -1dt "$CACHE"/$1 2>/dev/null || true; } | { grep -vxF "$current" || true; } | tail -n +"$keep" | while read -r d; do
        say "pruning $d"
        remove_tree "$d"
    done
}
in_root() { chroot "$1" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "${@:2}"; }

mkdir -p "$CACHE"
CACHE="$(realpath "$CACHE")"
exec 9>"$CACHE/.lock"
flock -w 3600 9 || { say "another build holds $CACHE/.lock"; exit 1; }
[ -x "$PY" ] || cannot "no $PY (make venv), needed to build the wheels"
T_ALL=$SECONDS

# ---- base begin
BASE_KEY="$(printf '%s\n' "$SUITE" "$PACKAGES" "$(section base)" | hash_of)"
BASE="$CACHE/base-$BASE_KEY"
if [ -f "$BASE/.complete" ]; then
    say "base $BASE_KEY cached"
else
    need_root base
    command -v debootstrap >/dev/null || cannot "debootstrap not found (apt-get install debootstrap)"
    t0=$SECONDS
    remove_tree "$BASE"
    mkdir -p "$BASE"
    R="$BASE/rootfs"
    trap 'umount_below "$BASE"' EXIT
    say "debootstrap $SUITE from $(mirror): first stage (downloads, unpacks; a few minutes)"
    debootstrap --foreign --variant=minbase --include="$PACKAGES" "$SUITE" "$R" "$(mirror)" >"$BASE/debootstrap.log" 2>&1 \
        || { tail -20 "$BASE/debootstrap.log" >&2
             grep -qiE "couldn't download|failed getting release|temporary failure|could not resolve|connection (refused|timed out)" "$BASE/debootstrap.log" \
                 && cannot "debootstrap could not reach $(mirror): log $BASE/debootstrap.log"
             say "debootstrap (first stage) failed: log $BASE/debootstrap.log"; exit 1; }
    # the packages' maintainer scripts call systemd-tmpfiles --create; in this chroot that
    # would be the build host's kernel, with /proc and /sys mounted: a no-op instead, first
    # on the PATH debootstrap gives them (/sbin:/usr/sbin:/bin:/usr/bin; /sbin is usr/sbin,
    # the real one is /bin, i.e. usr/bin); the guest's systemd-tmpfiles-setup.service
    # creates the same at boot
    SHIM="$R/usr/sbin/systemd-tmpfiles"
    [ -d "$R/usr/sbin" ] && [ -L "$R/sbin" ] || { say "no merged /usr in $R: the systemd-tmpfiles shim would not come first"; exit 1; }
    cat >"$SHIM" <<'SHIM'
#!/bin/sh
# deploy/vm/build-image.sh: no systemd-tmpfiles on the build host (the guest runs it at boot)
echo "skipped: systemd-tmpfiles $*" >>/var/log/bcd-vm-build.log
exit 0
SHIM
    chmod 0755 "$SHIM"
    say "debootstrap second stage in a chroot (configures the packages)"
    in_root "$R" /debootstrap/debootstrap --second-stage >>"$BASE/debootstrap.log" 2>&1 \
        || { umount_below "$BASE"; tail -30 "$BASE/debootstrap.log" >&2; say "debootstrap (second stage) failed: log $BASE/debootstrap.log"; exit 1; }
    umount_below "$BASE"
    rm -f "$SHIM"
    # the shim was called, and the real one was not (systemd-network.conf makes /run/systemd/netif)
    grep -q 'skipped: systemd-tmpfiles' "$R/var/log/bcd-vm-build.log" 2>/dev/null && [ ! -e "$R/run/systemd/netif" ] \
        || { say "systemd-tmpfiles ran past the shim: see $R/var/log/bcd-vm-build.log"; exit 1; }
    ls "$R"/boot/vmlinuz-* "$R"/boot/initrd.img-* >/dev/null 2>&1 \
        || { say "no kernel or initramfs in $R/boot"; exit 1; }
    # what a test guest never reads: package caches, docs, man pages, locales
    rm -rf "$R"/var/cache/apt/* "$R"/var/lib/apt/lists/* "$R"/usr/share/doc/* \
        "$R"/usr/share/man/* "$R"/usr/share/info/*
    find "$R/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} + 2>/dev/null || true
    trap - EXIT
    touch "$BASE/.complete"
    say "base $BASE_KEY built in $((SECONDS - t0)) s"
fi
# ---- base end

# ---------------------------------------------------------------- wheels
# built from a copy of the sources: pip and setuptools write build/ and *.egg-info there
SRC="$(mktemp -d "$CACHE/src.XXXXXX")"
trap 'rm -rf "$SRC"' EXIT
# the packages the wheel holds, as pyproject.toml lists them (one list: a package added there
# is copied here too; the VM image once lacked controlplane/, which only this copy missed)
read -r -a PACKAGES <<<"$("$PY" -c 'import tomllib; c = tomllib.load(open("pyproject.toml", "rb")); print(" ".join(p.rstrip("*") for p in c["tool"]["setuptools"]["packages"]["find"]["include"]))')"
[ "${#PACKAGES[@]}" -gt 0 ] || cannot "no packages in pyproject.toml [tool.setuptools.packages.find] include"
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' -cf - pyproject.toml README.md "${PACKAGES[@]}" | tar -C "$SRC" -xf -
EXTRA=""
pkg-config --exists libsystemd 2>/dev/null && EXTRA="[systemd]"   # pystemd builds against libsystemd
DEPS_KEY="$( { cat pyproject.toml; "$PY" -c 'import sys; print(sys.version_info[:2])'; echo "$EXTRA"; } | hash_of)"
DEPS="$CACHE/wheels-$DEPS_KEY"
if [ -f "$DEPS/.complete" ]; then
    say "dependency wheels cached (wheels-$DEPS_KEY)"
else
    t0=$SECONDS
    rm -rf "$DEPS" && mkdir -p "$DEPS"
    [ -n "$EXTRA" ] || say "no libsystemd (libsystemd-dev, pkg-config): the guest gets no pystemd (no real slice backend)"
    "$PY" -m pip wheel -q --wheel-dir "$DEPS" "$SRC$EXTRA" >"$CACHE/wheels.log" 2>&1 \
        || { tail -20 "$CACHE/wheels.log" >&2; say "pip wheel failed: log $CACHE/wheels.log"; exit 1; }
    rm -f "$DEPS"/bcd-*.whl
    touch "$DEPS/.complete"
    say "dependency wheels built in $((SECONDS - t0)) s"
fi
APP="$SRC/app"
"$PY" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$APP" "$SRC" >"$CACHE/app.log" 2>&1 \
    || { tail -20 "$CACHE/app.log" >&2; say "pip wheel (bcd) failed: log $CACHE/app.log"; exit 1; }
# the wheel's content, not its bytes (a zip stamps times): every file's digest, sorted
APP_SUM="$("$PY" - "$APP"/bcd-*.whl <<'PYEOF'
import hashlib, sys, zipfile
h = hashlib.sha256()
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in sorted(z.namelist()):
        h.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
print(h.hexdigest())
PYEOF
)"

# ---- sys begin
SYS_KEY="$(printf '%s\n' "$BASE_KEY" "$DEPS_KEY" "$(section sys)" | hash_of)"
SYS="$CACHE/sys-$SYS_KEY"
if [ -f "$SYS/.complete" ]; then
    say "system layer $SYS_KEY cached"
else
    need_root sys
    t0=$SECONDS
    remove_tree "$SYS"
    mkdir -p "$SYS"
    R="$SYS/rootfs"
    trap 'rm -rf "$SRC"; umount_below "$SYS"' EXIT
    cp -a "$BASE/rootfs" "$R"
    guest_py="$(in_root "$R" python3 -c 'import sys; print(sys.version_info[:2])')"
    host_py="$("$PY" -c 'import sys; print(sys.version_info[:2])')"
    [ "$guest_py" = "$host_py" ] || { say "the guest's python3 is $guest_py, the wheels are for $host_py"; exit 1; }
    echo bcd-vm >"$R/etc/hostname"
    printf '127.0.0.1\tlocalhost\n127.0.1.1\tbcd-vm\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$R/etc/hosts"
    # the root file system: /dev/vda, no fsck (a fresh image, and slow under emulation)
    printf '/dev/vda\t/\text4\trw,errors=remount-ro\t0\t0\n' >"$R/etc/fstab"
    # what systemd.unit= on the kernel command line boots anyway (systemd-analyze then agrees)
    ln -sf /lib/systemd/system/multi-user.target "$R/etc/systemd/system/default.target"
    # no timers firing in the middle of a test (they cost minutes under emulation)
    # nor an LVM snapshot scrub at boot (e2scrub_reap: 6 s of a 30 s boot)
    for u in apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer e2scrub_all.timer fstrim.timer e2scrub_reap.service; do
        ln -sf /dev/null "$R/etc/systemd/system/$u"
    done
    # root may log in on the serial console without a password (debugging by hand)
    sed -i 's/^root:[^:]*:/root::/' "$R/etc/shadow"
    # /opt/bcd/venv as docs/install.md makes it, the dependencies from the wheels built here
    mkdir -p "$R/tmp/bcd-wheels"
    cp "$DEPS"/*.whl "$R/tmp/bcd-wheels/"
    in_root "$R" python3 -m venv /opt/bcd/venv >"$SYS/venv.log" 2>&1 \
        && in_root "$R" sh -c '/opt/bcd/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/bcd-wheels /tmp/bcd-wheels/*.whl' >>"$SYS/venv.log" 2>&1 \
        || { tail -20 "$SYS/venv.log" >&2; say "the venv's install failed: log $SYS/venv.log"; exit 1; }
    rm -rf "$R/tmp/bcd-wheels" "$R/root/.cache"
    trap 'rm -rf "$SRC"' EXIT
    touch "$SYS/.complete"
    say "system layer $SYS_KEY built in $((SECONDS - t0)) s"
fi
# ---- sys end

# ---------------------------------------------------------------- image
TREES_SUM="$(find docs deploy -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum | hash_of)"
KEY="$(printf '%s\n' "$SYS_KEY" "$APP_SUM" "$TREES_SUM" "$(cat "$SCRIPT")" | hash_of)"
IMG="$CACHE/image-$KEY"
if [ -f "$IMG/.complete" ]; then
    say "image $KEY cached"
else
    need_root image
    # the version read whole before it is matched: `mkfs.ext4 -V | grep -q` under pipefail failed
    # whenever grep quit before mkfs.ext4 wrote its second line (SIGPIPE), and the VM suites
    # skipped as if mkfs.ext4 were too old (seen in a fresh-clone CI run)
    mkfs_version="$(mkfs.ext4 -V 2>&1 || true)"
    [[ "$mkfs_version" =~ mke2fs\ 1\.(4[3-9]|[5-9]) ]] || cannot "mkfs.ext4 from e2fsprogs 1.43+ needed (mkfs.ext4 -d); it says: ${mkfs_version%%$'\n'*}"
    t0=$SECONDS
    remove_tree "$IMG"
    mkdir -p "$IMG"
    # the system layer's files hard-linked, not copied: only new files are written below
    S="$IMG/stage"
    trap 'rm -rf "$SRC"; remove_tree "$S"' EXIT
    cp -al "$SYS/rootfs" "$S"
    mkdir -p "$S/tmp/bcd-app"
    cp "$APP"/bcd-*.whl "$S/tmp/bcd-app/"
    in_root "$S" sh -c '/opt/bcd/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/bcd-app/bcd-*.whl && /opt/bcd/venv/bin/pip check' >"$IMG/install.log" 2>&1 \
        || { tail -20 "$IMG/install.log" >&2; say "bcd's install failed: log $IMG/install.log"; exit 1; }
    rm -rf "$S/tmp/bcd-app" "$S/root/.cache"
    # /opt/bcd/src: what docs/install.md and the units refer to; the wheels, for a test
    # that installs as docs/install.md does (pip install --no-index --find-links)
    mkdir -p "$S/opt/bcd/src" "$S/opt/bcd/wheels"
    tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' --owner=0 --group=0 -cf - docs deploy | tar -C "$S/opt/bcd/src" -xf -
    cp "$DEPS"/*.whl "$APP"/bcd-*.whl "$S/opt/bcd/wheels/"
    # the command agent (tests/vm/qemu.py talks to it over virtio-serial)
    install -D -m 0755 deploy/vm/guest/bcd-vm-agent.py "$S/usr/local/lib/bcd-vm/bcd-vm-agent.py"
    install -D -m 0644 deploy/vm/guest/bcd-vm-agent.service "$S/etc/systemd/system/bcd-vm-agent.service"
    install -D -m 0644 deploy/vm/guest/90-bcd-vm-agent.rules "$S/etc/udev/rules.d/90-bcd-vm-agent.rules"
    mkdir -p "$S/etc/systemd/system/multi-user.target.wants"
    ln -s ../bcd-vm-agent.service "$S/etc/systemd/system/multi-user.target.wants/bcd-vm-agent.service"
    kver="$(basename "$(ls -1 "$S"/boot/vmlinuz-* | sort -V | tail -1)")"
    kver="${kver#vmlinuz-}"
    cp "$S/boot/vmlinuz-$kver" "$IMG/vmlinuz"
    cp "$S/boot/initrd.img-$kver" "$IMG/initrd.img"
    used_mb="$(du -sm "$S" | cut -f1)"
    size_mb=$(( (used_mb + FREE_MB + 255) / 256 * 256 ))
    truncate -s "${size_mb}M" "$IMG/disk.raw.tmp"
    mkfs.ext4 -q -F -L bcd-root -d "$S" "$IMG/disk.raw.tmp" >"$IMG/mkfs.log" 2>&1 \
        || { tail -20 "$IMG/mkfs.log" >&2; say "mkfs.ext4 -d failed: log $IMG/mkfs.log"; exit 1; }
    mv "$IMG/disk.raw.tmp" "$IMG/disk.raw"
    remove_tree "$S"
    trap 'rm -rf "$SRC"' EXIT
    "$PY" - "$IMG" "$KEY" "$kver" "$SUITE" "$PACKAGES" "$size_mb" "$used_mb" "$EXTRA" "$BASE_KEY" "$SYS_KEY" <<'PYEOF'
import json, os, sys
img, key, kver, suite, packages, size_mb, used_mb, extra, base_key, sys_key = sys.argv[1:]
disk = os.path.join(img, "disk.raw")
json.dump({
    "key": key, "base_key": base_key, "sys_key": sys_key, "suite": suite, "kernel": kver,
    "packages": packages.split(","), "pystemd": extra == "[systemd]",
    "disk": "disk.raw", "kernel_image": "vmlinuz", "initrd": "initrd.img",
    "disk_size_mb": int(size_mb), "rootfs_used_mb": int(used_mb),
    "disk_allocated_mb": round(os.stat(disk).st_blocks * 512 / 2**20, 1),
    "root": "/dev/vda", "agent_port": "org.bcd.agent",
}, open(os.path.join(img, "manifest.json"), "w"), indent=2)
PYEOF
    touch "$IMG/.complete"
    say "image $KEY built in $((SECONDS - t0)) s ($size_mb MiB ext4, kernel $kver)"
    prune 'image-*' 2 "$IMG"
    prune 'sys-*' 2 "$SYS"
    prune 'base-*' 2 "$BASE"
    prune 'wheels-*' 2 "$DEPS"
fi
ln -sfn "$(basename "$IMG")" "$CACHE/latest"
say "done in $((SECONDS - T_ALL)) s"
echo "$IMG"
