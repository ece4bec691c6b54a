"""Rows, tables and the JSON file of the peer benchmark (standard library only).

A row is one measurement (task, setting) over the toolkits: the wall seconds of each repeat, their
median, the rate (work / median: utterances or audio seconds per second) and the ratio of our
rate to each peer's (> 1: we are faster).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

OURS = "ours"


def summarize(task: str, setting: str, unit: str, work: float, times: dict[str, list[float]],
              checks: dict[str, bool] | None = None) -> dict:
    """The row of one measurement: `work` units done by each timed run; times[toolkit] the wall
    seconds of its runs; checks[toolkit] False where its output was not the equal work asked."""
    toolkits = {}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        toolkits[name] = {"seconds": [round(s, 4) for s in seconds], "median_s": round(median, 4),
                          "rate": round(work / median, 4), "equal_work": (checks or {}).get(name, True)}
    ratios = {}
    if OURS in toolkits:
        ours = toolkits[OURS]["rate"]
        ratios = {name: round(ours / t["rate"], 3) for name, t in toolkits.items() if name != OURS}
    return {"task": task, "setting": setting, "unit": unit, "work": work, "toolkits": toolkits,
            "ours_over": ratios}


def format_table(rows: list[dict], toolkits: list[str]) -> str:
    """One line per row: the rate of each toolkit and our rate over each peer's."""
    peers = [t for t in toolkits if t != OURS]
    header = ["task", "setting", "unit", *toolkits, *(f"ours/{p}" for p in peers)]
    lines = [header]
    for row in rows:
        rates = [_rate(row, t) for t in toolkits]
        ratios = [f"{row['ours_over'][p]:.2f}x" if p in row["ours_over"] else "-" for p in peers]
        lines.append([row["task"], row["setting"], row["unit"], *rates, *ratios])
    return _aligned(lines, left=3)


def _rate(row: dict, toolkit: str) -> str:
    found = row["toolkits"].get(toolkit)
    if found is None:
        return "-"
    mark = "" if found["equal_work"] else " (!)"
    return f"{found['rate']:.3g}{mark}" if found["rate"] < 100 else f"{found['rate']:,.0f}{mark}"


def format_parameters(counts: dict[str, dict[str, int]]) -> str:
    """Parameter counts per toolkit (millions, and the exact encoder + decoder count) and the
    difference of each from ours."""
    parts = ["subsampling", "encoder", "decoder", "ctc", "total"]
    lines = [["toolkit", *parts, "encoder+decoder", "vs ours"]]
    ours = counts.get(OURS)
    for name, c in counts.items():
        both = c["encoder"] + c["decoder"]
        diff = "-" if ours is None or name == OURS else f"{both - (ours['encoder'] + ours['decoder']):+,d}"
        lines.append([name, *(f"{c[p] / 1e6:.3f}M" for p in parts), f"{both:,d}", diff])
    return _aligned(lines, left=1)


def _aligned(lines: list[list[str]], left: int) -> str:
    """Columns padded to their widest cell: the first `left` left-aligned, the others right."""
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(str(cell).ljust(w) if i < left else str(cell).rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def write_json(path: Path, result: dict) -> None:
    """Write `result` as indented JSON, creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
