#!/usr/bin/env bash
# Debian packages that apt may not know (contrib and non-free are off on many systems) downloaded
# from a Debian mirror by pinned path and SHA-256, and unpacked into DIR/root: nothing installed.
# The training voices of tools/mbrola.sh and tools/pico.sh come this way.
#
#   tools/debpinned.sh NAME DIR "POOL-PATH SHA256"...
#
# The mirror: $ASR_DEBIAN_MIRROR, else http://deb.debian.org/debian. Downloads with curl, else
# python3. Errors: one line on stderr ("NAME.sh: ..."), exit 1; nothing unpacked then.
set -euo pipefail

[ $# -ge 3 ] || { echo "usage: debpinned.sh NAME DIR 'POOL-PATH SHA256'..." >&2; exit 2; }
name=$1 dir=$2; shift 2
mirror=${ASR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
die() { echo "${name,,}.sh: $*" >&2; exit 1; }
download() {  # URL OUT
  if command -v curl >/dev/null; then curl -fsSL -m 300 -o "$2" "$1"
  else python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$1" "$2"
  fi
}
command -v dpkg-deb >/dev/null || die "no dpkg-deb"
mkdir -p "$dir/root"
tmp=$(mktemp -d "$dir/.pinned.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for entry in "$@"; do
  read -r path sum <<<"$entry"
  deb=$tmp/${path##*/}
  download "$mirror/$path" "$deb" 2>/dev/null || die "cannot download $mirror/$path"
  [ "$(sha256sum "$deb" | cut -d' ' -f1)" = "$sum" ] || die "$mirror/$path: SHA-256 differs from the pinned one"
done
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$dir/root" || die "dpkg-deb -x $deb failed"; done
