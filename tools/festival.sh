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
# Depends closure through lib* and festlex-* packages; ~26 MB unpacked on Debian 12), by
# tools/debunpack.sh. Errors: one line on stderr naming what is missing, exit 1.
set -euo pipefail

VOICE=ked_diphone
tools=${BASH_SOURCE[0]%/*}; [ "$tools" != "${BASH_SOURCE[0]}" ] || tools=.  # this folder, without dirname
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

fetch() {
  local dir=$1
  if works "$dir"; then echo "$dir"; return 0; fi
  "$BASH" "$tools/debunpack.sh" Festival "$dir" festival "${PACKAGES[@]}" || exit 1
  works "$dir" || die "festival in $dir does not run the $VOICE voice: $( (run "$dir" -b "(voice_$VOICE)") 2>&1 | tail -1)"
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
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//';;
  *) die "usage: festival.sh fetch [DIR] | run DIR ARGS... | say DIR TEXT OUT.wav";;
esac
