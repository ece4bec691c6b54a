#!/usr/bin/env bash
# Debian's chromium with its matching chromium-driver (the same version: drivers from PyPI do not
# match it), for the web page's tests. Needs root and apt; does nothing when both are installed.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install_browser: needs root and apt-get to install chromium and chromium-driver" >&2; exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium chromium-driver >/dev/null
/usr/bin/chromedriver --version
