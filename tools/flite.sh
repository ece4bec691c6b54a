#!/usr/bin/env bash
# CMU Flite with its voices (Debian's flite: kal16, a male American diphone voice, and awb, rms and
# slt, statistical parametric voices, all at 16 kHz), unpacked into a folder of its own: nothing is
# installed. The synth recipe's training speech from a second synthesizer (recipes/synth/local/flite.py)
# speaks with it.
#
#   tools/flite.sh fetch [DIR]              download and unpack flite and libflite1 (tools/debunpack.sh)
#                                           into DIR unless a flite with those voices runs there
#                                           already; prints DIR
#   tools/flite.sh run DIR ARGS...          run DIR's flite (else the system's) with ARGS, e.g.
#                                           -voice slt -t "some text" -o out.wav
#
# DIR: $ASR_FLITE_DIR, else ~/.cache/asr-flite (~6 MB unpacked on Debian 12). Errors: one line on
# stderr naming what is missing, exit 1.
set -euo pipefail

VOICES=(kal16 awb rms slt)
tools=${BASH_SOURCE[0]%/*}; [ "$tools" != "${BASH_SOURCE[0]}" ] || tools=.  # this folder, without dirname
die() { echo "flite.sh: $*" >&2; exit 1; }

run() {  # DIR ARGS...: DIR's flite, else the system's
  local dir=$1; shift
  if [ -x "$dir/root/usr/bin/flite" ]; then
    local libs; libs=$(cat "$dir/libpath" 2>/dev/null || true)
    LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$dir/root/usr/bin/flite" "$@"
  fi
  command -v flite >/dev/null || die "no flite in $dir (run: tools/flite.sh fetch $dir) nor on PATH"
  exec flite "$@"
}

works() {  # DIR: does a flite (DIR's or the system's) list every voice? (quietly)
  local out v; out=$( (run "$1" -lv) 2>&1 || true)
  for v in "${VOICES[@]}"; do [[ " $out " == *" $v "* ]] || return 1; done
}

fetch() {
  local dir=$1
  if works "$dir"; then echo "$dir"; return 0; fi
  "$BASH" "$tools/debunpack.sh" Flite "$dir" flite flite libflite1 || exit 1
  works "$dir" || die "flite in $dir lacks some of the voices ${VOICES[*]}: $( (run "$dir" -lv) 2>&1 | tail -1)"
  echo "$dir"
}

cmd=${1:-}; [ $# -gt 0 ] && shift
case $cmd in
  fetch) fetch "${1:-${ASR_FLITE_DIR:-$HOME/.cache/asr-flite}}";;
  run) [ $# -ge 1 ] || die "usage: flite.sh run DIR ARGS..."; run "$@";;
  -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//';;
  *) die "usage: flite.sh fetch [DIR] | run DIR ARGS...";;
esac
