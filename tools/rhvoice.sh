#!/usr/bin/env bash
# RHVoice's English voices (alan, bdl, clb, slt: HMM-based, trained on the CMU ARCTIC speakers;
# the library, its libsonic and the voice data, Debian 12's non-free rhvoice packages and main's
# libsonic0, pinned by SHA-256) unpacked into a folder of their own: nothing is installed. The
# synth recipe's training speech from a fifth synthesizer (recipes/synth/local/rhvoice.py, which
# calls the library through ctypes) speaks with it.
#
#   tools/rhvoice.sh fetch [DIR]   download and unpack them into DIR (tools/debpinned.sh) unless
#                                  they are there; prints DIR
#
# DIR: $ASR_RHVOICE_DIR, else ~/.cache/asr-rhvoice (~70 MB). RHVoice and these four voices are
# LGPL 2.1+ by Debian's copyright file; Debian puts them in non-free because the voices cannot be
# trained again from what the source holds (the package's Russian-accented English voices,
# evgeniy-eng and lyubov, are CC BY-NC-ND 4.0 and not used). Errors: one line on stderr, exit 1.
set -euo pipefail

DEBS=(  # path under the mirror, SHA-256 (Debian 12's)
  "pool/main/s/sonic/libsonic0_0.2.0-12_amd64.deb 9d60de6918ace0b10e3e4e95421befd08aaf03b5b2a3d71ceb799e0cf259916f"
  "pool/non-free/r/rhvoice/librhvoice-core7_1.8.0+dfsg-3_amd64.deb 7b321d21caf899c78e579593f105fd49995f4d0c948c0523b2b4baa3291375f5"
  "pool/non-free/r/rhvoice/librhvoice5_1.8.0+dfsg-3_amd64.deb 7a12f124a48941ec0e94aeaa60da44a27c164a31d5a6bb884875e533a6d15128"
  "pool/non-free/r/rhvoice/rhvoice-english_1.8.0+dfsg-3_all.deb 7ea5227bcfc54b814086f53225ff47052b444d4554e8c4e752c9e6b29edf89a5"
)
LIB=usr/lib/x86_64-linux-gnu
FILES=("$LIB/libsonic.so.0" "$LIB/libRHVoice_core.so.7" "$LIB/libRHVoice.so.5" usr/share/RHVoice/languages/English/phonemes.xml
       usr/share/RHVoice/voices/alan/voice.info usr/share/RHVoice/voices/bdl/voice.info
       usr/share/RHVoice/voices/clb/voice.info usr/share/RHVoice/voices/slt/voice.info)
NAME=rhvoice WHAT="RHVoice's English voices" DIR_VAR=ASR_RHVOICE_DIR AMD64=librhvoice5
. "$(dirname "${BASH_SOURCE[0]}")/pinned_fetch.sh"
