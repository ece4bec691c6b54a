"""The `asr` command: its argument parser and `main`; asr.commands holds what each subcommand does.
Library modules are imported inside the handlers so that `asr --help` answers at once."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from asr import commands

# the search modes and precisions (asr.search.MODES, asr.decoding.PRECISIONS, whose modules import
# torch: `asr --help` does not wait for it)
MODES = ["attention", "ctc_greedy", "ctc_rescore", "greedy"]
PRECISIONS = ["auto", "fp32", "bf16"]


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, not {text!r}")
    return value


MODEL_HELP = "a model file, or a folder written by 'asr export' (onnxruntime, CPU)"


def build_parser() -> argparse.ArgumentParser:
    from asr import __version__

    parser = argparse.ArgumentParser(
        prog="asr", description="Transformer speech recognition: prepare data, train, decode, score.",
        epilog="Run 'asr COMMAND --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"asr {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_data_commands, _add_training_commands, _add_decoding_commands):
        add(sub)
    return parser


def _add_data_commands(sub: argparse._SubParsersAction) -> None:
    """prepare, tokenizer, lm, cmvn."""
    p = sub.add_parser("prepare", help="turn a corpus into JSON Lines manifests",
                       description="Turn a corpus into JSON Lines manifests (id, audio, duration, text).")
    corpora = p.add_subparsers(dest="corpus", metavar="CORPUS", required=True)
    q = corpora.add_parser("librispeech", help="the official LibriSpeech layout -> OUT_DIR/<part>.jsonl")
    q.add_argument("librispeech_dir", metavar="LIBRISPEECH_DIR")
    q.add_argument("out_dir", metavar="OUT_DIR")
    q.add_argument("--parts", help="comma-separated parts (default: every part found)")
    q.add_argument("--speed-perturb", metavar="SPEEDS",
                   help="add speed-perturbed copies of the train-* parts, e.g. 0.9,1.1")
    q.set_defaults(func=commands.cmd_prepare_librispeech)
    q = corpora.add_parser("kaldi", help="a Kaldi data dir (wav.scp [+ segments] + text) -> OUT.jsonl")
    q.add_argument("data_dir", metavar="DATA_DIR")
    q.add_argument("out", metavar="OUT.jsonl")
    q.add_argument("--speed-perturb", metavar="SPEEDS", help="add speed-perturbed copies, e.g. 0.9,1.1")
    q.set_defaults(func=commands.cmd_prepare_kaldi)

    p = sub.add_parser("tokenizer", help="train a char or sentencepiece tokenizer on a manifest's text")
    p.add_argument("--manifest", required=True, metavar="TRAIN.jsonl")
    p.add_argument("--kind", required=True, choices=["char", "bpe", "unigram"])
    p.add_argument("--vocab-size", type=int, metavar="N", help="sentencepiece pieces (bpe, unigram)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--words", metavar="WORDS.txt", help="also write the transcripts' words, one per line "
                   "(for 'asr decode decoding.lexicon=WORDS.txt')")
    p.set_defaults(func=commands.cmd_tokenizer)

    p = sub.add_parser("lm", help="train a language model on transcripts or text: a word n-gram model (ARPA) or a "
                       "token-level transformer (torchrun for several processes)")
    p.add_argument("--kind", choices=["ngram", "transformer"], default="ngram",
                   help="ngram (default): interpolated Kneser-Ney into --out; transformer: the ASR model's tokens, "
                   "trained into --exp-dir like 'asr train' (resumable; 'asr average' makes lm_avg.pt)")
    p.add_argument("--manifest", action="append", default=[], metavar="TRAIN.jsonl",
                   help="the transcripts of a manifest (repeatable)")
    p.add_argument("--text", action="append", default=[], metavar="FILE",
                   help="one sentence per line, .gz allowed (repeatable)")
    p.add_argument("--order", type=int, default=3, metavar="N", help="ngram: n-gram order (default 3)")
    p.add_argument("--out", metavar="LM.arpa", help="ngram: the ARPA file (.gz: gzip-compressed)")
    p.add_argument("--exp-dir", metavar="EXP", help="transformer: the experiment folder")
    p.add_argument("--tokenizer", metavar="DIR|MODEL.pt",
                   help="transformer: the ASR model's tokenizer (its folder, or the model file)")
    p.add_argument("--config", metavar="CONF.yaml", help="transformer: conf/lm/*.yaml (model, data, training)")
    p.add_argument("--valid", action="append", default=[], metavar="FILE",
                   help="transformer: validation text, a text file or a manifest (repeatable)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="transformer: config overrides")
    p.set_defaults(func=commands.cmd_lm)

    p = sub.add_parser("cmvn", help="global mean/variance statistics of the fbank features")
    p.add_argument("--manifest", required=True, metavar="TRAIN.jsonl")
    p.add_argument("--out", required=True, metavar="CMVN.json")
    p.add_argument("--n-mels", type=int, default=80, help="mel bins (default 80)")
    p.add_argument("--num-workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="loader processes (default: the CPU count, at most 8)")
    p.add_argument("--dump-feats", metavar="DIR",
                   help="also write the features (no dither, float16) to DIR for 'asr train --feats DIR'")
    p.set_defaults(func=commands.cmd_cmvn)


def _add_training_commands(sub: argparse._SubParsersAction) -> None:
    """train, average."""
    p = sub.add_parser("train", help="train a model (one process, or torchrun for several GPUs)")
    p.add_argument("--config", required=True, metavar="CONF.yaml")
    p.add_argument("--train", required=True, metavar="TRAIN.jsonl")
    p.add_argument("--valid", required=True, metavar="DEV.jsonl")
    p.add_argument("--exp-dir", required=True, metavar="EXP")
    p.add_argument("--tokenizer", metavar="DIR", help="default: build one in EXP")
    p.add_argument("--cmvn", metavar="CMVN.json", help="default: compute it in EXP")
    p.add_argument("--feats", metavar="DIR", help="training features dumped by 'asr cmvn --dump-feats DIR' "
                   "(read instead of computed every epoch; no dither)")
    p.add_argument("--init-from", metavar="MODEL.pt", help="start from this model file's weights (fine-tuning; "
                   "training.init_from): the modules of --init-modules, the output layers re-initialised when "
                   "the tokenizer differs")
    p.add_argument("--init-modules", metavar="M,M", help="of --init-from: encoder, decoder, ctc (default: all three; "
                   "training.init_modules)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=commands.cmd_train)

    p = sub.add_parser("average", help="average checkpoints into one model file")
    p.add_argument("--exp-dir", required=True, metavar="EXP")
    p.add_argument("--by", choices=["best", "last"], default="best")
    p.add_argument("--num", type=int, default=5, metavar="N")
    p.add_argument("--out", metavar="MODEL.pt", help="default: EXP/model_avg.pt")
    p.set_defaults(func=commands.cmd_average)


# the fields of asr.decoding.DecodingConfig that add_decoding_flags sets, by their flags' dest
def add_decoding_flags(p: argparse.ArgumentParser) -> None:
    """The decoding flags, the same for `asr decode`, `asr transcribe` and `asr serve`: --config,
    a flag for each field of DECODING_FIELDS (None when not given: the config's value stays) and
    --threads (asr.decoding.thread_policy)."""
    g = p.add_argument_group("decoding", "--config first, then decoding.key=value (any field of "
                             "asr.decoding.DecodingConfig), then these flags")
    g.add_argument("--config", metavar="conf/decode/X.yaml",
                   help="decoding options (asr.decoding.DecodingConfig; batch_size and the loader's fields are "
                   "asr decode's)")
    g.add_argument("--mode", choices=MODES, help="the search: attention (beam search over the decoder and CTC, "
                   "the default), greedy, ctc_greedy, ctc_rescore")
    g.add_argument("--beam-size", type=int, metavar="N", help="hypotheses kept per utterance (decoding.beam_size)")
    g.add_argument("--ctc-weight", type=float, metavar="W",
                   help="weight of the CTC prefix score beside the decoder's 1 - W (decoding.ctc_weight)")
    g.add_argument("--length-bonus", type=float, metavar="B",
                   help="added to a hypothesis's score per token (decoding.length_bonus)")
    g.add_argument("--lexicon", metavar="WORDS.txt", help="write only these words (one per line; beam search)")
    g.add_argument("--lm", metavar="LM", help="a word n-gram LM ('asr lm', ARPA: rescores the beam) or a neural "
                   "LM ('asr lm --kind transformer': fused into the search)")
    g.add_argument("--lm-weight", type=float, metavar="W", help="its weight (default: decoding.lm_weight's)")
    g.add_argument("--lm-fusion", action="store_true", default=None,
                   help="the n-gram LM inside the search, not rescoring")
    g.add_argument("--lm-word-bonus", type=float, metavar="B", help="added per word with an n-gram LM, against its "
                   "cost of each word (default: decoding.lm_word_bonus's)")
    g.add_argument("--precision", choices=PRECISIONS, help="of the encoder and the search: bf16 autocast, fp32, or "
                   "auto (bf16 on a GPU that supports it, else fp32; the default)")
    g.add_argument("--int8", action="store_true", default=None, help="int8 weights on the CPU: every weight matmul "
                   "(decoding.int8=true); with an exported model, its int8 graphs")
    g.add_argument("--device", metavar="D", help="cpu, cuda, cuda:1 (default: cuda when available; under torchrun "
                   "each asr decode process on cuda:LOCAL_RANK)")
    g.add_argument("--threads", type=_positive, metavar="N",
                   help="CPU threads of torch's operators for the whole run (default: torch's, and 1 for a search "
                   "of at most 16 hypotheses, utterances x beam, whose operators are too small to share)")


def _add_decoding_commands(sub: argparse._SubParsersAction) -> None:
    """decode, transcribe, serve, export, wer."""
    _add_decode_command(sub)
    _add_transcribe_command(sub)
    _add_serve_command(sub)
    _add_export_command(sub)
    _add_wer_command(sub)


def _add_decode_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("decode", help="decode a manifest and score it (hyp.txt, ref.txt, wer.json, errors.txt)",
                       description="Decode a manifest and score it (hyp.txt, ref.txt, wer.json, errors.txt); "
                       "resumes an interrupted run. 'torchrun --nproc_per_node N -m asr.cli decode ...' shares "
                       "the batches among N processes (one per GPU) with the same results.")
    p.add_argument("--model", required=True, metavar="MODEL.pt|DIR", help=MODEL_HELP)
    p.add_argument("--manifest", required=True, metavar="TEST.jsonl", help="the utterances to decode and score")
    p.add_argument("--out-dir", required=True, metavar="DIR", help="where the results and the journal go")
    p.add_argument("--batch-size", type=int, metavar="B", help="utterances per batch at most (decoding.batch_size)")
    p.add_argument("--plot-attention", type=_positive, metavar="N",
                   help="after decoding, draw the decoder's cross-attention (output tokens x encoder frames, a "
                   "panel per layer, mean over heads) of the first N utterances decoded, in manifest order, "
                   "into DIR/attention/<id>.png, and the encoder's and the decoder's self-attention into "
                   "<id>.encoder_self.png and <id>.decoder_self.png")
    add_decoding_flags(p)
    p.add_argument("overrides", nargs="*", metavar="decoding.key=value",
                   help="any field of asr.decoding.DecodingConfig, after --config")
    p.set_defaults(func=commands.cmd_decode)


def _add_transcribe_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transcribe", help="transcribe audio files with a model file")
    p.add_argument("--model", required=True, metavar="MODEL.pt|DIR", help=MODEL_HELP)
    p.add_argument("audio", nargs="+", metavar="AUDIO",
                   help="audio files; decoding.key=value items among them set any decoding option, after --config")
    p.add_argument("--format", choices=["txt", "json", "srt", "vtt", "tsv", "all"], default="txt",
                   help="txt (default), json, srt, vtt, tsv; all: every one (with --output-dir)")
    p.add_argument("--word-timestamps", action="store_true",
                   help="each word's start, end and confidence (json; srt / vtt / tsv: a cue per word)")
    p.add_argument("--output-dir", metavar="DIR", help="write DIR/<input name>.<format> per input instead of "
                   "printing")
    p.add_argument("--raw-rate", type=int, metavar="HZ", help="read the files as headerless PCM at this rate")
    p.add_argument("--raw-format", default="PCM_16", metavar="SUBTYPE",
                   help="sample format of raw input: PCM_16 (default), PCM_24, PCM_32, PCM_U8, FLOAT, ...")
    p.add_argument("--raw-channels", type=int, default=1, metavar="N", help="channels of raw input (default 1)")
    g = p.add_argument_group("streaming", "--streaming: each file is fed in 0.1 s pieces to a streaming "
                             "recognizer (a model with model.causal_conv), as if live; partial results go to stderr "
                             "as they come, the transcripts to stdout (or --output-dir) in --format. Partials come "
                             "from CTC prefix beam search; each final from --mode's search over its segment "
                             "(attention: the joint beam search; ctc_rescore: the prefixes rescored by the decoder)")
    g.add_argument("--streaming", action="store_true", help="recognize each file chunk by chunk as it arrives")
    g.add_argument("--chunk-size", dest="stream_chunk_size", type=_positive, metavar="N",
                   help="encoder frames per chunk (default 16: 640 ms at 4x subsampling)")
    g.add_argument("--left-chunks", dest="stream_left_chunks", type=int, metavar="L",
                   help="chunks of left context each chunk attends to (default -1: all)")
    g.add_argument("--endpoint-silence", type=float, metavar="S",
                   help="seconds of trailing silence (blank CTC frames) that end a segment (default 0: off)")
    g.add_argument("--max-segment", type=float, metavar="S", help="seconds after which a segment ends (default 0: off)")
    add_decoding_flags(p)
    p.set_defaults(func=commands.cmd_transcribe)


def _add_serve_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an HTTP API and a web page that transcribe uploads and the microphone")
    p.add_argument("--model", required=True, metavar="MODEL.pt|DIR", help=MODEL_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0 picks a free port (printed)")
    p.add_argument("--max-upload-mb", type=float, default=50.0, metavar="MB", help="largest upload (default 50)")
    p.add_argument("--max-seconds", type=float, default=600.0, metavar="S",
                   help="longest audio of one upload (default 600)")
    p.add_argument("--queue-size", type=_positive, default=16, metavar="N",
                   help="uploads waiting for the model; past it, 503 with Retry-After (default 16)")
    p.add_argument("--batch-size", type=_positive, default=8, metavar="N",
                   help="uploads decoded together (default 8)")
    p.add_argument("--batch-wait-ms", type=float, default=10.0, metavar="MS",
                   help="how long the first upload of a batch waits for others (default 10)")
    _add_client_limits(p)
    _add_access_rules(p)
    _add_streaming_options(p)
    add_decoding_flags(p)
    p.add_argument("overrides", nargs="*", metavar="decoding.key=value",
                   help="any field of asr.decoding.DecodingConfig, after --config")
    p.set_defaults(func=commands.cmd_serve)


def _add_client_limits(p: argparse.ArgumentParser) -> None:
    """serve's limits on what one client may hold."""
    g = p.add_argument_group("what clients may hold", "every limit bounds what a slow, idle or hostile client "
                             "can take from the others")
    g.add_argument("--max-uploads", type=_positive, default=16, metavar="N",
                   help="uploads being received at once; past it, 503 with Retry-After before the body (default 16)")
    g.add_argument("--max-temp-mb", type=float, default=512.0, metavar="MB",
                   help="temporary disk held by the uploads being received; past it, 503 (default 512)")
    g.add_argument("--max-connections", type=_positive, default=1000, metavar="N",
                   help="open connections, lowered to fit the open-file limit; past it the oldest connection that "
                   "is not inside a request is closed (default 1000)")
    g.add_argument("--idle-timeout", type=float, default=15.0, metavar="S",
                   help="a connection that sends no request for S seconds (or is still sending its headers) is "
                   "closed (keep-alive; default 15)")
    g.add_argument("--read-timeout", type=float, default=15.0, metavar="S",
                   help="an upload that sends nothing for S seconds is answered 408 (default 15)")
    g.add_argument("--upload-timeout", type=float, default=300.0, metavar="S",
                   help="an upload not received in S seconds is answered 408 (default 300)")
    g.add_argument("--give-way", type=float, default=2.0, metavar="S",
                   help="when the uploads or the temporary disk are full, an upload that has not sent 64 kB for S "
                   "seconds is closed to let a new one in (default 2; 0: never)")


def _add_access_rules(p: argparse.ArgumentParser) -> None:
    """serve's Host and Origin checks."""
    g = p.add_argument_group("who may call", "the Host header must name this server, and another web site's page "
                             "may not call it")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name to answer to beside localhost, 127.0.0.1, ::1 and the --host address (repeat "
                   "for more; '*': any, e.g. behind a proxy that checks it)")
    g.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="another site whose pages may call the API, e.g. https://app.example (repeat for more; "
                   "'*': any)")


