"""`asr decode`: decode a manifest with a model file and score it, resumably.

Writes into DIR (DESIGN.md):
    hyp.txt, ref.txt   Kaldi-style "ID WORDS", sorted by id, normalized text (an id alone: empty)
    wer.json           wer, cer, substitutions, deletions, insertions, words, utterances, skipped,
                       chars, char_errors, and the search settings
    errors.txt         per-utterance alignments, worst first, then the most frequent substitutions
    decode.jsonl       the journal: a header line (model, manifest, search settings), then one line
                       per utterance ({"id", "text", "score", "nbest"?, "skipped"?}), appended and
                       flushed after every batch
The journal is what makes an interrupted run resume: a run with the same header decodes only the
utterances it lacks; other settings (or another model file) start it over. An utterance whose audio
cannot be used is an empty hypothesis (all deletions), counted in "skipped", and not retried.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from asr.api import Recognizer, load_model
from asr.config import ConfigError, load_config, to_dict
from asr.dataset import ASRDataset, Batch, Example, Skipped, collate, split_skipped
from asr.decoding import DecodingOptions, DecodingTask
from asr.fileio import atomic_open
from asr.manifest import Utterance, read_manifest
from asr.metrics import ErrorStats, format_errors, format_summary, normalize_text, score
from asr.sampler import greedy_batches, longest_first

__all__ = ["JOURNAL", "DecodingConfig", "decode_manifest", "format_wer", "load_decoding_config", "write_outputs"]

log = logging.getLogger(__name__)

JOURNAL = "decode.jsonl"
_JOURNAL_FORMAT = "asr-decode-journal"


@dataclass(frozen=True)
class DecodingConfig(DecodingOptions):
    """What `asr decode` and `asr transcribe` read: the decoding (asr.decoding.DecodingOptions:
    the search, the lexicon, the LM) and, for `asr decode`, the batching and the device.
    conf/decode/*.yaml hold these fields at the top level; nbest hypotheses per utterance go to
    the journal, the best to hyp.txt."""

    batch_size: int = 32  # utterances per batch at most
    max_batch_seconds: float = 600.0  # padded seconds (longest x count) per batch at most
    num_workers: int = 2  # processes reading audio and computing features
    device: str = "auto"  # auto: cuda when available, else cpu

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, ok in (("batch_size", self.batch_size >= 1), ("max_batch_seconds", self.max_batch_seconds > 0),
                         ("num_workers", self.num_workers >= 0)):
            if not ok:
                raise ValueError(f"decoding.{name} = {getattr(self, name)!r} must be positive")

    def decoding_options(self) -> DecodingOptions:
        """The decoding fields alone (what the results depend on)."""
        return DecodingOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DecodingOptions)})


def load_decoding_config(path: str | None, overrides: Sequence[str] = (), **cli_values: Any) -> DecodingConfig:
    """Defaults, then the YAML file `path` (None: none), then `decoding.key=value` overrides (any
    field), then the command-line values given (a field's name = value; None keeps). Unknown keys
    and bad values raise ConfigError naming them."""
    keys = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.startswith("decoding."):
            raise ConfigError(f"override '{item}': expected decoding.key=value")
        keys.append(item[len("decoding."):])
    config = load_config(DecodingConfig, path, keys)
    flags = {k: v for k, v in cli_values.items() if v is not None}
    unknown = sorted(set(flags) - {f.name for f in dataclasses.fields(DecodingConfig)})
    if unknown:
        raise ConfigError(f"unknown decoding option '{unknown[0]}'")
    try:
        return dataclasses.replace(config, **flags)
    except ValueError as e:
        raise ConfigError(f"command line: {e}") from None


def decode_manifest(model_path: str | os.PathLike, manifest_path: str | os.PathLike, out_dir: str | os.PathLike,
                    config: DecodingConfig, *, search_threads: int | None = None) -> dict[str, Any]:
    """Decode every utterance of the manifest (resuming from out_dir's journal), write hyp.txt,
    ref.txt, wer.json and errors.txt into out_dir, and return the wer.json dict. Progress and the
    real-time factor go to stderr. A malformed manifest raises ManifestError (file:line) before
    anything is decoded; a bad model file CheckpointError, a bad word list LexiconError, a bad LM
    file LMError. `search_threads`: see asr.decoding.DecodingTask."""
    utts = read_manifest(manifest_path)
    recognizer = load_model(model_path, device=config.device, options=config.decoding_options(),
                            search_threads=search_threads)
    if config.lexicon:
        lexicon = recognizer.lexicon(config.lexicon)
        unspellable = f" ({lexicon.unspellable} the tokenizer cannot spell, left out)" if lexicon.unspellable else ""
        print(f"decode: lexicon {config.lexicon}: {lexicon.num_words} words{unspellable}", file=sys.stderr)
    if config.lm:
        lm = recognizer.language_model(config.lm)
        print(f"decode: LM {config.lm}: {lm.order}-gram, {lm.vocab_size} words, weight {config.lm_weight}"
              + (f", word bonus {config.lm_word_bonus}" if config.lm_word_bonus else "")
              + (", fused into the search" if config.lm_fusion else ""),
              file=sys.stderr)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    journal = _Journal(out / JOURNAL, _header(model_path, manifest_path, config))
    done = journal.load()
    todo = [u for u in utts if u.id not in done]
    if len(todo) < len(utts):
        print(f"decode: resuming, {len(utts) - len(todo)} of {len(utts)} utterances already decoded", file=sys.stderr)
    with journal:
        _decode(recognizer, recognizer.task(), todo, config, journal)
    return write_outputs(out, utts, journal.records, config)


def format_wer(wer: dict[str, Any]) -> str:
    """The one-line summary of a wer.json dict (asr.metrics.format_summary), with the skipped count."""
    stats = ErrorStats(**{f.name: wer[f.name] for f in dataclasses.fields(ErrorStats)})
    skipped = wer.get("skipped", 0)
    return format_summary(stats) + (f" ({skipped} skipped: empty hypotheses)" if skipped else "")


# ---------------------------------------------------------------------------------------------
# decoding


def _decode(recognizer: Recognizer, task: DecodingTask, utts: list[Utterance], config: DecodingConfig,
            journal: _Journal) -> None:
    """Decode `utts` in batches of similar durations, longest first, appending to the journal."""
    if not utts:
        return
    dataset = ASRDataset(utts, None, features=recognizer.features)
    durations = [u.duration for u in utts]  # longest first: a batch pads little
    batches = greedy_batches(longest_first(durations), durations, config.max_batch_seconds,
                             max_count=config.batch_size)
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=_collate, num_workers=config.num_workers)
    seconds = {u.id: u.duration for u in utts}
    audio, start = 0.0, time.perf_counter()
    with tqdm(total=len(utts), desc="decode", unit="utt", file=sys.stderr, disable=None, dynamic_ncols=True) as bar:
        for batch, skipped in loader:
            records = [{"id": utt_id, "text": "", "score": None, "skipped": reason} for utt_id, reason in skipped]
            for utt_id, reason in skipped:
                log.warning("%s: %s; skipped (empty hypothesis)", utt_id, reason)
            records += _decode_within_memory(recognizer, task, batch)
            journal.append(records)
            audio += sum(seconds[r["id"]] for r in records)
            bar.update(len(records))
            bar.set_postfix(rtf=f"{(time.perf_counter() - start) / max(audio, 1e-9):.3f}")
    elapsed = time.perf_counter() - start
    print(f"decode: {len(utts)} utterances, {audio:.1f} s of audio in {elapsed:.1f} s: "
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
    feats = recognizer.cmvn(batch.feats.to(recognizer.device))  # (B, T, D); padding is never read
    found = task.run([f[:n] for f, n in zip(feats, batch.feat_lens.tolist())])
    records = []
    for utt_id, nbest in zip(batch.ids, found):
        record = {"id": utt_id, "text": recognizer.text(nbest[0].tokens), "score": _json_number(nbest[0].score)}
        if task.options.nbest > 1:
            record["nbest"] = [{"text": recognizer.text(h.tokens), "score": _json_number(h.score)} for h in nbest]
        records.append(record)
    return records


def _json_number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _collate(items: list[Example | Skipped]) -> tuple[Batch, list[tuple[str, str]]]:
    kept, skipped = split_skipped(items)
    return collate(kept), [(s.id, s.reason) for s in skipped]


# ---------------------------------------------------------------------------------------------
# the journal and the outputs


def _header(model_path: str | os.PathLike, manifest_path: str | os.PathLike, config: DecodingConfig) -> dict[str, Any]:
    """What the results depend on: the model file (path, size, time), the manifest, the search
    (and the word list's and the LM's size and time when there are ones)."""
    model = Path(model_path).resolve()
    stat = model.stat()
    header = {"format": _JOURNAL_FORMAT, "model": str(model), "model_size": stat.st_size,
              "model_mtime_ns": stat.st_mtime_ns, "manifest": str(Path(manifest_path).resolve()),
              "search": to_dict(config.decoding_options())}
    for name in ("lexicon", "lm"):
        if getattr(config, name):
            path = Path(getattr(config, name)).resolve()
            stat = path.stat()
            header[name] = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return header


class _Journal:
    """DIR/decode.jsonl: the header, then one JSON line per decoded utterance."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path, self.header = path, header
        self.records: dict[str, dict[str, Any]] = {}
        self.file = None

    def load(self) -> dict[str, dict[str, Any]]:
        """The records of a journal with this header (a line cut short by an interruption and
        what follows it are dropped); the journal is rewritten with them and the header."""
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.exists() else []
        if lines and _json_or_none(lines[0]) != {"header": self.header}:
            print(f"decode: {self.path} was written with other settings or another model file; "
                  "decoding from the start", file=sys.stderr)
            lines = []
        for line in lines[1:]:
            record = _json_or_none(line)
            if not isinstance(record, dict) or not isinstance(record.get("id"), str):
                break
            self.records[record["id"]] = record
        with atomic_open(self.path) as f:
            f.writelines(json.dumps(r) + "\n" for r in [{"header": self.header}, *self.records.values()])
        return self.records

    def __enter__(self) -> _Journal:
        self.file = open(self.path, "a", encoding="utf-8")  # closed by __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def append(self, records: list[dict[str, Any]]) -> None:
        self.file.writelines(json.dumps(r) + "\n" for r in records)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.records.update((r["id"], r) for r in records)


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

