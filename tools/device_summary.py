"""The summary of tools/device_check.sh: this tree against the baseline from the JSON files the
run wrote (gpu_check.py's, gpu_decode_check.py's), the parts' exit statuses and the gpu-marked
tests' result line from the log. Prints one table and writes OUT/summary.json.

    python tools/device_summary.py OUT [--parts PARTS.tsv] [--log OUT/log]

Standard library only: it runs even where torch would not import. A part that did not run (or
wrote nothing) shows as missing; the issue's goals are printed beside the ratios: audio-s/s of
this tree / the baseline >= 3x at the config's micro-batch (the first measured) and >= 2x at the
larger one; decoding RTF at batch 32 at least 3x better than the 0.0100 measured at 37a736d.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PAIRS = {"100h": ("ours_100h", "base_100h"), "960h": ("ours_960h", "base_960h")}
GOALS = (3.0, 2.0)  # audio-s/s ratio at the config's micro-batch, at the larger one (issue 45)
BASELINE_RTF = 0.0100  # batch-32 decoding RTF at 37a736d (issue 45)
TOP_KERNELS = 5


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_parts(path: Path | None) -> dict[str, dict]:
    """name -> {"status": exit status or "skipped", "seconds"} of the parts' table (tab-separated)."""
    parts = {}
    if path and path.exists():
        for line in path.read_text().splitlines():
            name, status, seconds = line.split("\t")
            parts[name] = {"status": status if status == "skipped" else int(status), "seconds": int(seconds)}
    return parts


def pytest_result(log: Path | None) -> str | None:
    """The gpu-marked tests' last result line ("3 passed, 600 deselected in 20.1s") from the log."""
    if not log or not log.exists():
        return None
    text = log.read_text(errors="replace")
    section = text.split("== gpu_tests", 1)[-1].split("\n== gpu_tests:", 1)[0] if "== gpu_tests" in text else ""
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*?)\s*=*$", section, re.M)
    return found[-1] if found else None