def _add_streaming_options(p: argparse.ArgumentParser) -> None:
    """serve's options for GET /stream."""
    g = p.add_argument_group("streaming (GET /stream)", "a model built with model.causal_conv streams: the chunks of "
                             "all open streams are encoded together")
    g.add_argument("--chunk-size", dest="stream_chunk_size", type=_positive, metavar="N",
                   help="encoder frames per chunk, 1 to 64; a client may ask for another (default 16; an exported "
                   "model's, the only one it streams)")
    g.add_argument("--left-chunks", dest="stream_left_chunks", type=int, metavar="L",
                   help="chunks of left context a chunk attends to (default -1: all, the cache growing with the "
                   "stream up to --max-stream-seconds; an exported model's own)")
    g.add_argument("--endpoint-silence", dest="stream_endpoint_silence", type=float, default=0.5, metavar="S",
                   help="seconds of silence after words that make a final (default 0.5; 0: only at the end)")
    g.add_argument("--max-segment", dest="stream_max_segment", type=float, default=30.0, metavar="S",
                   help="seconds after which a segment is made final (default 30; 0: no limit)")
    g.add_argument("--max-streams", type=_positive, default=16, metavar="N",
                   help="streams open at once; one more is told busy (default 16)")
    g.add_argument("--max-stream-seconds", type=float, default=600.0, metavar="S",
                   help="audio one stream may send, and (plus the receive timeout) how long it may stay open "
                   "(default 600)")
    g.add_argument("--stream-receive-timeout", type=float, default=10.0, metavar="S",
                   help="a stream that sends nothing for S seconds before its end is closed (default 10)")
    g.add_argument("--heartbeat", type=float, default=20.0, metavar="S",
                   help="a ping after S seconds without data, closed without a pong (default 20; 0: none)")


