#!/usr/bin/env bash
# The built-in recipe: synthesize a corpus with eSpeak NG in three worlds (train, dev and test:
# their own sentence templates, accents and unseen words), train a small transformer on a CPU,
# average, choose the decoding's LM weights on dev, decode the dev sets and test and score them.
#
#   bash recipes/synth/run.sh [--stage N] [--stop-stage M] [--name NAME] [--text FILE]
#                             [--num-train N] [--num-dev N] [--num-test N] [--num-dev-near N]
#                             [--num-dev-synth N] [--festival-dir DIR]
#                             [--flite F [--flite-pitch LO HI] [--flite-add] [--flite-voices V...] [--flite-dir DIR]]
#                             [--mbrola F ...] [--pico F ...] [--rhvoice F ...] (as --flite's)
#                             [--mbrola-prosody flite|espeak]
#                             [--extra-dev-decodes open|all]
#                             [--lm-sentences N] [--lm-clauses N] [--config conf/synth.yaml] [--seed S]
#                             [--data-dir DIR] [--exp-dir DIR] [--nproc N] [--streaming] [section.key=value ...]
#
# Stages (a finished stage is skipped when re-run; --stage N reruns N and the stages after it):
#   0 synthesize train/dev/test, and dev's sentences again as dev_near (eSpeak, the training
#     accents, voice variants training never uses) and dev_synth (Festival's ked voice, fetched
#     by tools/festival.sh; skipped, not failed, when it cannot be had); then a fraction F of the
#     training utterances spoken again by Flite (local/flite.py, tools/flite.sh; --flite 0: none),
#     each at a pitch drawn in [LO, HI] x its own with --flite-pitch, beside the eSpeak line with
#     --flite-add (else instead of it), by --flite-voices' voices alone when given; then
#     --mbrola's by MBROLA's voices (local/mbrola.py, tools/mbrola.sh: mind the voices' licence
#     there; Flite's kal16 chooses their phonemes, durations and intonation, --mbrola-prosody
#     espeak: eSpeak does), --pico's by SVOX Pico's (local/pico.py, tools/pico.sh) and --rhvoice's by
#     RHVoice's (local/rhvoice.py, tools/rhvoice.sh), likewise
#   1 tokenizer (the config's), the training words, a word LM
#   2 CMVN statistics + training features                     3 train
#   4 average checkpoints          5 decode dev and test: open vocabulary, alone and with the word LM
#                                    in the search, with the training words as the lexicon, and with
#                                    the lexicon's beam rescored by the LM (local/tune.py chooses its
#                                    weights on dev; test decoded once); dev_near and dev_synth open
#                                    vocabulary (--extra-dev-decodes all: with the LM and the lexicon too)
#   6 results table (each dev set and test, per accent), the accents' distances, a transcription
# --streaming trains a streaming model (model.causal_conv and U2's dynamic chunk training:
# model.dynamic_chunk) and stage 5 also decodes dev and test open vocabulary as it streams (the
# encoder in chunks; the joint CTC/attention beam search over them, as a stream's finals are made)
# at chunks of 16, 8 and 4 encoder frames (1.28, 0.64 and 0.32 s at 8x subsampling) with all the
# left context: decode_{dev,test}_open_chunk<N>; `asr transcribe --streaming` streams such a model.
# Training runs --nproc processes (default 2 on a CPU, 1 with a GPU) through torchrun, each with
# its share of the cores: on 2 cores, 2 single-thread processes trained the earlier 2.7M model at
# ~175 audio-seconds per second against ~130 for one process with 2 threads (the same 40 s steps;
# a small model's operators are too small to keep 2 threads busy).
set -euo pipefail
# OpenMP threads that wait passively: with busy-waiting ones, any other program on a 2-core machine
# slowed training steps up to 8x (a descheduled thread keeps its partner spinning)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