def _f(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def training_rows(ours: dict | None, base: dict | None) -> list[dict]:
    """One row per (micro-batch, tree) of a config, and the ratio of the two trees' audio-s/s."""
    rows = []
    caps = [r["batch_seconds"] for r in (ours or base or {}).get("runs", [])]
    for i, cap in enumerate(caps):
        pair = {}
        for tree, report in (("this tree", ours), ("baseline", base)):
            run = next((r for r in (report or {}).get("runs", []) if r["batch_seconds"] == cap), None)
            pair[tree] = run
            rows.append(_training_row(cap, tree, run))
        a, b = pair["this tree"], pair["baseline"]
        ratio = a["audio_s_per_s"] / b["audio_s_per_s"] if a and b and "error" not in a and "error" not in b else None
        goal = GOALS[0] if i == 0 else GOALS[1]
        rows.append({"batch_seconds": cap, "tree": "this tree / baseline", "ratio": ratio, "goal": goal,
                     "met": None if ratio is None else ratio >= goal})
    return rows


def _training_row(cap: float, tree: str, run: dict | None) -> dict:
    if run is None or "error" in run:
        return {"batch_seconds": cap, "tree": tree, "error": "missing" if run is None else run["error"]}
    profile = run.get("profile") or {}
    return {"batch_seconds": cap, "tree": tree, "audio_s_per_s": run["audio_s_per_s"],
            "median_step_ms": run["median_step_ms"], "mfu": run.get("mfu"), "mfu_padded": run.get("mfu_padded"),
            "gpu_busy": profile.get("gpu_busy"), "gpu_ms_per_step": profile.get("gpu_ms_per_step"),
            "host_ms_per_step": profile.get("host_ms_per_step"), "launches_per_step": profile.get("launches_per_step"),
            "host_syncs_per_step": profile.get("host_syncs_per_step"),
            "sync_debug_syncs_per_step": run.get("sync_debug_syncs_per_step"),
            "peak_memory_gib": run.get("peak_memory_gib"), "distinct_shapes": run.get("distinct_shapes"),
            "steps": run.get("steps"), "top_kernels": profile.get("top_kernels", [])[:TOP_KERNELS]}


HEADER = (f"{'config':<7}{'cap s':>7}  {'tree':<21}{'audio s/s':>10}{'step ms':>9}{'MFU':>7}{'GPU busy':>9}"
          f"{'GPU ms':>8}{'host ms':>8}{'launches':>9}{'syncs':>7}{'peak GiB':>9}")


def format_training(name: str, rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        head = f"{name:<7}{r['batch_seconds']:>7g}  {r['tree']:<21}"
        if "ratio" in r:
            met = "" if r["met"] is None else ("  goal met" if r["met"] else "  goal NOT met")
            lines.append(f"{head}{_f(r['ratio'], '.2f') + 'x':>10}   (goal >= {r['goal']:g}x){met}")
        elif "error" in r:
            lines.append(f"{head}{r['error']}")
        else:
            lines.append(f"{head}{r['audio_s_per_s']:>10,.0f}{r['median_step_ms']:>9.0f}{_f(r['mfu'], '.1%'):>7}"
                         f"{_f(r['gpu_busy'], '.1%'):>9}{_f(r['gpu_ms_per_step'], '.0f'):>8}"
                         f"{_f(r['host_ms_per_step'], '.0f'):>8}{_f(r['launches_per_step'], ',.0f'):>9}"
                         f"{_f(r['host_syncs_per_step'], '.1f'):>7}{_f(r['peak_memory_gib'], '.1f'):>9}")
    return lines


def decoding_rows(ours: dict | None, base: dict | None) -> list[dict]:
    rows = []
    for tree, report in (("this tree", ours), ("baseline", base)):
        d = (report or {}).get("decoding")
        rows.append({"tree": tree, **({"error": "missing"} if d is None else {
            k: d.get(k) for k in ("batch", "beam", "ctc_weight", "rtf", "utts_per_s", "host_syncs", "search_steps",
                                  "host_syncs_per_step", "peak_memory_gib")})})
    return rows


def format_decoding(rows: list[dict]) -> list[str]:
    lines = [f"{'decoding (beam 10 + CTC 0.3, bf16)':<36}{'batch':>6}{'RTF':>9}{'utt/s':>8}{'syncs/step':>11}"
             f"{'vs 0.0100':>10}"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['tree']:<34}{r['error']}")
            continue
        better = BASELINE_RTF / r["rtf"] if r.get("rtf") else None
        lines.append(f"  {r['tree']:<34}{r['batch']:>6}{_f(r['rtf'], '.4f'):>9}{_f(r['utts_per_s'], '.1f'):>8}"
                     f"{_f(r['host_syncs_per_step'], '.2f'):>11}{_f(better, '.1f') + 'x':>10}")
    return lines


def summarize(out: Path, parts: dict[str, dict], tests: str | None) -> dict:
    reports = {name: read_json(out / f"{name}.json") for pair in PAIRS.values() for name in pair}
    summary = {"parts": parts, "gpu_tests": tests, "training": {}, "decoding": None,
               "decode_check": read_json(out / "decode_check.json"),
               "labels": {k: (v or {}).get("label") for k, v in reports.items()},
               "asr": {k: (v or {}).get("asr") for k, v in reports.items()}}
    for config, (ours, base) in PAIRS.items():
        summary["training"][config] = training_rows(reports[ours], reports[base])
    summary["decoding"] = decoding_rows(reports["ours_100h"], reports["base_100h"])
    return summary


def print_summary(summary: dict) -> None:
    print("\nthis tree / baseline: training (median step; GPU busy, GPU / host ms, launches and host syncs "
          "per step from torch.profiler)")
    print(HEADER)
    for config, rows in summary["training"].items():
        for line in format_training(config, rows):
            print(line)
    first = next((r for r in summary["training"]["100h"] if r.get("top_kernels")), None)
    for r in summary["training"]["100h"]:
        if r.get("top_kernels") and r["batch_seconds"] == first["batch_seconds"]:
            print(f"  top kernels, 100h at {r['batch_seconds']:g} s, {r['tree']}: " + "; ".join(
                f"{k['name'][:48]} {k['ms_per_step']:.1f} ms" for k in r["top_kernels"]))
    print()
    for line in format_decoding(summary["decoding"]):
        print(line)
    check = summary["decode_check"]
    if check:
        print(f"sharded decode check: identical {all(check['identical'].values())}, "
              + ", ".join(f"{k} {v:.1f} s" for k, v in check["wall_seconds"].items()))
    print(f"gpu-marked tests: {summary['gpu_tests'] or 'no result line'}")
    print("parts: " + ", ".join(f"{name} {p['status']} ({p['seconds']} s)" for name, p in summary["parts"].items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder device_check.sh wrote")
    parser.add_argument("--parts", type=Path, help="the parts' table: name, exit status, seconds (tab-separated)")
    parser.add_argument("--log", type=Path, help="the run's log (for the gpu-marked tests' result)")
    args = parser.parse_args(argv)
    summary = summarize(args.out, read_parts(args.parts), pytest_result(args.log))
    print_summary(summary)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
