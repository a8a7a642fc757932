#!/usr/bin/env bash
# A bcd node as containers on the example fake host (compose.yaml beside this file).
#
#   deploy/compose/node.sh up [DIR]     init DIR (default state/compose), start the node with
#                                       the upstream profile, apply examples/specs/demo.json,
#                                       print `bcd status`
#   deploy/compose/node.sh down [DIR]   stop and remove the containers (DIR is kept)
#   deploy/compose/node.sh compose [DIR] ARGS...   any compose command on that node
#
# Environment: BCD_COMPOSE_PROJECT (default bcd), BCD_BUS_PORT / BCD_BUS_HTTP_PORT /
# BCD_UPSTREAM_PORT (loopback ports, defaults 14222 / 18222 / 14223), BCD_NODE_ID,
# BCD_IMAGE (default bcd:latest, from `make images`), COMPOSE (default `docker compose`
# when that answers, else docker-compose). Run as root: init gives each container user
# its own files.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT="$PWD"
BIN="${BIN:-$ROOT/.venv/bin}"
action="${1:-up}"
shift || true
DIR="$(realpath -m "${1:-state/compose}")"
shift || true
PROJECT="${BCD_COMPOSE_PROJECT:-bcd}"
if [ -z "${COMPOSE:-}" ]; then
    if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else COMPOSE="docker-compose"; fi
fi
compose() { $COMPOSE --env-file "$DIR/.env" -p "$PROJECT" -f "$ROOT/deploy/compose/compose.yaml" --profile upstream "$@"; }

case "$action" in
up)
    "$BIN/bcd" compose init "$DIR" --node-id "${BCD_NODE_ID:-node-1}" \
        --bus-port "${BCD_BUS_PORT:-14222}" --http-port "${BCD_BUS_HTTP_PORT:-18222}" \
        --upstream-port "${BCD_UPSTREAM_PORT:-14223}" >/dev/null
    compose up -d --remove-orphans
    cp "$ROOT/examples/specs/demo.json" "$DIR/spec/demo.json"
    # the control plane's own container signs and puts the spec (its key never leaves it);
    # the upstream server may still be starting
    for i in $(seq 1 30); do
        if gen="$(compose exec -T controlplane python3 -m bcd.controlplane put /spec/demo.json 2>/dev/null)"; then
            echo "demo spec put: generation $gen"
            break
        fi
        [ "$i" = 30 ] && { echo "node.sh: the control plane could not put the demo spec" >&2; exit 1; }
        sleep 1
    done
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
    echo "usage: $0 up|down|compose [DIR] [ARGS...]" >&2
    exit 2
    ;;
esac