def _add_export_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a model file to ONNX graphs run by onnxruntime (pip install -e "
                       "'.[export]')",
                       description="Export the encoder, the CTC head and one decoder step to ONNX in DIR, with the "
                       "tokenizer and the frontend settings; 'asr transcribe --model DIR' runs them with onnxruntime "
                       "on the CPU.")
    p.add_argument("--model", required=True, metavar="MODEL.pt")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--int8", action="store_true",
                   help="also int8 graphs (onnxruntime's dynamic quantization), used when decoding with --int8")
    p.add_argument("--streaming", action="store_true",
                   help="also the streaming encoder's graphs (Recognizer.stream, transcribe --streaming) for "
                   "--chunk-size and --left-chunks, fixed in them; a model built with model.causal_conv: true")
    p.add_argument("--chunk-size", type=_positive, metavar="N",
                   help="with --streaming: encoder frames per chunk (default 16: 640 ms at 4x subsampling)")
    p.add_argument("--left-chunks", type=int, metavar="L",
                   help="with --streaming (required): chunks of left context each chunk attends to, >= 0 (the "
                   "attention cache is a graph input of a fixed size: all, -1, cannot be exported)")
    p.set_defaults(func=commands.cmd_export)


def _add_wer_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("wer", help="word and character error rates of HYP against REF")
    p.add_argument("ref", metavar="REF", help="Kaldi-style 'ID WORDS' text file, or a manifest")
    p.add_argument("hyp", metavar="HYP", help="Kaldi-style 'ID WORDS' text file, or a manifest")
    p.add_argument("--errors", metavar="FILE", help="write per-utterance alignments, worst first")
    p.add_argument("--json", action="store_true", help="also print the counts as JSON")
    p.set_defaults(func=commands.cmd_wer)


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def _sleeping_openmp_threads() -> None:
    """OMP_WAIT_POLICY=PASSIVE for this program and what it starts, unless the environment sets it:
    torch's OpenMP threads then sleep between operators instead of spinning, which on a machine
    busy with other work made a beam search 1.9-3.4x slower in wall time and 2.5-5x costlier in CPU
    (tools/bench_decode.py beside a two-process synthesis; level alone, README). OpenMP reads it
    once, when torch loads: set only where torch is not yet imported (the `asr` program's start,
    not a caller's process)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv: list[str] | None = None) -> int:
    _sleeping_openmp_threads()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"asr {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for users; the traceback with -v or ASR_DEBUG=1
        if args.verbose or os.environ.get("ASR_DEBUG"):
            traceback.print_exc()
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"asr {args.command}: error: {reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
