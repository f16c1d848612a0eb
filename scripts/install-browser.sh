#!/usr/bin/env bash
# Headless Chromium and its WebDriver for tests/test_pages.py, from Debian's own packages (the
# pages' tests drive a real browser; Selenium is told to use this driver and downloads nothing).
# Does nothing when both are already there. Needs root (CI runs `make test` as root).
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    # Not root: the other tests still run, and tests/test_pages.py fails saying what is missing.
    echo "install-browser: chromium/chromedriver missing and not root:" \
         "sudo apt-get install --no-install-recommends chromium chromium-driver" >&2
    exit 0
fi
start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends chromium chromium-driver
echo "install-browser: chromium and chromium-driver installed in $(( $(date +%s) - start )) s"
