"""The handlers of the `asr` subcommands (asr.cli parses the arguments): each calls the library and
prints. Library modules are imported inside the handlers so that `asr --help` answers at once."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asr.decoding import DecodingConfig
    from asr.serve import ServeOptions

DECODING_FIELDS = ("mode", "beam_size", "ctc_weight", "length_bonus", "lexicon", "lm", "lm_weight", "lm_fusion",
                   "lm_word_bonus", "precision", "int8", "device")


def cmd_prepare_librispeech(args: argparse.Namespace) -> int:
    from asr.corpora import prepare_librispeech

    speeds = _floats(args.speed_perturb)
    counts = prepare_librispeech(args.librispeech_dir, args.out_dir, _split(args.parts))
    for part, n in counts.items():
        path = Path(args.out_dir) / f"{part}.jsonl"
        if speeds and part.startswith("train"):
            n = _add_speed_copies(path, speeds)
        print(f"{path}: {n} utterances")
    return 0


def cmd_prepare_kaldi(args: argparse.Namespace) -> int:
    from asr.corpora import prepare_kaldi

    n = prepare_kaldi(args.data_dir, args.out)
    if args.speed_perturb:
        n = _add_speed_copies(Path(args.out), _floats(args.speed_perturb))
    print(f"{args.out}: {n} utterances")
    return 0


def _add_speed_copies(manifest: Path, speeds: list[float]) -> int:
    """Rewrite `manifest` with speed-perturbed copies of every line (DESIGN.md: sp<speed>-<id>)."""
    from asr.corpora import speed_perturb
    from asr.manifest import read_manifest, write_manifest

    utts = speed_perturb(read_manifest(manifest), [s for s in speeds if s != 1.0])
    write_manifest(utts, manifest)
    return len(utts)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from asr.manifest import read_manifest
    from asr.metrics import normalize_text
    from asr.tokenizer import train_tokenizer

    if args.kind != "char" and args.vocab_size is None:
        raise ValueError(f"--kind {args.kind} needs --vocab-size N")
    texts = [normalize_text(u.text) for u in read_manifest(args.manifest)]
    tokenizer = train_tokenizer(texts, args.kind, args.vocab_size)
    tokenizer.save(args.out)
    print(f"{args.out}: {args.kind} tokenizer, {tokenizer.vocab_size} ids (blank, unk, sos/eos included), "
          f"trained on {len(texts)} transcripts")
    if args.words:
        from asr.fileio import atomic_open

        words = sorted({w for t in texts for w in t.split()})
        with atomic_open(args.words) as f:
            f.writelines(w + "\n" for w in words)
        print(f"{args.words}: the {len(words)} words of those transcripts (a word list for decoding.lexicon)")
    return 0


def cmd_lm(args: argparse.Namespace) -> int:
    from asr.fileio import numbered_lines
    from asr.lm import train_ngram
    from asr.manifest import read_manifest
    from asr.metrics import normalize_text

    if not args.manifest and not args.text:
        raise ValueError("give --manifest TRAIN.jsonl or --text FILE (or both)")
    if args.kind == "transformer":
        return _train_neural_lm(args)
    unused = [flag for flag, value in (("--exp-dir", args.exp_dir), ("--tokenizer", args.tokenizer),
                                       ("--config", args.config), ("--valid", args.valid),
                                       ("key=value", args.overrides)) if value]
    if unused or not args.out:
        raise ValueError(f"--kind ngram takes --out LM.arpa{f', not {unused[0]}' if unused else ''}")
    texts = [normalize_text(u.text) for path in args.manifest for u in read_manifest(path)]
    for path in args.text:
        texts += [normalize_text(line) for _, line in numbered_lines(path)]
    sentences = [t.split() for t in texts if t]
    lm = train_ngram(sentences, order=args.order)
    lm.save(args.out)
    print(f"{args.out}: {args.order}-gram LM (interpolated Kneser-Ney) of {lm.vocab_size} words, "
          f"{' / '.join(str(len(p)) for p in lm.probs)} n-grams, from {len(sentences)} sentences "
          f"(for 'asr decode decoding.lm={args.out}')")
    return 0


def _train_neural_lm(args: argparse.Namespace) -> int:
    from asr.lm_train import load_lm_config, train_lm

    missing = [flag for flag, value in (("--exp-dir", args.exp_dir), ("--tokenizer", args.tokenizer),
                                        ("--valid", args.valid)) if not value]
    if missing or args.out:
        raise ValueError(f"--kind transformer needs {', '.join(missing)}" if missing else
                         "--kind transformer writes into --exp-dir, not --out")
    config = load_lm_config(args.config, args.overrides)
    path = train_lm(config, [*args.manifest, *args.text], args.valid, args.exp_dir, tokenizer=args.tokenizer)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{path}: the final LM; 'asr average --exp-dir {args.exp_dir}' averages the best checkpoints into "
              f"{Path(args.exp_dir) / 'lm_avg.pt'} (for 'asr decode --lm')")
    return 0


def cmd_cmvn(args: argparse.Namespace) -> int:
    from asr.features import FeatureConfig
    from asr.loader import compute_cmvn
    from asr.manifest import read_manifest

    utts = read_manifest(args.manifest)
    stats = compute_cmvn(utts, FeatureConfig(n_mels=args.n_mels), num_workers=args.num_workers,
                         dump_dir=args.dump_feats)
    stats.save(args.out)
    print(f"{args.out}: global CMVN over {int(stats.count)} frames of {len(utts)} utterances")
    if args.dump_feats:
        print(f"{args.dump_feats}: their features (float16), for 'asr train --feats {args.dump_feats}'")
    return 0


def cmd_wer(args: argparse.Namespace) -> int:
    import json

    from asr.manifest import read_transcripts
    from asr.metrics import format_errors, format_summary, score

    report = score(read_transcripts(args.ref), read_transcripts(args.hyp))
    if args.errors:
        Path(args.errors).write_text(format_errors(report), encoding="utf-8")
    if args.json:
        print(json.dumps(report.stats.to_dict()))
    print(format_summary(report.stats))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from asr.train_asr import train
    from asr.train_setup import load_experiment_config

    overrides = list(args.overrides)
    if args.init_from:
        overrides.append(f"training.init_from={args.init_from}")
    if args.init_modules:
        overrides.append(f"training.init_modules=[{args.init_modules}]")
    config = load_experiment_config(args.config, overrides)
    path = train(config, args.train, args.valid, args.exp_dir, tokenizer_dir=args.tokenizer, cmvn_path=args.cmvn,
                 feats_dir=args.feats)
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{path}: the final model; 'asr average --exp-dir {args.exp_dir}' averages the best checkpoints")
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from asr.checkpoint import average

    print(average(args.exp_dir, by=args.by, num=args.num, out=args.out))
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from asr.decode import decode_manifest, format_wer
    from asr.decoding import thread_policy

    config = _decoding_config(args, args.overrides, batch_size=args.batch_size)
    wer = decode_manifest(args.model, args.manifest, args.out_dir, config, search_threads=thread_policy(args.threads),
                          plot_attention=args.plot_attention or 0)
    if int(os.environ.get("RANK", 0)) == 0:  # under torchrun, rank 0 wrote them
        print(f"{args.out_dir}: hyp.txt ref.txt wer.json errors.txt" + (" attention/" if args.plot_attention else ""))
        print(format_wer(wer))
    return 0


def cmd_transcribe(args: argparse.Namespace) -> int:
    from asr.api import load_model
    from asr.audio import RawFormat
    from asr.decoding import thread_policy
    from asr.formats import format_results

    raw = None
    if args.raw_rate:
        raw = RawFormat(sample_rate=args.raw_rate, subtype=args.raw_format, channels=args.raw_channels)
    overrides = [a for a in args.audio if _is_override(a)]
    audio = [a for a in args.audio if not _is_override(a)]
    if not audio:
        raise ValueError("no AUDIO to transcribe")
    config = _decoding_config(args, overrides)
    _check_streaming_flags(args, config)
    recognizer = load_model(args.model, device=config.device, options=config.decoding_options(),
                            search_threads=thread_policy(args.threads))
    if args.format == "all" and not args.output_dir:
        raise ValueError("--format all needs --output-dir DIR")
    if args.output_dir:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)  # a folder that cannot be made fails first
    if args.streaming:
        results = _stream_files(recognizer, audio, raw, args)
    else:
        results = recognizer.transcribe(audio, raw=raw, word_timestamps=args.word_timestamps)
    with contextlib.suppress(AttributeError, ValueError):  # names that are not UTF-8 print as their bytes
        sys.stdout.reconfigure(errors="surrogateescape")
    failed = [r for r in results if r.error is not None]
    for r in failed:
        print(f"asr transcribe: error: {r.error}", file=sys.stderr)
    unwritten = []
    if args.output_dir:
        for path, error in _write_outputs(results, args.output_dir, args.format):
            if error is None:
                print(path, flush=True)
            else:
                unwritten.append(path)
                print(f"asr transcribe: error: cannot write {path}: {error}", file=sys.stderr)
    else:
        sys.stdout.write(format_results(results, args.format))
    if failed:
        print(f"asr transcribe: {len(failed)} of {len(results)} inputs failed", file=sys.stderr)
    if unwritten:
        print(f"asr transcribe: {len(unwritten)} output files could not be written", file=sys.stderr)
    return 1 if failed or unwritten else 0


STREAM_PIECE_SECONDS = 0.1  # transcribe --streaming feeds each file in pieces this long, as if live
STREAM_FLAGS = {"--chunk-size": "stream_chunk_size", "--left-chunks": "stream_left_chunks",  # need --streaming
                "--endpoint-silence": "endpoint_silence", "--max-segment": "max_segment"}  # (dests: not decoding's)


def _check_streaming_flags(args: argparse.Namespace, config: DecodingConfig) -> None:
    """transcribe's streaming flags: the chunk flags need --streaming; with it, what applies only
    to the whole-file search is refused (one line)."""
    if not args.streaming:
        given = [flag for flag, dest in STREAM_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --streaming")
        return
    refused = [flag for flag, on in (("--word-timestamps", args.word_timestamps), ("--lexicon", config.lexicon),
                                     ("--lm", config.lm), ("--int8", config.int8)) if on]
    if refused:
        verb = "does" if len(refused) == 1 else "do"
        raise ValueError(f"--streaming: {', '.join(refused)} {verb} not apply to a stream")


def _stream_files(recognizer, audio: list[str], raw, args: argparse.Namespace) -> list:
    """Each file fed to its own Stream (Recognizer.stream) in pieces of STREAM_PIECE_SECONDS, as
    if it arrived live (without waiting): its partial and final results to stderr as they come
    (`_event_lines`), its finals as the file's asr.api.Result (a segment per final)."""
    from asr.api import Result, Segment
    from asr.audio import SAMPLE_RATE, AudioError, iter_blocks, shown_path

    tty, results = sys.stderr.isatty(), []
    for path in audio:
        stream = recognizer.stream(args.stream_chunk_size, args.stream_left_chunks,  # None: the model's own
                                   endpoint_silence=args.endpoint_silence or 0.0, max_segment=args.max_segment or 0.0)
        name, samples, warnings = shown_path(path), 0, []
        blocks = iter_blocks(path, block_seconds=STREAM_PIECE_SECONDS, raw=raw, on_truncated=warnings.append)
        while True:
            try:
                block = next(blocks, None)
            except (AudioError, OSError, ValueError) as e:  # the file cannot be read (as in transcribe)
                error = str(e) if isinstance(e, AudioError) else f"{name}: {e}"
                break
            if block is None:
                error = None
                break
            samples += block.numel()
            sys.stderr.write(_event_lines(stream.accept_waveform(block), name, tty))
        if error is not None:
            sys.stderr.write("\n" if tty and samples else "")
            results.append(Result(os.fsdecode(path), "", error=error))
            continue
        sys.stderr.write(_event_lines(stream.finish(), name, tty))
        for warning in warnings:
            print(f"asr transcribe: warning: {warning}", file=sys.stderr)
        segments = tuple(Segment(e.start, e.end, e.text) for e in stream.finals)
        results.append(Result(os.fsdecode(path), stream.result(), tuple(t for e in stream.finals for t in e.tokens),
                              segments=segments, duration=samples / SAMPLE_RATE, warnings=tuple(warnings)))
    return results


