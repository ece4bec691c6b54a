#!/usr/bin/env bash
# Human speech for training: Asterisk's core English prompts (Debian's asterisk-core-sounds-en-g722 and,
# for their transcripts, asterisk-core-sounds-en; 568 prompts read by one speaker, Allison Smith,
# ~26 min of G.722 wideband audio, 16 kHz), pinned by SHA-256 and unpacked into a folder of their
# own: nothing is installed. recipes/synth/local/human.py adds them to a corpus's training lines.
#
#   tools/asterisk.sh fetch [DIR]   download and unpack them into DIR (tools/debpinned.sh) unless
#                                   they are there; prints DIR
#
# DIR: $ASR_ASTERISK_DIR, else ~/.cache/asr-asterisk (~13 MB). The recordings are CC-BY-SA 3.0
# (DIR/root/usr/share/doc/asterisk-core-sounds-en-g722/copyright): a model trained on them is shared
# under that licence's terms. Errors: one line on stderr, exit 1.
set -euo pipefail

DEBS=(  # path under the mirror, SHA-256 (Debian 12's)
  "pool/main/a/asterisk-core-sounds/asterisk-core-sounds-en-g722_1.6.1-1_all.deb 38c5261820b406dcb0ecb37675720da2b0864850690690352ca52707eb623806"
  "pool/main/a/asterisk-core-sounds/asterisk-core-sounds-en_1.6.1-1_all.deb 973e797d28e37fa6ca3c0a9d6fa717e77cf1268ae916bf09fd3503113cdffa50"
)
FILES=(usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz usr/share/asterisk/sounds/en_US_f_Allison/hello-world.g722)
NAME=asterisk WHAT="Asterisk's English prompts" DIR_VAR=ASR_ASTERISK_DIR
. "$(dirname "${BASH_SOURCE[0]}")/pinned_fetch.sh"
