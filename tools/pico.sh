#!/usr/bin/env bash
# SVOX Pico's English voices (en-US and en-GB, female, 16 kHz: the library and its language
# files, Debian's non-free libttspico0 and libttspico-data, pinned by SHA-256) unpacked into a
# folder of its own: nothing is installed. The synth recipe's training speech from a fourth
# synthesizer (recipes/synth/local/pico.py, which calls the library through ctypes) speaks with it.
#
#   tools/pico.sh fetch [DIR]   download and unpack them into DIR (tools/debpinned.sh) unless they
#                               are there; prints DIR
#
# DIR: $ASR_PICO_DIR, else ~/.cache/asr-pico (~7 MB). Pico's licence is Apache 2.0 for the code;
# Debian puts the language files in non-free (no source for them). Errors: one line on stderr, exit 1.
set -euo pipefail

DEBS=(  # path under the mirror, SHA-256 (Debian 12's)
  "pool/non-free/s/svox/libttspico0_1.0+git20130326-13_amd64.deb fc9e4dbc664a7756ae73e83633d9987e6b0f2fd5248f04def8beb8de6df2cd02"
  "pool/non-free/s/svox/libttspico-data_1.0+git20130326-13_all.deb 25c9904cef2471302634c03deff3ca96b588e22ea94929dda72d940584a3b84a"
)
FILES=(usr/lib/x86_64-linux-gnu/libttspico.so.0 usr/share/pico/lang/en-US_ta.bin usr/share/pico/lang/en-US_lh0_sg.bin
       usr/share/pico/lang/en-GB_ta.bin usr/share/pico/lang/en-GB_kh0_sg.bin)
NAME=pico WHAT="SVOX Pico's en-US and en-GB voices" DIR_VAR=ASR_PICO_DIR AMD64=libttspico0
. "$(dirname "${BASH_SOURCE[0]}")/pinned_fetch.sh"
