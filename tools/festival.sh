#!/usr/bin/env bash
# Festival with its `ked_diphone` voice (Debian's festival and festvox-kdlpc16k: a male American
# diphone voice, 16 kHz), unpacked into a folder of its own: nothing is installed. The synth
# recipe's unseen-synthesizer dev set (recipes/synth/local/festival.py) speaks with it.
#
#   tools/festival.sh fetch [DIR]            download the packages (apt-get download) and unpack them
#                                            (dpkg-deb -x) into DIR unless a festival with ked runs
#                                            there already; prints DIR
#   tools/festival.sh run DIR ARGS...        run DIR's festival with ARGS (its libraries and Scheme
#                                            files found), e.g. -b script.scm
#   tools/festival.sh say DIR TEXT OUT.wav   speak TEXT with ked into a WAV, to listen to
#
# DIR: $ASR_FESTIVAL_DIR, else ~/.cache/asr-festival. When DIR holds no festival, `run` uses a system
# festival that has the ked voice (and `fetch` then downloads nothing). The packages: festival,
# festvox-kdlpc16k, and of their dependencies the libraries and lexicons this system lacks (the
# Depends closure through lib* and festlex-* packages; ~26 MB unpacked on Debian 12). Needs apt-get
# with package lists (as root, `fetch` runs `apt-get update` once when the packages are not found)
# and dpkg-deb. Errors: one line on stderr naming what is missing, exit 1.
set -euo pipefail

VOICE=ked_diphone
PACKAGES=(festival festvox-kdlpc16k)
die() { echo "festival.sh: $*" >&2; exit 1; }

festival_bin() {  # DIR -> the festival binary there, or nothing
  [ -x "$1/root/usr/bin/festival" ] && echo "$1/root/usr/bin/festival"
  return 0
}

run() {  # DIR ARGS...: DIR's festival, else the system's
  local dir=$1; shift
  local bin; bin=$(festival_bin "$dir")
  if [ -n "$bin" ]; then
    local libs; libs=$(cat "$dir/libpath" 2>/dev/null || true)
    LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$bin" \
      --libdir "$dir/root/usr/lib/festival" --datadir "$dir/root/usr/share/festival" "$@"
  fi
  command -v festival >/dev/null || die "no festival in $dir (run: tools/festival.sh fetch $dir) nor on PATH"
  exec festival "$@"
}

works() {  # DIR: does a festival (DIR's or the system's) speak with ked? (quietly)
  local out; out=$( (run "$1" -b "(voice_$VOICE)" '(print (string-append "ked" "-ok"))') 2>&1 || true)
  [[ $out == *ked-ok* ]]
}

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

depends_needed() {  # PACKAGE... -> their Depends this system lacks, of the kinds festival needs at run time
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

fetch() {
  local dir=$1
  if works "$dir"; then echo "$dir"; return 0; fi
  command -v apt-get >/dev/null && command -v apt-cache >/dev/null ||
    die "cannot fetch Festival into $dir: no apt-get (a Debian or Ubuntu system is needed, or install festival and festvox-kdlpc16k)"
  command -v dpkg-deb >/dev/null || die "cannot fetch Festival into $dir: no dpkg-deb"
  if ! apt-cache show "${PACKAGES[@]}" >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "apt knows no ${PACKAGES[*]}: run apt-get update (as root), then this again"
    echo "festival.sh: apt-get update (the package lists lack ${PACKAGES[*]})" >&2
    apt-get update -qq >/dev/null 2>&1 || die "apt-get update failed"
    apt-cache show "${PACKAGES[@]}" >/dev/null 2>&1 || die "apt knows no ${PACKAGES[*]} (not in this system's sources)"
  fi
  # the packages and the closure of their lib*/festlex-* dependencies that this system lacks
  # (breadth first: one apt-cache call per level, ~1 s each)
  local level=("${PACKAGES[@]}") seen=" " next p
  while [ ${#level[@]} -gt 0 ]; do
    for p in "${level[@]}"; do seen+="$p "; done
    next=()
    for p in $(depends_needed "${level[@]}" | sort -u); do [[ $seen == *" $p "* ]] || next+=("$p"); done
    level=("${next[@]}")
  done
  read -r -a wanted <<<"$seen"
  mkdir -p "$dir"
  tmp=$(mktemp -d "$dir/.fetch.XXXXXX")  # global: the EXIT trap removes it
  trap 'rm -rf "$tmp"' EXIT
  mkdir "$tmp/debs" "$tmp/root"
  (cd "$tmp/debs" && apt-get download "${wanted[@]}" >/dev/null 2>"$tmp/apt.err") ||
    die "apt-get download ${wanted[*]}: $(grep -m1 -E '^E:' "$tmp/apt.err" || tail -1 "$tmp/apt.err")"
  for deb in "$tmp"/debs/*.deb; do dpkg-deb -x "$deb" "$tmp/root" || die "dpkg-deb -x $deb failed"; done
  # every folder of the unpacked tree that holds a shared library, for LD_LIBRARY_PATH
  find "$tmp/root" -name '*.so*' \( -type f -o -type l \) -printf '%h\n' | sort -u |
    sed "s|^$tmp/root|$dir/root|" | paste -sd: >"$tmp/libpath"
  rm -rf "$dir/root" "$dir/libpath"
  mv "$tmp/root" "$dir/root" && mv "$tmp/libpath" "$dir/libpath"
  local missing; missing=$(LD_LIBRARY_PATH=$(cat "$dir/libpath") ldd "$dir/root/usr/bin/festival" 2>/dev/null |
    awk '/not found/{print $1}' | paste -sd' ' || true)
  [ -z "$missing" ] || die "festival in $dir still lacks $missing (unpacked: ${wanted[*]})"
  works "$dir" || die "festival in $dir does not run the $VOICE voice: $( (run "$dir" -b "(voice_$VOICE)") 2>&1 | tail -1)"
  echo "festival.sh: unpacked ${wanted[*]} into $dir" >&2
  echo "$dir"
}

say() {  # DIR TEXT OUT.wav
  local text=${2//[\"\\]/}
  run "$1" -b "(voice_$VOICE)" "(utt.save.wave (SynthText \"$text\") \"$3\" 'riff)"
}

cmd=${1:-}; [ $# -gt 0 ] && shift
default_dir=${ASR_FESTIVAL_DIR:-$HOME/.cache/asr-festival}
case $cmd in
  fetch) fetch "${1:-$default_dir}";;
  run) [ $# -ge 1 ] || die "usage: festival.sh run DIR ARGS..."; run "$@";;
  say) [ $# -eq 3 ] || die "usage: festival.sh say DIR TEXT OUT.wav"; say "$@";;
  -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//';;
  *) die "usage: festival.sh fetch [DIR] | run DIR ARGS... | say DIR TEXT OUT.wav";;
esac
