# Sourced by tools/asterisk.sh, pico.sh and rhvoice.sh after they set:
#   NAME     the script's name without .sh (messages, usage)
#   WHAT     what it unpacks, for the line said when done
#   DIR_VAR  the variable naming DIR (else ~/.cache/asr-NAME)
#   DEBS     "POOL-PATH SHA256" of each package (tools/debpinned.sh)
#   FILES    what must be under DIR/root once unpacked
#   AMD64    (optional) the package that is amd64-only: another machine is told so
# It answers `NAME.sh fetch [DIR]` (download and unpack unless there; prints DIR) and --help (the
# calling script's header).
die() { echo "$NAME.sh: $*" >&2; exit 1; }

there() { local f; for f in "${FILES[@]}"; do [ -f "$1/root/$f" ] || return 1; done; }

fetch() {
  local dir=$1 tools=${BASH_SOURCE[0]%/*}
  [ "$tools" != "${BASH_SOURCE[0]}" ] || tools=.  # this folder, without dirname
  if there "$dir"; then echo "$dir"; return 0; fi
  [ -z "${AMD64:-}" ] || [ "$(uname -m)" = x86_64 ] ||
    die "the pinned $AMD64 is Debian's amd64 build; this machine is $(uname -m)"
  "$BASH" "$tools/debpinned.sh" "$NAME" "$dir" "${DEBS[@]}" || exit 1
  there "$dir" || die "$dir lacks some of ${FILES[*]} after unpacking"
  echo "$NAME.sh: $WHAT unpacked into $dir" >&2
  echo "$dir"
}

cmd=${1:-}; [ $# -gt 0 ] && shift
case $cmd in
  fetch) fetch "$(realpath -m "${1:-${!DIR_VAR:-$HOME/.cache/asr-$NAME}}")";;
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0";;
  *) die "usage: $NAME.sh fetch [DIR]";;
esac