def _event_lines(events: list, name: str, tty: bool) -> str:
    """Streaming events as stderr shows them: "partial NAME: text" and "final NAME: text", a line
    each; on a terminal a partial overwrites the line before (carriage return, erase to its end)
    and stays open until the next one or a final."""
    if not tty:
        return "".join(f"{e.kind} {name}: {e.text}\n" for e in events)
    return "".join(f"\r\x1b[K{e.kind} {name}: {e.text}" + ("\n" if e.kind == "final" else "") for e in events)


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("aiohttp") is None:
        raise ValueError("asr serve needs aiohttp: pip install -e '.[serve]'")
    from asr.api import load_model
    from asr.decoding import thread_policy
    from asr.serve import run

    options = serve_options(args)
    config = _decoding_config(args, args.overrides)
    recognizer = load_model(args.model, device=config.device, options=config.decoding_options(),
                            search_threads=thread_policy(args.threads))  # decided once, for every request
    recognizer.task()  # a bad word list or LM fails now, not at the first request
    note = binding_note(args.host, args.port, args.allowed_host)
    if note:
        print(note, file=sys.stderr)
    run(recognizer, args.host, args.port, options, announce=lambda line: print(line, flush=True))
    return 0


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """`asr serve`'s flags as asr.serve.ServeOptions."""
    from asr.serve import ServeOptions

    return ServeOptions(max_upload_mb=args.max_upload_mb, max_seconds=args.max_seconds, queue_size=args.queue_size,
                        batch_size=args.batch_size, batch_wait_ms=args.batch_wait_ms, max_uploads=args.max_uploads,
                        max_temp_mb=args.max_temp_mb, max_connections=args.max_connections,
                        idle_timeout_s=args.idle_timeout, read_timeout_s=args.read_timeout,
                        upload_timeout_s=args.upload_timeout, give_way_s=args.give_way,
                        allowed_hosts=tuple(args.allowed_host), allow_origins=tuple(args.allow_origin),
                        max_streams=args.max_streams, max_stream_seconds=args.max_stream_seconds,
                        stream_chunk_size=args.stream_chunk_size, stream_left_chunks=args.stream_left_chunks,
                        stream_endpoint_silence=args.stream_endpoint_silence,
                        stream_max_segment=args.stream_max_segment,
                        stream_receive_timeout_s=args.stream_receive_timeout, heartbeat_s=args.heartbeat)


