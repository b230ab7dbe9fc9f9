#!/usr/bin/env bash
# Prometheus for the dashboard test (tests/deploy/test_dashboards.py) and local use.
#
#   scripts/prometheus.sh ensure   install Debian's prometheus package if missing, without
#                                  leaving its packaged daemon running (policy-rc.d denies
#                                  service starts during the install; any started one is
#                                  stopped)
#
# The test then runs its own `prometheus --web.listen-address=127.0.0.1:PORT` on a free
# loopback port with a scrape config of its own, and stops it.
set -euo pipefail

ensure() {
    if command -v prometheus >/dev/null 2>&1; then
        return 0
    fi
    echo "prometheus not found: installing it from Debian packages" >&2
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
            echo "error: prometheus is missing and this user cannot install it;" \
                 "run: apt-get install prometheus" >&2
            exit 1
        fi
    else
        SUDO=
    fi
    export DEBIAN_FRONTEND=noninteractive
    local policy=/usr/sbin/policy-rc.d created=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
        $SUDO chmod +x "$policy"
        created=1
    fi
    if ! $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends prometheus >/dev/null
    fi
    if [ "$created" = 1 ]; then $SUDO rm -f "$policy"; fi
    # Whatever the init system did, no packaged daemon stays up.
    if command -v service >/dev/null 2>&1; then
        $SUDO service prometheus stop >/dev/null 2>&1 || true
    fi
    command -v prometheus >/dev/null
}

case "${1:-}" in
    ensure) ensure ;;
    *) echo "usage: scripts/prometheus.sh ensure" >&2; exit 2 ;;
esac
