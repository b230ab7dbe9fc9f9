#!/usr/bin/env bash
# Headless Chromium for kvstack's browser tests (tests/serve/test_web_ui_browser.py).
#
#   scripts/chromium.sh ensure    install chromium + chromium-driver from Debian packages
#                                 if /usr/bin/chromium or /usr/bin/chromedriver is missing
#
# `make pytest` runs `ensure`; the tests drive the browser with Selenium pointed at
# /usr/bin/chromedriver (never a browser or driver download), headless, one at a time.
set -euo pipefail

have() {
    command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1
}

ensure() {
    if have; then
        return 0
    fi
    echo "chromium or chromedriver not found: installing them from Debian packages" >&2
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
            echo "error: chromium is missing and this user cannot install it;" \
                 "run: apt-get install chromium chromium-driver" >&2
            exit 1
        fi
    else
        SUDO=
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! $SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null; then
        $SUDO apt-get update -qq
        $SUDO apt-get install -y --no-install-recommends chromium chromium-driver >/dev/null
    fi
    have
}

case "${1:-}" in
    ensure) ensure ;;
    *) echo "usage: scripts/chromium.sh ensure" >&2; exit 2 ;;
esac
