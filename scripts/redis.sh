#!/usr/bin/env bash
# Redis for kvstack's shared KV tier (--kv-offload redis://...) and its tests.
#
#   scripts/redis.sh ensure            install redis-server from Debian packages if missing
#   scripts/redis.sh start PORT [DIR]  run redis-server in the foreground on 127.0.0.1:PORT
#
# `make test` runs `ensure`; the tests start (and kill, and restart) their own servers
# with `start` on free loopback ports, so nothing relies on a service already running.
# Servers started here keep no snapshot (pure cache) and evict least-recently-used keys
# past maxmemory (KVSTACK_REDIS_MAXMEMORY, default 256mb): the tier's size limit.
set -euo pipefail

ensure() {
    if command -v redis-server >/dev/null 2>&1; then
        return 0
    fi
    echo "redis-server not found: installing it from Debian packages" >&2
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
            echo "error: redis-server is missing and this user cannot install it;" \
                 "run: apt-get install redis-server" >&2
            exit 1
        fi
    else
        SUDO=
    fi
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d may or may not stop the package from starting a system service; either
    # way the tests use their own servers on other ports.
    if ! $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends redis-server >/dev/null
    fi
    command -v redis-server >/dev/null
}

start() {
    local port="${1:?usage: scripts/redis.sh start PORT [DIR]}"
    local dir="${2:-$(mktemp -d -t kvstack-redis.XXXXXX)}"
    ensure
    mkdir -p "$dir"
    exec redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" \
        --save "" --appendonly no --protected-mode yes \
        --maxmemory "${KVSTACK_REDIS_MAXMEMORY:-256mb}" --maxmemory-policy allkeys-lru \
        --loglevel warning
}

case "${1:-}" in
    ensure) ensure ;;
    start) shift; start "$@" ;;
    *) echo "usage: scripts/redis.sh ensure | start PORT [DIR]" >&2; exit 2 ;;
esac
