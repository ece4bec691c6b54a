#!/usr/bin/env bash
# Create the virtual environment of the peer benchmark (tools/bench_peers/bench.py): ESPnet,
# SpeechBrain and this toolkit on one torch, apart from the project's own .venv.
#
#   bash tools/bench_peers/setup.sh          # about 5-10 minutes the first time; a no-op after
#   ASR_PEERS_VENV=/somewhere/else bash tools/bench_peers/setup.sh
#
# Settings (environment variables, defaults in brackets):
#   ASR_PEERS_VENV      where the environment goes [~/.cache/asr-bench-peers/venv], outside the
#                       repository so that git never sees it
#   PEERS_TORCH         torch version [2.12.1: the newest that espnet 202511 installs beside:
#                       espnet asks for setuptools<74, torch 2.13 and later for setuptools>=77]
#   PEERS_TORCHAUDIO    torchaudio version [2.11.0]
#   PEERS_ESPNET        espnet version [202511]
#   PEERS_SPEECHBRAIN   speechbrain version [1.1.2]
#   PEERS_REINSTALL=1   start from an empty environment
# The installed versions are written to $ASR_PEERS_VENV/versions.txt (pip freeze) and printed.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${ASR_PEERS_VENV:-$HOME/.cache/asr-bench-peers/venv}
torch_version=${PEERS_TORCH:-2.12.1}
torchaudio_version=${PEERS_TORCHAUDIO:-2.11.0}
espnet_version=${PEERS_ESPNET:-202511}
speechbrain_version=${PEERS_SPEECHBRAIN:-1.1.2}
want="torch=$torch_version torchaudio=$torchaudio_version espnet=$espnet_version speechbrain=$speechbrain_version"
stamp=$venv/.bench-peers-installed

if [ "${PEERS_REINSTALL:-0}" = 1 ]; then rm -rf "$venv"; fi
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  echo "$venv is up to date ($want)"
  exit 0
fi

step() { echo "== $*" >&2; }
pip() {  # pip, without the warnings about this machine's local index folders
  "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}

step "creating $venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# pip 26 refuses a PyPI package that names a git URL even in an extra nobody asks for, and
# espnet needs ci_sdr, whose "all" extra names padertorch's git repository: pip 25 installs it
pip install -q "pip<26"

# torch first, so that nothing after it picks another version; the PyPI torchaudio wheels are
# built for CUDA and do not import beside a CPU-only torch, so torch is the PyPI (CUDA) build too.
step "torch $torch_version, torchaudio $torchaudio_version"
pip install -q "torch==$torch_version" "torchaudio==$torchaudio_version"

step "espnet $espnet_version"
pip install -q "espnet==$espnet_version" "torch==$torch_version"

step "speechbrain $speechbrain_version"
pip install -q "speechbrain==$speechbrain_version" "torch==$torch_version" "torchaudio==$torchaudio_version"

# this toolkit, from the working tree (an editable install: the benchmark runs the code as it is
# now) with its export extra (onnx, onnxscript, onnxruntime: the exported rows), and py-spy for profiling
step "asr (editable, $root, [export]) and py-spy"
pip install -q -e "$root[export]" "torch==$torch_version" "torchaudio==$torchaudio_version" py-spy

"$venv/bin/python" -m pip freeze 2>/dev/null > "$venv/versions.txt"
"$venv/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "torchaudio", "espnet", "speechbrain", "asr", "numpy", "onnxruntime", "py-spy"):
    print(f"{name:12s} {md.version(name)}")
PY
echo "$want" > "$stamp"
echo "ready: $venv/bin/python tools/bench_peers/bench.py  (versions: $venv/versions.txt)"
