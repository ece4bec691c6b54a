#!/usr/bin/env bash
# LibriSpeech: download, prepare, train a joint CTC/attention conformer on 100 h or 960 h with
# torchrun (one GPU, several, or several machines), average, decode the dev and test sets, score;
# then train a transformer LM on the LibriSpeech LM corpus and decode again with it fused.
#
#   bash recipes/librispeech/run.sh [--size 100|960] [--stage N] [--stop-stage M] [--config FILE]
#        [--name NAME] [--data-dir DIR] [--download-dir DIR] [--exp-dir DIR] [--mirror URL|FOLDER]
#        [--parts p1,p2,...] [--no-speed-perturb] [--nnodes N --node-rank R --master-addr HOST]
#        [--master-port P] [--nproc-per-node N] [--decode-config FILE] [--beam-size N]
#        [--average-num N] [--lm LM.arpa[.gz]] [--lm-weight W] [--lm-config FILE] [--lm-exp-dir DIR]
#        [--lm-mirror URL|FOLDER] [--lm-average-num N] [--lm-override section.key=value ...]
#        [--streaming] [section.key=value ...]
#
# Stages (a finished stage is skipped when re-run; --stage N reruns N and the stages after it):
#   0 download, verify (md5) and unpack the archives   1 manifests (speed perturbation 0.9/1.1)
#   2 tokenizer (the config's tokenizer section)       3 CMVN statistics
#   4 train (torchrun)   5 average the best checkpoints   6 decode dev/test (torchrun)   7 RESULTS.md
#   8 LM text: download the LM corpus (openslr 11, 1.4 GB) + the training transcripts
#   9 train the transformer LM on the tokenizer of stage 2 (torchrun)   10 average its checkpoints
#   11 decode dev/test with the LM fused   12 its table into RESULTS_lm.md   (--stop-stage 7: no LM)
# Defaults: --size 100 (conf/librispeech_100h_conformer.yaml; 960: conf/librispeech_960h_conformer.yaml),
# data in recipes/librispeech/data, experiment in recipes/librispeech/exp/NAME, beam 20 with CTC
# weight 0.3; the LM: conf/lm/librispeech_transformer.yaml into lm_<config>_<data>_<tokenizer>/
# beside the experiment. --streaming trains a streaming model (model.causal_conv, U2's dynamic chunk
# training: model.dynamic_chunk); decode it as it streams with decoding.chunk_size=N, stream it with
# Recognizer.stream / asr transcribe --streaming / asr serve's /stream.
# Two kinds of LM. Stages 11-12: the transformer LM of stages 9-10 scores every step of the beam
# search on the ASR model's BPE tokens (shallow fusion, --lm-weight default 0.6) into
# decode_..._lm_<...>_w<weight>/. --lm LM.arpa: stages 6-7 rescore each utterance's ended
# hypotheses with that word n-gram LM (asr.lm; e.g. openslr 11's 3-gram.pruned.1e-7.arpa.gz;
# --lm-weight default 0.3) into decode_..._lm<name>_w<weight>/. Both add their table to
# RESULTS_lm.md; RESULTS.md and the decoding folders without an LM stay as they are.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
abspath() { case $1 in /*|http://*|https://*) echo "$1";; *) echo "$PWD/$1";; esac; }

stage=0; stop_stage=100; force_from=1000; size=100; config=""; name=""; data=$here/data; downloads=""
exp=""; mirror=https://www.openslr.org/resources/12; parts=""; speeds=0.9,1.1
nnodes=1; node_rank=0; master_addr=""; master_port=29500; nproc=""
decode_config=$root/conf/decode/default.yaml; beam=20; average_num=10; overrides=(); lm=""; lm_weight=""
lm_config=$root/conf/lm/librispeech_transformer.yaml; lm_exp=""; lm_mirror=https://www.openslr.org/resources/11
lm_average_num=10; lm_overrides=()
while [ $# -gt 0 ]; do
  case $1 in
    --stage) stage=$2; force_from=$2; shift 2;;
    --stop-stage) stop_stage=$2; shift 2;;
    --size) size=$2; shift 2;;
    --config) config=$(abspath "$2"); shift 2;;
    --name) name=$2; shift 2;;
    --data-dir) data=$(abspath "$2"); shift 2;;
    --download-dir) downloads=$(abspath "$2"); shift 2;;
    --exp-dir) exp=$(abspath "$2"); shift 2;;
    --mirror) mirror=$(abspath "$2"); shift 2;;
    --parts) parts=$2; shift 2;;
    --no-speed-perturb) speeds=""; shift;;
    --nnodes) nnodes=$2; shift 2;;
    --node-rank) node_rank=$2; shift 2;;
    --master-addr) master_addr=$2; shift 2;;
    --master-port) master_port=$2; shift 2;;
    --nproc-per-node) nproc=$2; shift 2;;
    --decode-config) decode_config=$(abspath "$2"); shift 2;;
    --beam-size) beam=$2; shift 2;;
    --lm) lm=$(abspath "$2"); shift 2;;
    --lm-weight) lm_weight=$2; shift 2;;
    --average-num) average_num=$2; shift 2;;
    --lm-config) lm_config=$(abspath "$2"); shift 2;;
    --lm-exp-dir) lm_exp=$(abspath "$2"); shift 2;;
    --lm-mirror) lm_mirror=$(abspath "$2"); shift 2;;
    --lm-average-num) lm_average_num=$2; shift 2;;
    --lm-override) lm_overrides+=("$2"); shift 2;;
    --streaming) overrides+=(model.causal_conv=true model.dynamic_chunk=true); shift;;
    -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0;;
    *=*) overrides+=("$1"); shift;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2;;
  esac
done

case $size in
  100) default_parts=dev-clean,dev-other,test-clean,test-other,train-clean-100;;
  960) default_parts=dev-clean,dev-other,test-clean,test-other,train-clean-100,train-clean-360,train-other-500;;
  *) echo "run.sh: --size must be 100 or 960, not '$size'" >&2; exit 2;;
esac
[ "$nnodes" -gt 1 ] && [ -z "$master_addr" ] && { echo "run.sh: --nnodes $nnodes needs --master-addr" >&2; exit 2; }
config=${config:-$root/conf/librispeech_${size}h_conformer.yaml}
[ -f "$config" ] || { echo "run.sh: no config file $config" >&2; exit 2; }
parts=${parts:-$default_parts}
pick() { tr , '\n' <<< "$parts" | grep -E "^($1)" | paste -sd, - || true; }  # the selected parts matching $1
train_parts=$(pick train-); dev_parts=$(pick dev-); test_sets=$(pick 'dev-|test-')
[ -n "$train_parts" ] || { echo "run.sh: --parts $parts names no train-* part" >&2; exit 2; }
[ -n "$dev_parts" ] || { echo "run.sh: --parts $parts names no dev-* part (the validation set)" >&2; exit 2; }

. "$root/tools/env.sh"
cd "$here"
kind=""; vocab=""; n_mels=""; lang=""
if [ "$stop_stage" -ge 2 ]; then  # what stages 2-4 need from the config; also checks the overrides early
  read -r kind vocab n_mels < <(python local/config_info.py "$config" "${overrides[@]}") || exit 1
  lang=lang_$kind; [ "$vocab" = - ] || lang=$lang$vocab
fi

# data products are shared by experiments and named by what determines them
sp_tag=${speeds:+_sp}
if [ "$parts" = "$default_parts" ]; then dtag=${size}h$sp_tag; else dtag=${parts//,/+}$sp_tag; fi
mf=$data/$dtag
nosp_tag=_nosp; [ -n "$speeds" ] && nosp_tag=""
name=${name:-$(basename "$config" .yaml)$nosp_tag}
exp=${exp:-$here/exp/$name}
# the LM depends on its config and on the tokenizer (data tag + lang): experiments on it share it
lm_exp=${lm_exp:-$(dirname "$exp")/lm_$(basename "$lm_config" .yaml)_${dtag}_$lang}
dbase=decode_$(basename "$decode_config" .yaml)${beam:+_beam$beam}
dname=$dbase; ngram_weight=${lm_weight:-0.3}; nlm_weight=${lm_weight:-0.6}
if [ -n "$lm" ]; then
  [ -f "$lm" ] || { echo "run.sh: no LM file $lm" >&2; exit 2; }
  lm_name=$(basename "$lm"); lm_name=${lm_name%.gz}; lm_name=${lm_name%.arpa}
  dname=${dbase}_lm${lm_name}_w$ngram_weight
fi
nlm_dname=${dbase}_$(basename "$lm_exp")_w$nlm_weight
want() {  # stage $1 is asked for (on the other machines of --nnodes: the trainings, 4 and 9, only)
  [ "$1" -ge "$stage" ] && [ "$1" -le "$stop_stage" ] && { [ "$node_rank" -eq 0 ] || [ "$1" = 4 ] || [ "$1" = 9 ]; }
}
if want 9 && [ ! -f "$lm_config" ]; then echo "run.sh: no LM config file $lm_config" >&2; exit 2; fi
mkdir -p "$exp" "$mf"
log=$exp/run.log
say() { echo "== $(date +%H:%M:%S) $*" | tee -a "$log"; }
run_stage() {  # run_stage N description DONE_MARKER command...
  local n=$1 what=$2 marker=$3; shift 3
  want "$n" || return 0
  if [ -f "$marker" ] && [ "$n" -lt "$force_from" ]; then
    say "stage $n ($what): done before, skipped"; return 0
  fi
  say "stage $n: $what"
  force_from=$(( force_from < n + 1 ? force_from : n + 1 ))  # what follows a rerun stage reruns too
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$log"
  touch "$marker"
  say "stage $n took $((SECONDS - t0)) s"
}

concat() {  # concat OUT.jsonl part1,part2,...: one manifest from the per-part ones
  local out=$1 p files=()
  for p in ${2//,/ }; do files+=("$mf/$p.jsonl"); done
  cat "${files[@]}" > "$out.tmp" && mv "$out.tmp" "$out"
}
prepare() {
  local sp_args=(); [ -n "$speeds" ] && sp_args=(--speed-perturb "$speeds")
  asr prepare librispeech "$data" "$mf" --parts "$parts" "${sp_args[@]}"
  concat "$mf/train.jsonl" "$train_parts"
  concat "$mf/dev.jsonl" "$dev_parts"
  echo "$mf/train.jsonl ($train_parts): $(wc -l < "$mf/train.jsonl") utterances;" \
       "$mf/dev.jsonl ($dev_parts): $(wc -l < "$mf/dev.jsonl")"
}
tokenizer() {
  local size_args=(); [ "$vocab" = - ] || size_args=(--vocab-size "$vocab")
  asr tokenizer --manifest "$mf/train.jsonl" --kind "$kind" "${size_args[@]}" --out "$mf/$lang"
}
torchrun_asr() {  # asr "$@" under torchrun: one process per visible GPU (or one on a CPU) on each of --nnodes machines
  local n=$nproc where
  [ -n "$n" ] || n=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')
  if [ "$nnodes" -gt 1 ]; then
    where=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$master_addr" --master-port "$master_port")
  else
    where=(--standalone --nnodes 1)
  fi
  echo "torchrun: $nnodes node(s) x $n process(es)"
  torchrun "${where[@]}" --nproc-per-node "$n" -m asr.cli "$@"
}
train() {
  torchrun_asr train --config "$config" --train "$mf/train.jsonl" --valid "$mf/dev.jsonl" --exp-dir "$exp" \
    --tokenizer "$mf/$lang" --cmvn "$mf/cmvn_mel$n_mels.json" "${overrides[@]}"
}
decode() {  # decode DNAME [LM WEIGHT]: one process per visible GPU (torchrun deals them the batches), one on a CPU
  local out=$1 set n launch=(asr) args=(); [ -n "$beam" ] && args=(--beam-size "$beam")
  if [ $# -gt 1 ]; then args+=(decoding.lm="$2" decoding.lm_weight="$3"); fi
  n=$(python -c 'import torch; print(torch.cuda.device_count())')
  [ "$n" -gt 0 ] && launch=(torchrun --standalone --nnodes 1 --nproc-per-node "$n" -m asr.cli)
  echo "decode: $([ "$n" -gt 0 ] && echo "torchrun, $n GPU process(es)" || echo "one process on the CPU")"
  for set in ${test_sets//,/ }; do
    "${launch[@]}" decode --model "$exp/model_avg.pt" --manifest "$mf/$set.jsonl" --out-dir "$exp/$out/$set" \
      --config "$decode_config" "${args[@]}"
  done
}
lm_text() {  # the LM corpus, and the training transcripts (each utterance once: no speed-perturbed copies)
  python local/download_lm.py --download-dir "$lm_corpus_dir" --mirror "$lm_mirror"
  python local/transcripts.py "$mf/train.jsonl" "$mf/lm_train.txt"
}
train_lm() {  # on the LM corpus + the training transcripts, validated on the dev sets' transcripts
  torchrun_asr lm --kind transformer --text "$lm_corpus_dir/librispeech-lm-norm.txt.gz" --text "$mf/lm_train.txt" \
    --valid "$mf/dev.jsonl" --tokenizer "$mf/$lang" --config "$lm_config" --exp-dir "$lm_exp" "${lm_overrides[@]}"
}

if [ "$node_rank" -gt 0 ]; then  # the other machines only join the trainings (want); node 0 does the rest
  if want 4 && [ ! -f "$mf/.done-stage3-mel$n_mels" ]; then
    echo "run.sh: no prepared data in $mf: run stages 0-3 first (--stop-stage 3) on one machine" >&2; exit 1
  fi
  if want 9 && [ ! -f "$mf/.done-stage8" ]; then
    echo "run.sh: no LM text for $mf: run stage 8 first (--stage 8 --stop-stage 8) on one machine" >&2; exit 1
  fi
fi
dl_args=(); [ -n "$downloads" ] && dl_args=(--download-dir "$downloads")
lm_corpus_dir=${downloads:-$data/downloads}
run_stage 0 "download and unpack $parts" "$mf/.done-stage0" \
  python local/download.py --parts "$parts" --data-dir "$data" --mirror "$mirror" "${dl_args[@]}"
run_stage 1 "manifests${speeds:+ (speed perturbation $speeds on $train_parts)}" "$mf/.done-stage1" prepare
run_stage 2 "tokenizer $lang" "$mf/.done-stage2-$lang" tokenizer
run_stage 3 "CMVN statistics" "$mf/.done-stage3-mel$n_mels" \
  asr cmvn --manifest "$mf/train.jsonl" --n-mels "$n_mels" --out "$mf/cmvn_mel$n_mels.json"
run_stage 4 "train $(basename "$config") into $exp" "$exp/.done-stage4" train
run_stage 5 "average the $average_num best checkpoints" "$exp/.done-stage5" \
  asr average --exp-dir "$exp" --by best --num "$average_num"
if [ -n "$lm" ]; then ngram=("$lm" "$ngram_weight"); else ngram=(); fi
run_stage 6 "decode $test_sets ($dname)" "$exp/.done-stage6-$dname" decode "$dname" "${ngram[@]}"
run_stage 7 "results table" "$exp/.done-stage7-$dname" \
  python local/results.py --exp-dir "$exp" --decode-name "$dname" --sets "$test_sets" \
  --title "LibriSpeech $dtag: $(basename "$config")${lm:+, LM $(basename "$lm") (weight $ngram_weight)}" \
  --out "$exp/RESULTS${lm:+_lm}.md" ${lm:+--merge}
# the LM stages
run_stage 8 "LM text (librispeech-lm-norm.txt.gz, transcripts)" "$mf/.done-stage8" lm_text
run_stage 9 "train $(basename "$lm_config") on $lang into $lm_exp" "$lm_exp/.done-stage9" train_lm
run_stage 10 "average the LM's $lm_average_num best checkpoints" "$lm_exp/.done-stage10" \
  asr average --exp-dir "$lm_exp" --by best --num "$lm_average_num" --out "$lm_exp/lm_avg.pt"
run_stage 11 "decode $test_sets with the LM fused ($nlm_dname)" "$exp/.done-stage11-$nlm_dname" \
  decode "$nlm_dname" "$lm_exp/lm_avg.pt" "$nlm_weight"
run_stage 12 "results table with the LM" "$exp/.done-stage12-$nlm_dname" \
  python local/results.py --exp-dir "$exp" --decode-name "$nlm_dname" --sets "$test_sets" \
  --title "LibriSpeech $dtag: $(basename "$config"), transformer LM $(basename "$lm_exp") (weight $nlm_weight)" \
  --out "$exp/RESULTS_lm.md" --merge