stage=0; stop_stage=100; force_from=1000; name=synth; text=""; num_train=27000; num_dev=200; num_test=400
num_dev_near=""; num_dev_synth=""; festival_dir=""; extra_decodes=open
engines=(flite mbrola pico rhvoice)  # the other synthesizers, local/<name>.py, run in this order
declare -A fraction=([flite]=0 [mbrola]=0 [pico]=0 [rhvoice]=0) pitch=() add=() voices=() engine_dir=()
mbrola_prosody=flite  # who chooses MBROLA's phonemes, durations and intonation (local/mbrola.py --prosody)
lm_sentences=""; lm_clauses=""; seed=0
config=$root/conf/synth.yaml; overrides=(); data=data; exp=""; nproc=""; streaming=""
abspath() { case $1 in /*) echo "$1";; *) echo "$PWD/$1";; esac; }
while [ $# -gt 0 ]; do
  case $1 in
    --stage) stage=$2; force_from=$2; shift 2;;
    --stop-stage) stop_stage=$2; shift 2;;
    --name) name=$2; shift 2;;
    --text) text=$(abspath "$2"); shift 2;;
    --num-train) num_train=$2; shift 2;;
    --num-dev) num_dev=$2; shift 2;;
    --num-test) num_test=$2; shift 2;;
    --num-dev-near) num_dev_near=$2; shift 2;;
    --num-dev-synth) num_dev_synth=$2; shift 2;;
    --festival-dir) festival_dir=$(abspath "$2"); shift 2;;
    --flite|--mbrola|--pico|--rhvoice) fraction[${1#--}]=$2; shift 2;;
    --flite-pitch|--mbrola-pitch|--pico-pitch|--rhvoice-pitch) e=${1#--}; pitch[${e%-pitch}]="$2 $3"; shift 3;;
    --flite-add|--mbrola-add|--pico-add|--rhvoice-add) e=${1#--}; add[${e%-add}]=1; shift;;
    --flite-voices|--mbrola-voices|--pico-voices|--rhvoice-voices)  # the words up to the next option or override
      e=${1#--}; e=${e%-voices}; voices[$e]=""; shift
      while [ $# -gt 0 ] && [[ $1 != -* && $1 != *=* ]]; do voices[$e]+=" $1"; shift; done
      [ -n "${voices[$e]}" ] || { echo "run.sh: --$e-voices names no voice" >&2; exit 2; };;
    --flite-dir|--mbrola-dir|--pico-dir|--rhvoice-dir) e=${1#--}; engine_dir[${e%-dir}]=$(abspath "$2"); shift 2;;
    --mbrola-prosody) mbrola_prosody=$2; shift 2
      case $mbrola_prosody in espeak|flite) ;; *) echo "run.sh: --mbrola-prosody is flite or espeak, not '$mbrola_prosody'" >&2; exit 2;; esac;;
    --extra-dev-decodes) extra_decodes=$2; shift 2;;
    --lm-sentences) lm_sentences=$2; shift 2;;
    --lm-clauses) lm_clauses=$2; shift 2;;
    --config) config=$(abspath "$2"); shift 2;;
    --data-dir) data=$(abspath "$2"); shift 2;;
    --exp-dir) exp=$(abspath "$2"); shift 2;;
    --nproc) nproc=$2; shift 2;;
    --seed) seed=$2; shift 2;;
    --streaming) streaming=1; overrides+=(model.causal_conv=true model.dynamic_chunk=true); shift;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0;;  # the header
    *=*) overrides+=("$1"); shift;;
    *) echo "run.sh: unknown option $1" >&2; exit 2;;
  esac
done

. "$root/tools/env.sh"
cd "$here"
exp=${exp:-exp/$name}
mkdir -p "$exp"
log=$exp/run.log
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }
# stage N: run it when N is selected and (re-run asked from N or its output is missing)
want() { [ "$1" -ge "$stage" ] && [ "$1" -le "$stop_stage" ]; }
done_marker() { echo "$exp/.done-stage$1"; }
run_stage() {  # run_stage N description command...
  local n=$1 what=$2; shift 2
  want "$n" || return 0
  if [ -f "$(done_marker "$n")" ] && [ "$n" -lt "$force_from" ]; then
    say "stage $n ($what): done before, skipped"; return 0
  fi
  say "stage $n: $what"
  force_from=$(( force_from < n + 1 ? force_from : n + 1 ))  # what follows a rerun stage reruns too
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  touch "$(done_marker "$n")"
  say "stage $n took $((SECONDS - t0)) s"
}

text_args=(); [ -n "$text" ] && text_args=(--text "$text")
[ -n "$lm_sentences" ] && text_args+=(--lm-sentences "$lm_sentences")
[ -n "$lm_clauses" ] && text_args+=(--lm-clauses "$lm_clauses")
case $extra_decodes in open|all) ;; *) echo "run.sh: --extra-dev-decodes open or all, not $extra_decodes" >&2; exit 2;; esac
# The dev sets speak the same held-out sentences in three ways, one gap each: dev, the unseen accents
# (pronunciation); dev_near, the training accents in voice variants training never uses (acoustics,
# near: synthesize.py's NEAR_VARIANTS); dev_synth, Festival's ked_diphone voice (a synthesizer never
# heard: local/festival.py, ~2 s for 200 lines). By default as many as dev (200 each).
num_dev_near=${num_dev_near:-$num_dev}; num_dev_synth=${num_dev_synth:-$num_dev}
synthesize() {
  python local/synthesize.py --out-dir "$data" --num-train "$num_train" --num-dev "$num_dev" --num-test "$num_test" \
    --num-dev-near "$num_dev_near" --seed "$seed" "${text_args[@]}"
  python local/festival.py dev-set --data "$data" --num "$num_dev_synth" ${festival_dir:+--festival-dir "$festival_dir"}
  local e own  # (synthesize.py has just rewritten train.jsonl: eSpeak's alone)
  for e in "${engines[@]}"; do
    case ${fraction[$e]} in 0|0.0|.0) continue;; esac
    own=(); if [ "$e" = mbrola ]; then own=(--prosody "$mbrola_prosody"); fi  # an engine's own options
    # shellcheck disable=SC2086  # pitch: LO HI, two words; voices: one word each
    python local/$e.py train --data "$data" --fraction "${fraction[$e]}" ${pitch[$e]:+--pitch ${pitch[$e]}} \
      ${add[$e]:+--add} ${voices[$e]:+--voices ${voices[$e]}} ${engine_dir[$e]:+--$e-dir "${engine_dir[$e]}"} \
      "${own[@]}"
  done
}
run_stage 0 "synthesize $num_train/$num_dev/$num_test utterances, dev_near $num_dev_near, dev_synth $num_dev_synth, of train Flite ${fraction[flite]}, MBROLA ${fraction[mbrola]}, Pico ${fraction[pico]}, RHVoice ${fraction[rhvoice]}" \
  synthesize
# the tokenizer the config asks for (kind and size, after the overrides), named after them, and
# its mel bins (for the CMVN statistics)
read -r kind vocab n_mels on_waves < <(python -c '
import sys
from asr.train_setup import load_experiment_config
c = load_experiment_config(sys.argv[1], sys.argv[2:])
t = c.tokenizer
print(t.kind, t.vocab_size if t.kind != "char" else "-", c.data.features.n_mels, int(c.data.augment.on_waves))' \
  "$config" "${overrides[@]}") || true
[ -n "${kind:-}" ] || { echo "run.sh: cannot read the tokenizer section of $config" >&2; exit 1; }
lang=$data/lang_$kind; size_args=()
[ "$vocab" = - ] || { lang=$lang$vocab; size_args=(--vocab-size "$vocab"); }
# the tokenizer, the training words (the lexicon of stage 5) and a word trigram LM of the training
# transcripts and, with the generator, of stage 0's lm_text.txt (300,000 more sentences of the
# training templates and 100,000 of a clause grammar) (asr.lm: it rescores the beam in stage 5)
word_lm() {
  local more=(); [ -f "$data/lm_text.txt" ] && more=(--text "$data/lm_text.txt")
  asr lm --manifest "$data/train.jsonl" "${more[@]}" --order 3 --out "$data/lm.arpa"
}
words_and_lm() {
  asr tokenizer --manifest "$data/train.jsonl" --kind "$kind" "${size_args[@]}" --out "$lang" \
    --words "$data/words.txt"
  word_lm
}
run_stage 1 "tokenizer ($kind${size_args:+ $vocab}), the training words and a word LM" words_and_lm
# CMVN statistics, and the training features dumped in the same pass (float16, no dither): read by
# training instead of decoding FLAC and computing fbank every epoch, which took a quarter of a step
run_stage 2 "CMVN statistics and training features ($n_mels mel bins)" \
  asr cmvn --manifest "$data/train.jsonl" --n-mels "$n_mels" --out "$data/cmvn.json" --dump-feats "$data/feats_train"
# training reads stage 2's features, unless data.augment adds noise or reverberation: those change
# the waveform, so the features are then computed from the audio every epoch (slower)
feats_args=(--feats "$data/feats_train"); [ "${on_waves:-0}" = 1 ] && feats_args=()
train() {  # --nproc processes (the config's batch is per process), the cores shared between them
  local n=$nproc cores threads
  [ -n "$n" ] || n=$(python -c 'import torch; print(1 if torch.cuda.is_available() else 2)')
  cores=$(python -c 'import os; print(len(os.sched_getaffinity(0)))')
  threads=$(( cores / n > 0 ? cores / n : 1 ))
  echo "training with $n process(es) x $threads thread(s)"
  torchrun --standalone --nnodes 1 --nproc-per-node "$n" -m asr.cli train --config "$config" \
    --train "$data/train.jsonl" --valid "$data/dev.jsonl" --exp-dir "$exp" --tokenizer "$lang" \
    --cmvn "$data/cmvn.json" "${feats_args[@]}" training.num_threads="$threads" "${overrides[@]}"
}
run_stage 3 "train $(basename "$config")" train
# the last 5 checkpoints (every 200 steps): with the earlier 3-epoch schedule, dev WER 18.1% against
# 25.3% for the best 3 epochs (which include the first, far behind at a short schedule)
run_stage 4 "average the last checkpoints" asr average --exp-dir "$exp" --by last --num 5
# Every choice on dev, the test set decoded once with them (conf/decode/synth.yaml's search):
# dev_near and dev_synth (when stage 0 made them): open vocabulary (~10 s each for 200 lines), with
# --extra-dev-decodes all also with the LM, the lexicon, and both, as dev is (~15 s more each)
#   decode_{dev,test}_open     no lexicon and no LM: any text may be written (the headline figure)
#   decode_{dev,test}_open_lm  open vocabulary with stage 1's word LM inside the search
#                              (conf/decode/synth_open_lm.yaml: its weight and word bonus chosen on dev
#                              over three training seeds by `local/tune.py fusion`): any text may still
#                              be written (a word the LM does not know scores as its <unk>)
#   decode_{dev,test}_lexicon  the training words as a closed lexicon (asr.lexicon), the whole beam
#                              kept (decoding.nbest = beam_size): a word never trained is an error
#   local/tune.py choose       the LM weight and word bonus that rescore dev's beam best, into
#                              $exp/decode.yaml (and the grid into $exp/tune.json)
#   decode_{dev,test}          the lexicon's beam rescored by stage 1's word LM with those values
#                              (tune.py --then: what `asr decode` with decoding.lm gives)
decode() {
  local conf=$root/conf/decode/synth.yaml set beam
  [ -f "$data/lm.arpa" ] || word_lm  # an experiment whose stage 1 ran before stage 1 built the LM
  beam=$(python -c 'import sys; from asr.decoding import load_decoding_config as c; print(c(sys.argv[1]).beam_size)' "$conf")
  local then=() sets=(dev test)
  for set in dev_near dev_synth; do [ -s "$data/$set.jsonl" ] && sets+=("$set"); done
  for set in "${sets[@]}"; do
    asr decode --model "$exp/model_avg.pt" --manifest "$data/$set.jsonl" --out-dir "$exp/decode_${set}_open" \
      --config "$conf"
    case $set in  # (an extra set's decodes of an earlier `all` run are removed, not reported stale)
      dev|test) ;;
      *) [ "$extra_decodes" = all ] || { rm -rf "$exp/decode_${set}"{_open_lm,_lexicon,}; continue; };;
    esac
    asr decode --model "$exp/model_avg.pt" --manifest "$data/$set.jsonl" --out-dir "$exp/decode_${set}_open_lm" \
      --config "$root/conf/decode/synth_open_lm.yaml" --lm "$data/lm.arpa"
    asr decode --model "$exp/model_avg.pt" --manifest "$data/$set.jsonl" --out-dir "$exp/decode_${set}_lexicon" \
      --config "$conf" decoding.lexicon="$data/words.txt" decoding.nbest="$beam"
    then+=(--then "$exp/decode_${set}_lexicon" "$data/$set.jsonl" "$exp/decode_$set")
  done
  if [ -n "$streaming" ]; then  # as the model streams: chunked attention, every left chunk
    for chunk in 16 8 4; do
      for set in dev test; do
        asr decode --model "$exp/model_avg.pt" --manifest "$data/$set.jsonl" --out-dir "$exp/decode_${set}_open_chunk$chunk" \
          --config "$conf" --beam-size 10 decoding.chunk_size=$chunk
      done
    done
  fi
  python local/tune.py choose --beam "$exp/decode_dev_lexicon" --manifest "$data/dev.jsonl" --lm "$data/lm.arpa" \
    --config "$conf" --out "$exp/decode.yaml" "${then[@]}"
}
run_stage 5 "decode the dev sets and test (conf/decode/synth.yaml): open vocabulary, alone and with the LM, the lexicon, the lexicon and the LM (the LM's weights chosen on dev)" decode
results() {
  python local/results.py --exp "$exp" --data "$data"
  python local/accents.py --manifests "$data/dev.jsonl,$data/test.jsonl" --json "$exp/accents.json"
  first=$(head -1 "$data/test.jsonl" | python -c "import json,sys; u=json.loads(sys.stdin.read()); print(u['audio'], '|', u['text'])")
  echo "transcribing ${first%% |*} (reference: ${first#*| })"
  # the search of stage 5's result: the decoding config chosen on dev, the lexicon and the LM
  asr transcribe --model "$exp/model_avg.pt" --config "$exp/decode.yaml" --lexicon "$data/words.txt" \
    --lm "$data/lm.arpa" "$data/${first%% |*}"
}
run_stage 6 "results" results
say "finished: stages $stage-$((stop_stage < 6 ? stop_stage : 6)) in $SECONDS s"
