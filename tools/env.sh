# Source this file to get an environment that runs the toolkit:
#   . tools/env.sh            (from the project root or anywhere)
# - An environment that already has PyTorch (a cluster module, a container, a conda or virtual
#   environment): when `${ASR_PYTHON:-python3}` imports torch, torchaudio and the requirements,
#   that python is used as it is: nothing is created or installed, the repository goes on
#   PYTHONPATH, and tools/bin (the `asr` command, and `python` for that interpreter) on PATH.
#   Our own .venv, when it exists and no other environment is active, is used first.
# - Otherwise the project's virtual environment in .venv, created and installed when missing, and
#   reinstalled when setup.py changed since the last install; where the python it starts from
#   already has torch and torchaudio, .venv sees them (--system-site-packages) and installs the rest.
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_venv=$_root/.venv
_stamp=$_venv/.installed-setup-py
_want=$(cat "$_root/setup.py" | sha256sum | cut -d' ' -f1)
_py=${ASR_PYTHON:-python3}
_mods="torch, torchaudio, soundfile, jiwer, sentencepiece, yaml, tqdm"
_active=${VIRTUAL_ENV:-}${CONDA_PREFIX:-}
if { [ ! -x "$_venv/bin/python" ] || { [ -n "$_active" ] && [ "${VIRTUAL_ENV:-}" != "$_venv" ]; }; } &&
   "$_py" -c "import $_mods" 2>/dev/null; then
  ASR_PYTHON=$("$_py" -c 'import sys; print(sys.executable)')
  export ASR_PYTHON
  export PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}"
  case ":$PATH:" in *":$_root/tools/bin:"*) ;; *) export PATH="$_root/tools/bin:$PATH" ;; esac
  echo "== using $ASR_PYTHON (it has torch $("$_py" -c 'import torch; print(torch.__version__)')): nothing installed" >&2
else
  if [ ! -x "$_venv/bin/python" ] || [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ]; then
    echo "== setting up $_venv (torch and friends; a few minutes the first time)" >&2
    _site=
    "$_py" -c "import torch, torchaudio" 2>/dev/null && _site=--system-site-packages
    [ -x "$_venv/bin/python" ] || "$_py" -m venv $_site "$_venv" || return 1 2>/dev/null || exit 1
    "$_venv/bin/python" -m pip install -q --upgrade pip >&2 &&
    "$_venv/bin/python" -m pip install -q -e "$_root[dev,synth,serve,export,rir,human]" >&2 &&
    echo "$_want" > "$_stamp" || { echo "error: installing the project into $_venv failed" >&2; return 1 2>/dev/null || exit 1; }
  fi
  . "$_venv/bin/activate"
fi
unset _root _venv _stamp _want _py _mods _active _site
