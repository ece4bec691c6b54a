#!/usr/bin/env bash
# MBROLA's diphone synthesizer with its English voices (us1 female, us2 and us3 male American, en1
# male British; 16 kHz), driven by Debian's espeak-ng (eSpeak chooses the phonemes and prosody,
# MBROLA makes the sound), unpacked into a folder of its own: nothing is installed. The synth
# recipe's training speech from a third synthesizer (recipes/synth/local/mbrola.py) speaks with it.
#
#   tools/mbrola.sh fetch [DIR]     unpack espeak-ng and espeak-ng-data (tools/debunpack.sh, Debian main)
#                                   and mbrola and mbrola-{us1,us2,us3,en1} (Debian's contrib and
#                                   non-free, pinned by SHA-256: tools/debpinned.sh) into DIR unless
#                                   they speak there already; prints DIR
#   tools/mbrola.sh run DIR ARGS... DIR's espeak-ng with the voices, e.g. -v mb-us2 -s 160 -w out.wav "SOME TEXT"
#   tools/mbrola.sh mbrola DIR ARGS...  DIR's mbrola program itself, e.g. -e VOICE_DB in.pho out.wav
#                                   (VOICE_DB: DIR/root/usr/share/mbrola/us2/us2)
#
# DIR: $ASR_MBROLA_DIR, else ~/.cache/asr-mbrola (~43 MB). The voices are Debian non-free: their
# licence (DIR/root/usr/share/doc/mbrola-*/copyright) allows speech with the MBROLA program only, and
# no sale, nor use in a product that is sold, without the database owner's permission; mind that for
# a model trained on their speech. Errors: one line on stderr naming what is missing, exit 1.
set -euo pipefail

VOICES=(us1 us2 us3 en1)
DEBS=(  # path under the mirror, SHA-256 (Debian 12 and 13 carry these same files)
  "pool/contrib/m/mbrola/mbrola_3.3+dfsg-9_amd64.deb d94ea5bbb8b201935e8a40d758f1a224030d13a1ba669cc75293823933554c7f"
  "pool/non-free/m/mbrola-us1/mbrola-us1_0.3+repack2-5_all.deb b3284caecfc47023bca46550c5f7cde2f4e8cb4ac3b60840ff8784914c7c85fd"
  "pool/non-free/m/mbrola-us2/mbrola-us2_0.1+repack2-5_all.deb ea95d89157e420b119f078853ddf27383b4cb4c607581c64b0f9079d5ee3f5dc"
  "pool/non-free/m/mbrola-us3/mbrola-us3_0.1+repack2-4_all.deb f8a4e75acc914a58fb7c85ffc3bbea48f0dc2c13704fadd054101020e973c1c2"
  "pool/non-free/m/mbrola-en1/mbrola-en1_19980910+repack2-5_all.deb 1a94a61d15f1e6748563d2f15d12614b71df7c7e25370f433320e011fd1f5f63"
)
tools=${BASH_SOURCE[0]%/*}; [ "$tools" != "${BASH_SOURCE[0]}" ] || tools=.  # this folder, without dirname
die() { echo "mbrola.sh: $*" >&2; exit 1; }

data_of() {  # DIR -> the folder holding DIR's espeak-ng-data (espeak-ng --path)
  local d; d=$(find "$1/root/usr/lib" -maxdepth 2 -type d -name espeak-ng-data 2>/dev/null | head -1)
  [ -n "$d" ] && echo "${d%/espeak-ng-data}"
}

run() {  # DIR ARGS...
  local dir=$1; shift
  [ -x "$dir/root/usr/bin/espeak-ng" ] && [ -x "$dir/root/usr/bin/mbrola" ] ||
    die "no espeak-ng with MBROLA in $dir (run: tools/mbrola.sh fetch $dir)"
  local libs data; libs=$(cat "$dir/libpath" 2>/dev/null || true); data=$(data_of "$dir")
  # espeak-ng starts `mbrola` from PATH and reads each voice at <data>/espeak-ng-data/mbrola/<voice>
  PATH="$dir/root/usr/bin:$PATH" LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    exec "$dir/root/usr/bin/espeak-ng" --path="$data" "$@"
}

program() {  # DIR ARGS...: DIR's mbrola
  local dir=$1; shift
  [ -x "$dir/root/usr/bin/mbrola" ] || die "no mbrola in $dir (run: tools/mbrola.sh fetch $dir)"
  local libs; libs=$(cat "$dir/libpath" 2>/dev/null || true)
  LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$dir/root/usr/bin/mbrola" "$@"
}

works() {  # DIR: does every voice speak? (quietly)
  local v
  for v in "${VOICES[@]}"; do (run "$1" -v "mb-$v" -q "test") >/dev/null 2>&1 || return 1; done
}

fetch() {
  local dir=$1
  if works "$dir"; then echo "$dir"; return 0; fi
  "$BASH" "$tools/debunpack.sh" MBROLA "$dir" espeak-ng espeak-ng espeak-ng-data || exit 1
  "$BASH" "$tools/debpinned.sh" MBROLA "$dir" "${DEBS[@]}" || exit 1
  local v data
  data=$(data_of "$dir") || die "no espeak-ng-data unpacked in $dir/root/usr/lib"
  mkdir -p "$data/espeak-ng-data/mbrola"
  for v in "${VOICES[@]}"; do ln -sfn "$dir/root/usr/share/mbrola/$v/$v" "$data/espeak-ng-data/mbrola/$v"; done
  works "$dir" || die "espeak-ng in $dir cannot speak with every voice of ${VOICES[*]}: $( (run "$dir" -v mb-us1 -q test) 2>&1 | tail -1)"
  echo "mbrola.sh: MBROLA's voices ${VOICES[*]} unpacked into $dir" >&2
  echo "$dir"
}

cmd=${1:-}; [ $# -gt 0 ] && shift
case $cmd in
  fetch) fetch "$(realpath -m "${1:-${ASR_MBROLA_DIR:-$HOME/.cache/asr-mbrola}}")";;
  run) [ $# -ge 1 ] || die "usage: mbrola.sh run DIR ARGS..."; run "$@";;
  mbrola) [ $# -ge 1 ] || die "usage: mbrola.sh mbrola DIR ARGS..."; program "$@";;
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0";;
  *) die "usage: mbrola.sh fetch [DIR] | run DIR ARGS... | mbrola DIR ARGS...";;
esac
