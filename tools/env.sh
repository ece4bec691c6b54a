# Source this file to get the project's virtual environment in .venv, created and installed when
# missing, and reinstalled when setup.py changed since the last install.
#   . tools/env.sh            (from the project root or anywhere)
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_venv=$_root/.venv
_stamp=$_venv/.installed-setup-py
_want=$(cat "$_root/setup.py" | sha256sum | cut -d' ' -f1)
if [ ! -x "$_venv/bin/python" ] || [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
  echo "== setting up $_venv (torch and friends; a few minutes the first time)" >&2
  [ -x "$_venv/bin/python" ] || python3 -m venv "$_venv" || return 1 2>/dev/null || exit 1
  "$_venv/bin/python" -m pip install -q --upgrade pip >&2 &&
  "$_venv/bin/python" -m pip install -q -e "$_root[dev,synth,serve,export]" >&2 &&
  echo "$_want" > "$_stamp" || { echo "error: installing the project into $_venv failed" >&2; return 1 2>/dev/null || exit 1; }
fi
. "$_venv/bin/activate"
unset _root _venv _stamp _want
