"""`asr decode`: decode a manifest with a model file and score it, resumably, in one process or
in the N processes of a torchrun job.

Writes into DIR (DESIGN.md):
    hyp.txt, ref.txt   Kaldi-style "ID WORDS", sorted by id, normalized text (an id alone: empty)
    wer.json           wer, cer, substitutions, deletions, insertions, words, utterances, skipped,
                       chars, char_errors, and the search settings
    errors.txt         per-utterance alignments, worst first, then the most frequent substitutions
    decode.jsonl       the journal: a header line (model, manifest, search settings, the precision
                       they mean on this device), then one line per utterance ({"id", "text",
                       "score", "nbest"?, "skipped"?}), appended and flushed after every batch
    attention/<id>.png with --plot-attention N: the decoder's cross-attention (asr.attention_plot),
                       and <id>.encoder_self.png, <id>.decoder_self.png the self-attentions, of
                       the first N utterances decoded, in manifest order; drawn by rank 0 after
                       decoding (each decoded again alone for its tokens), outside the decoding loop
The journal is what makes an interrupted run resume: a run with the same header decodes only the
utterances it lacks; other settings (or another model file) start it over. An utterance whose audio
cannot be used is an empty hypothesis (all deletions), counted in "skipped", and not retried.

Several processes (`torchrun --nproc_per_node N -m asr.cli decode ...`; gloo on the CPU, NCCL on
GPUs, rank k on cuda:LOCAL_RANK): every rank builds the batches one process would (longest first,
from the utterances left to do) and decodes batch k when k % N is its rank, so each utterance is
decoded in the same batch as in one process. Rank k journals into DIR/decode.rank<k>.jsonl (the
same header); at the end rank 0 gathers the ranks' records, writes decode.jsonl with all of them
(in batch order), removes the ranks' journals and writes the outputs, byte for byte those of one
process at the same thread count. A run that starts, with any N (1 too), first has rank 0 merge
decode.jsonl and every decode.rank<k>.jsonl (any k, such as those a killed job of another N left)
of the same header into decode.jsonl and remove the latter; the utterances found there are not
decoded again, and the batches of the others are built and dealt to the N ranks anew. Its outputs
are those of one process resuming from the same journals. A job on several machines needs DIR on a
file system they share.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm import tqdm

from asr.api import Recognizer, load_model, resolve_device
from asr.config import to_dict
from asr.dataset import Batch, Example, Skipped, collate, split_skipped
from asr.decoding import DecodingConfig, DecodingTask
from asr.distributed import Context, collective_errors, end_process, setup_process, sigterm_stops
from asr.export import EXPORT_FILE
from asr.fileio import atomic_open
from asr.lm import NgramLM
from asr.manifest import Utterance, read_manifest
from asr.metrics import ErrorStats, format_errors, format_summary, normalize_text, score
from asr.sampler import greedy_batches, longest_first

__all__ = ["JOURNAL", "decode_manifest", "format_wer", "plot_attention", "write_outputs"]

log = logging.getLogger(__name__)

JOURNAL = "decode.jsonl"
_RANK_JOURNAL = re.compile(r"decode\.rank(\d+)\.jsonl")  # a rank's journal in a job of several processes
_JOURNAL_FORMAT = "asr-decode-journal"

Records = dict[str, dict[str, Any]]  # utterance id -> its journal record


def decode_manifest(model_path: str | os.PathLike, manifest_path: str | os.PathLike, out_dir: str | os.PathLike,
                    config: DecodingConfig, *, search_threads: int | None = None,
                    plot_attention: int = 0) -> dict[str, Any]:
    """Decode every utterance of the manifest (resuming from out_dir's journals), write hyp.txt,
    ref.txt, wer.json and errors.txt into out_dir, and return the wer.json dict. Progress and the
    real-time factor go to stderr. Under torchrun, each rank decodes its share of the batches, rank
    0 writes the files, and every rank returns the dict (module docstring). A malformed manifest
    raises ManifestError (file:line) before anything is decoded; a bad model file CheckpointError,
    a bad word list LexiconError, a bad LM file LMError. `search_threads`: see
    asr.decoding.DecodingTask. `plot_attention` N > 0: rank 0 then draws the attention pictures of
    the first N utterances into out_dir/attention (`plot_attention`)."""
    utts = read_manifest(manifest_path)
    ctx = setup_process(device=_rank_device(config.device))
    out = Path(out_dir)

    def hint() -> str:
        return f"the same command resumes from the journals in {out}"

    try:
        with sigterm_stops(ctx, hint), collective_errors(ctx, hint):
            return _decode_manifest(ctx, model_path, manifest_path, utts, out, config, search_threads,
                                    plot_attention)
    finally:
        end_process(ctx)


def _rank_device(device: str) -> str:
    """The device of this process: `device`, except that under torchrun "cuda" is this rank's GPU
    (auto is, in asr.distributed.setup_process); one GPU named for several processes is an error."""
    resolve_device(device)  # a bad name: ValueError
    world, local = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))
    if world > 1 and device == "cuda":
        return f"cuda:{local}"
    if world > 1 and device.startswith("cuda:"):
        raise ValueError(f"decoding.device = {device!r} names one GPU for {world} processes: use auto or cuda "
                         "(each rank on cuda:LOCAL_RANK)")
    return device


def _decode_manifest(ctx: Context, model_path: str | os.PathLike, manifest_path: str | os.PathLike,
                     utts: list[Utterance], out: Path, config: DecodingConfig,
                     search_threads: int | None, pictures: int) -> dict[str, Any]:
    """decode_manifest in this process of the job `ctx`."""
    recognizer = load_model(model_path, device=ctx.device, options=config.decoding_options(),
                            search_threads=search_threads)
    task = recognizer.task()  # a bad word list or LM fails here
    if ctx.main:
        _describe(recognizer, config, task)
    header = _header(model_path, manifest_path, config, task.precision)
    out.mkdir(parents=True, exist_ok=True)
    done = _merge_journals(out, header) if ctx.main else {}
    done_ids = set(_broadcast(ctx, sorted(done)))
    todo = [u for u in utts if u.id not in done_ids]
    if ctx.main and len(todo) < len(utts):
        print(f"decode: resuming, {len(utts) - len(todo)} of {len(utts)} utterances already decoded", file=sys.stderr)
    start = time.perf_counter()
    path = out / (f"decode.rank{ctx.rank}.jsonl" if ctx.distributed else JOURNAL)
    with _Journal(path, header, new=ctx.distributed) as journal:
        decoded = _decode(recognizer, task, todo, config, journal, ctx)
    shares = _gather(ctx, decoded)  # rank 0: every rank's (batch index, records) of each batch
    wer = None
    if ctx.main:
        batches = sorted((b for share in shares for b in share), key=lambda b: b[0])
        records = done | {r["id"]: r for _, batch in batches for r in batch}
        if ctx.distributed:
            _write_journal(out, header, records)
        if todo:
            _report_speed(todo, time.perf_counter() - start, ctx.world_size)
        wer = write_outputs(out, utts, records, config)
        if pictures:
            plot_attention(recognizer, task, utts, records, out / "attention", pictures)
    return _broadcast(ctx, wer)


def _describe(recognizer: Recognizer, config: DecodingConfig, task: DecodingTask) -> None:
    """The word list, the LM and a bf16 precision, on stderr."""
    if config.lexicon:
        lexicon = recognizer.lexicon(config.lexicon)
        unspellable = f" ({lexicon.unspellable} the tokenizer cannot spell, left out)" if lexicon.unspellable else ""
        print(f"decode: lexicon {config.lexicon}: {lexicon.num_words} words{unspellable}", file=sys.stderr)
    if config.lm:
        lm = recognizer.language_model(config.lm)
        if isinstance(lm, NgramLM):
            print(f"decode: LM {config.lm}: {lm.order}-gram, {lm.vocab_size} words, weight {config.lm_weight}"
                  + (f", word bonus {config.lm_word_bonus}" if config.lm_word_bonus else "")
                  + (", fused into the search" if config.lm_fusion else ""),
                  file=sys.stderr)
        else:
            c = lm.config
            print(f"decode: LM {config.lm}: transformer ({c.n_layers} layers, d_model {c.d_model}) on the model's "
                  f"{c.vocab_size} tokens, weight {config.lm_weight}, fused into the search"
                  + (f" (lm_word_bonus {config.lm_word_bonus} is an n-gram LM's: not used)" if config.lm_word_bonus
                     else ""), file=sys.stderr)
    if task.precision != "fp32":
        print(f"decode: {task.precision} autocast on {recognizer.device}", file=sys.stderr)
    if config.int8:
        print("decode: int8 weights", file=sys.stderr)


def _gather(ctx: Context, obj: Any) -> list[Any] | None:
    """Rank 0: every rank's `obj`, by rank; the other ranks: None."""
    if not ctx.distributed:
        return [obj]
    objects = [None] * ctx.world_size if ctx.main else None
    dist.gather_object(obj, objects, dst=0)
    return objects


def _broadcast(ctx: Context, obj: Any) -> Any:
    """Rank 0's `obj`, on every rank."""
    if not ctx.distributed:
        return obj
    objects = [obj]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def format_wer(wer: dict[str, Any]) -> str:
    """The one-line summary of a wer.json dict (asr.metrics.format_summary), with the skipped count."""
    stats = ErrorStats(**{f.name: wer[f.name] for f in dataclasses.fields(ErrorStats)})
    skipped = wer.get("skipped", 0)
    return format_summary(stats) + (f" ({skipped} skipped: empty hypotheses)" if skipped else "")


# ---------------------------------------------------------------------------------------------
# decoding


def _decode(recognizer: Recognizer, task: DecodingTask, utts: list[Utterance], config: DecodingConfig,
            journal: _Journal, ctx: Context) -> list[tuple[int, list[dict[str, Any]]]]:
    """Decode this rank's share of `utts`: of the batches one process would decode (similar
    durations, longest first), batch k when k % world_size is this rank, appending to the journal.
    Returns (k, records) of each batch."""
    durations = [u.duration for u in utts]  # longest first: a batch pads little
    batches = greedy_batches(longest_first(durations), durations, config.max_batch_seconds,
                             max_count=config.batch_size) if utts else []
    mine = list(range(ctx.rank, len(batches), ctx.world_size))
    if not mine:
        return []
    loader = DataLoader(recognizer.dataset(utts), batch_sampler=[batches[k] for k in mine], collate_fn=_collate,
                        num_workers=config.num_workers)
    seconds = {u.id: u.duration for u in utts}
    decoded, audio, start = [], 0.0, time.perf_counter()
    total = sum(len(batches[k]) for k in mine)
    with tqdm(total=total, desc="decode", unit="utt", file=sys.stderr, disable=None if ctx.main else True,
              dynamic_ncols=True) as bar:
        for k, (batch, skipped) in zip(mine, loader):
            records = [{"id": utt_id, "text": "", "score": None, "skipped": reason} for utt_id, reason in skipped]
            for utt_id, reason in skipped:
                log.warning("%s: %s; skipped (empty hypothesis)", utt_id, reason)
            records += _decode_within_memory(recognizer, task, batch)
            journal.append(records)
            decoded.append((k, records))
            audio += sum(seconds[r["id"]] for r in records)
            bar.update(len(records))
            bar.set_postfix(rtf=f"{(time.perf_counter() - start) / max(audio, 1e-9):.3f}")
    return decoded


def _report_speed(utts: list[Utterance], elapsed: float, processes: int) -> None:
    """The real-time factor of decoding `utts` in `elapsed` seconds, on stderr."""
    audio = sum(u.duration for u in utts)
    by = f" by {processes} processes" if processes > 1 else ""
    print(f"decode: {len(utts)} utterances, {audio:.1f} s of audio in {elapsed:.1f} s{by}: "
          f"real-time factor {elapsed / max(audio, 1e-9):.4f}, {len(utts) / max(elapsed, 1e-9):.2f} utterances/s",
          file=sys.stderr)


def _decode_within_memory(recognizer: Recognizer, task: DecodingTask, batch: Batch) -> list[dict[str, Any]]:
    """The records of `_decode_batch`; a batch that runs out of memory is decoded one utterance at
    a time, and an utterance that does not fit alone is an empty hypothesis (reported, counted in
    "skipped"), so that a rerun does not stop at it again."""
    try:
        return _decode_batch(recognizer, task, batch)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not _out_of_memory(e):
            raise
        reason = " ".join(str(e).split())[:160]
    if len(batch.ids) == 1:
        log.warning("%s: out of memory even alone (%s); skipped (empty hypothesis)", batch.ids[0], reason)
        return [{"id": batch.ids[0], "text": "", "score": None, "skipped": f"out of memory ({reason})"}]
    log.warning("a batch of %d utterances ran out of memory; decoding them one at a time", len(batch.ids))
    return [r for i in range(len(batch.ids)) for r in _decode_within_memory(recognizer, task, _row(batch, i))]


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's."""
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(e)


def _row(batch: Batch, i: int) -> Batch:
    """Utterance i of a padded batch, alone and unpadded."""
    frames, tokens = int(batch.feat_lens[i]), int(batch.token_lens[i])
    return Batch(batch.ids[i:i + 1], batch.feats[i:i + 1, :frames], batch.feat_lens[i:i + 1],
                 batch.tokens[i:i + 1, :tokens], batch.token_lens[i:i + 1])


def _decode_batch(recognizer: Recognizer, task: DecodingTask, batch: Batch) -> list[dict[str, Any]]:
    if not batch.ids:
        return []
    feats = batch.feats.to(recognizer.device)  # (B, T, D) normalized (Recognizer.dataset); padding is never read
    found = task.run([f[:n] for f, n in zip(feats, batch.feat_lens.tolist())])
    records = []
    for utt_id, nbest in zip(batch.ids, found):
        record = {"id": utt_id, "text": recognizer.text(nbest[0].tokens), "score": _json_number(nbest[0].score)}
        if task.options.nbest > 1:
            record["nbest"] = [{"text": recognizer.text(h.tokens), "score": _json_number(h.score)} for h in nbest]
        records.append(record)
    return records


@torch.no_grad()
def plot_attention(recognizer: Recognizer, task: DecodingTask, utts: list[Utterance], records: Records,
                   folder: Path, count: int) -> list[Path]:
    """Attention pictures (asr.attention_plot, each kind of KINDS) of the first `count` utterances of
    the manifest, in its order, that were decoded (not skipped) and hold an encoder frame:
    folder/<id>.png (cross-attention), folder/<id>.<kind>.png (the others; picture_name), the best
    hypothesis teacher-forced over the utterance's encoder output alone. The journal keeps only
    text, so each is decoded again, alone, for its tokens (the search finds the same best
    hypothesis alone as in a batch). A step of its own after decoding; the paths written."""
    from asr.attention_plot import attention_pictures, picture_name, write_png

    start, drawn, written = time.perf_counter(), 0, []
    for utt in utts:
        if drawn == count:
            break
        example = None if records[utt.id].get("skipped") else recognizer.dataset([utt])[0]
        if not isinstance(example, Example) or example.feats.size(0) < recognizer.model.min_frames:
            continue
        feats = example.feats.to(recognizer.device)  # (T, D)
        memory, memory_lens = task.encode([feats])  # (1, S, d)
        tokens = task.decode_memory(memory, memory_lens)[0][0].tokens
        images = attention_pictures(recognizer.model, recognizer.tokenizer, feats, tokens,
                                    title=f"{utt.id}: {recognizer.text(tokens)}")
        written += [write_png(image, folder / picture_name(utt.id, kind)) for kind, image in images.items()]
        drawn += 1
    print(f"decode: attention pictures of {drawn} utterances in {folder} "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return written


def _json_number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _collate(items: list[Example | Skipped]) -> tuple[Batch, list[tuple[str, str]]]:
    kept, skipped = split_skipped(items)
    return collate(kept), [(s.id, s.reason) for s in skipped]


# ---------------------------------------------------------------------------------------------
# the journal and the outputs


def _header(model_path: str | os.PathLike, manifest_path: str | os.PathLike, config: DecodingConfig,
            precision: str) -> dict[str, Any]:
    """What the results depend on: the model file (path, size, time), the manifest, the search
    (and the word list's and the LM's size and time when there are ones), the precision it means
    on this device ("fp32" or "bf16"). An export folder (asr.export) is stamped by its export.json,
    which every export rewrites."""
    model = Path(model_path).resolve()
    stat = (model / EXPORT_FILE if model.is_dir() else model).stat()
    header = {"format": _JOURNAL_FORMAT, "model": str(model), "model_size": stat.st_size,
              "model_mtime_ns": stat.st_mtime_ns, "manifest": str(Path(manifest_path).resolve()),
              "search": to_dict(config.decoding_options()), "precision": precision}
    for name in ("lexicon", "lm"):
        if getattr(config, name):
            path = Path(getattr(config, name)).resolve()
            stat = path.stat()
            header[name] = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return header


def _merge_journals(out: Path, header: dict[str, Any]) -> Records:
    """The records of out/decode.jsonl and of the ranks' journals out/decode.rank<k>.jsonl (any k)
    that have this header (in each, a line cut short by an interruption and what follows it are
    dropped); decode.jsonl is rewritten with them and the ranks' journals removed."""
    ranks = sorted((p for p in out.iterdir() if _RANK_JOURNAL.fullmatch(p.name)),
                   key=lambda p: int(_RANK_JOURNAL.fullmatch(p.name)[1]))
    records: Records = {}
    for path in [out / JOURNAL, *ranks]:
        records |= _read_journal(path, header)
    _write_journal(out, header, records)
    return records


def _read_journal(path: Path, header: dict[str, Any]) -> Records:
    """The records of the journal at `path` when its header is `header` (none else, said on stderr)."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    if lines and _json_or_none(lines[0]) != {"header": header}:
        print(f"decode: {path} was written with other settings or another model file; "
              "its utterances are decoded again", file=sys.stderr)
        return {}
    records: Records = {}
    for line in lines[1:]:
        record = _json_or_none(line)
        if not isinstance(record, dict) or not isinstance(record.get("id"), str):
            break
        records[record["id"]] = record
    return records


def _write_journal(out: Path, header: dict[str, Any], records: Records) -> None:
    """out/decode.jsonl: the header and `records`, replaced at once; the ranks' journals removed."""
    with atomic_open(out / JOURNAL) as f:
        f.writelines(json.dumps(r) + "\n" for r in [{"header": header}, *records.values()])
    for path in out.iterdir():
        if _RANK_JOURNAL.fullmatch(path.name):
            path.unlink()


class _Journal:
    """A journal being appended to: one JSON line per decoded utterance, flushed and synced after
    every batch; `new`: the file is started with the header line (else it holds one)."""

    def __init__(self, path: Path, header: dict[str, Any], *, new: bool) -> None:
        self.path, self.header, self.new = path, header, new
        self.file = None

    def __enter__(self) -> _Journal:
        self.file = open(self.path, "w" if self.new else "a", encoding="utf-8")  # closed by __exit__
        if self.new:
            self.append([{"header": self.header}])
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def append(self, records: list[dict[str, Any]]) -> None:
        self.file.writelines(json.dumps(r) + "\n" for r in records)
        self.file.flush()
        os.fsync(self.file.fileno())


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def write_outputs(out: Path, utts: list[Utterance], records: dict[str, dict[str, Any]],
                  config: DecodingConfig) -> dict[str, Any]:
    """hyp.txt, ref.txt, wer.json and errors.txt of the manifest's utterances, from their records
    ({"text", "skipped"?} by id) and the config that decoded them; the wer.json dict."""
    hyps = {u.id: normalize_text(records[u.id]["text"]) for u in utts}
    refs = {u.id: normalize_text(u.text) for u in utts}
    report = score(refs, hyps, normalize=False)
    for name, texts in (("hyp.txt", hyps), ("ref.txt", refs)):
        with atomic_open(out / name) as f:
            f.writelines(f"{utt_id} {texts[utt_id]}".rstrip() + "\n" for utt_id in sorted(texts))
    wer = report.stats.to_dict(skipped=sum(bool(records[u.id].get("skipped")) for u in utts))
    wer["decoding"] = to_dict(config.decoding_options())
    with atomic_open(out / "wer.json") as f:
        f.write(json.dumps(wer, indent=2) + "\n")
    with atomic_open(out / "errors.txt") as f:
        f.write(format_errors(report))
    return wer

