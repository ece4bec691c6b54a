#!/usr/bin/env bash
# Debian packages unpacked into a folder of their own, nothing installed: the programs that the synth
# recipe speaks with beside eSpeak (tools/festival.sh: Festival and its ked voice; tools/flite.sh:
# Flite and its voices).
#
#   tools/debunpack.sh NAME DIR BINARY PACKAGE...
#
# downloads (apt-get download) the packages and the closure of their lib* and festlex-* dependencies
# that this system lacks (one apt-cache call per level, ~1 s each), unpacks them (dpkg-deb -x) into
# DIR/root, writes DIR/libpath (every folder there that holds a shared library, for LD_LIBRARY_PATH)
# and checks that DIR/root/usr/bin/BINARY finds all its libraries. Needs apt-get with package lists
# (as root it runs `apt-get update` once when the packages are not found) and dpkg-deb. NAME names
# the program in the errors: one line on stderr ("NAME.sh: cannot fetch NAME into DIR: ..."), exit 1.
set -euo pipefail

[ $# -ge 4 ] || { echo "usage: debunpack.sh NAME DIR BINARY PACKAGE..." >&2; exit 2; }
name=$1 dir=$2 binary=$3; shift 3
packages=("$@")
die() { echo "${name,,}.sh: cannot fetch $name into $dir: $*" >&2; exit 1; }

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

depends_needed() {  # PACKAGE... -> their Depends this system lacks, of the kinds the programs need at run time
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances \
    "$@" 2>/dev/null | awk '/^ *\|?Depends: /{ alt = ($1 ~ /^\|/); print $2, alt }' | {
    local group=() name alt
    while read -r name alt; do
      group+=("$name")
      [ "$alt" = 1 ] && continue  # an alternative: the group goes on
      local member chosen="" satisfied=0
      for member in "${group[@]}"; do
        if installed "$member"; then satisfied=1; break; fi
        [[ $member == \<* ]] && continue  # a virtual package
        [[ $member == lib* || $member == festlex-* ]] && [ -z "$chosen" ] && chosen=$member
      done
      [ $satisfied = 0 ] && [ -n "$chosen" ] && echo "$chosen"
      group=()
    done
  }
}

command -v apt-get >/dev/null && command -v apt-cache >/dev/null ||
  die "no apt-get (a Debian or Ubuntu system is needed, or install ${packages[*]})"
command -v dpkg-deb >/dev/null || die "no dpkg-deb"
if ! apt-cache show "${packages[@]}" >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || die "apt knows no ${packages[*]}: run apt-get update (as root), then this again"
  echo "${name,,}.sh: apt-get update (the package lists lack ${packages[*]})" >&2
  apt-get update -qq >/dev/null 2>&1 || die "apt-get update failed"
  apt-cache show "${packages[@]}" >/dev/null 2>&1 || die "apt knows no ${packages[*]} (not in this system's sources)"
fi
level=("${packages[@]}") seen=" "
while [ ${#level[@]} -gt 0 ]; do  # breadth first
  for p in "${level[@]}"; do seen+="$p "; done
  next=()
  for p in $(depends_needed "${level[@]}" | sort -u); do [[ $seen == *" $p "* ]] || next+=("$p"); done
  level=("${next[@]}")
done
read -r -a wanted <<<"$seen"
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/debs" "$tmp/root"
(cd "$tmp/debs" && apt-get download "${wanted[@]}" >/dev/null 2>"$tmp/apt.err") ||
  die "apt-get download ${wanted[*]}: $(grep -m1 -E '^E:' "$tmp/apt.err" || tail -1 "$tmp/apt.err")"
for deb in "$tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$tmp/root" || die "dpkg-deb -x $deb failed"; done
find "$tmp/root" -name '*.so*' \( -type f -o -type l \) -printf '%h\n' | sort -u |
  sed "s|^$tmp/root|$dir/root|" | paste -sd: >"$tmp/libpath"
rm -rf "$dir/root" "$dir/libpath"
mv "$tmp/root" "$dir/root" && mv "$tmp/libpath" "$dir/libpath"
missing=$(LD_LIBRARY_PATH=$(cat "$dir/libpath") ldd "$dir/root/usr/bin/$binary" 2>/dev/null |
  awk '/not found/{print $1}' | paste -sd' ' || true)
[ -z "$missing" ] || die "$binary still lacks $missing (unpacked: ${wanted[*]})"
echo "${name,,}.sh: unpacked ${wanted[*]} into $dir" >&2