def binding_note(host: str, port: int, allowed_hosts: list[str]) -> str | None:
    """What `asr serve --host HOST` means, for any host but a loopback one (None for those)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    if host in ("0.0.0.0", "::", ""):
        where = (f"asr serve: listening on {host or '0.0.0.0'}, every network interface of this machine: anyone who "
                 f"can reach it on port {port} can transcribe with this server (there is no authentication and no "
                 "TLS; beyond a trusted network, put it behind a proxy that has both).")
        names = ("" if allowed_hosts else " Clients must address it by an IP address, or by a name given with "
                 "--allowed-host NAME (the Host header is checked).")
        return where + names
    return (f"asr serve: listening on {host}: anyone who can reach that address on port {port} can transcribe with "
            "this server (there is no authentication and no TLS).")


def _decoding_config(args: argparse.Namespace, overrides: list[str], **values: object) -> DecodingConfig:
    """The asr.decoding.DecodingConfig of a decoding command: --config, then the `decoding.key=value`
    overrides, then the flags of add_decoding_flags and the command's own `values` (asr.decoding.
    load_decoding_config, which also refuses an LM option without an LM)."""
    from asr.decoding import load_decoding_config

    flags = {name: getattr(args, name) for name in DECODING_FIELDS}
    return load_decoding_config(args.config, overrides, **flags, **values)


def cmd_export(args: argparse.Namespace) -> int:
    import warnings

    from asr.export import export_model

    if not args.verbose:  # the exporter's and the quantizer's notes to their developers (skipped ops,
        # merged initializers, unquantized activations; onnxruntime's on the root logger)
        for name in ("", "torch.onnx"):  # torch's loggers have their own level
            logging.getLogger(name).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="torch.onnx")
    given = [flag for flag, value in (("--chunk-size", args.chunk_size), ("--left-chunks", args.left_chunks))
             if value is not None]
    if given and not args.streaming:
        raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --streaming")
    chunk_size = (args.chunk_size or 16) if args.streaming else 0
    print(export_model(args.model, args.out, int8=args.int8, chunk_size=chunk_size, left_chunks=args.left_chunks))
    return 0


def _write_outputs(results: list, folder: str, fmt: str) -> list[tuple[Path, str | None]]:
    """One file per input and format, DIR/<input's name without its suffix>.<format> (as whisper's
    CLI writes them; a name two inputs share gets -2, -3, ...), written atomically; the inputs that
    failed get none. Returns (path, None) for each file written and (path, reason) for each one
    that could not be (the others are still written)."""
    from asr.fileio import atomic_open
    from asr.formats import FORMATS, format_results

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written, used = [], set()
    for r in results:
        if r.error is not None:
            continue
        stem, n = Path(r.path).stem, 1
        while stem in used:
            n += 1
            stem = f"{Path(r.path).stem}-{n}"
        used.add(stem)
        for one in (FORMATS if fmt == "all" else (fmt,)):
            path = out / f"{stem}.{one}"
            try:
                with atomic_open(path, "wb") as f:  # names that are not UTF-8 are written as their bytes
                    f.write(format_results([r], one).encode("utf-8", "surrogateescape"))
            except OSError as e:  # the reason without the temporary file's name: the caller names `path`
                written.append((path, e.strerror or type(e).__name__))
                continue
            written.append((path, None))
    return written


def _is_override(text: str) -> bool:
    """`decoding.key=value` among transcribe's AUDIO arguments."""
    return text.startswith("decoding.") and "=" in text


def _split(text: str | None) -> list[str] | None:
    return [p for p in text.split(",") if p] if text else None


def _floats(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(p) for p in text.split(",") if p]
    except ValueError:
        raise ValueError(f"--speed-perturb expects numbers separated by commas, got '{text}'") from None
