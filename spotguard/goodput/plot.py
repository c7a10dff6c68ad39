"""The report's timeline picture (`spotguard report --plot out.png|out.html`), drawn with matplotlib.

One row per kind of thing, time since the first segment's start on the x axis:

  segments       a bar per run segment (green: training; orange at its start: resume), grey gaps
                 between segments (nothing running); red hatched: work that was lost (redone after
                 resuming), ending where the segment ended;
  saves          a tick per save (black: committed, red cross: failed; emergency saves are taller);
  notices        a marker per interruption notice at its arrival (filled: the checkpoint committed,
                 hollow: lost), a cross per failure without a notice (a node lost, a hang), and a red
                 line where each interruption ended a segment.

`.png` is a picture; `.html` is a page with the same picture as inline SVG and the text report.
matplotlib is an optional extra: `pip install "spotguard[plot]"`.
"""

from __future__ import annotations

import html
import io
from pathlib import Path
from typing import Any

SUFFIXES = (".png", ".html")
ROWS = {"segments": 2.0, "saves": 1.0, "notices": 0.0}


def check_plot_path(path: str) -> Path:
    """`path` when it ends in .png or .html and matplotlib is importable; else a one-line ValueError."""
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--plot: {path!r} must end in .png or .html")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError('--plot needs matplotlib: pip install "spotguard[plot]"') from None
    return target


def timeline_figure(summary: dict[str, Any]) -> Any:
    """The timeline as a matplotlib Figure; each segment's bar has gid `segment-<i>`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    from matplotlib.figure import Figure

    segments = summary["segment_details"]
    wall = max(summary["wall_s"], 1e-9)
    scale, unit = (3600.0, "h") if wall > 3 * 3600 else (60.0, "min") if wall > 180 else (1.0, "s")
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax = fig.add_subplot()
    height = 0.5
    row = ROWS["segments"]
    for i, seg in enumerate(segments):
        start, resume, wall_s = seg["start_s"] / scale, seg["resume_s"] / scale, seg["wall_s"] / scale
        bar = ax.broken_barh([(start, max(wall_s, 1e-9))], (row - height / 2, height), color="#3a9d5d")
        bar.set_gid(f"segment-{i}")
        if resume > 0:
            ax.broken_barh([(start, resume)], (row - height / 2, height), color="#f0a030")
        if i + 1 < len(segments):
            gap_start = start + wall_s
            gap = segments[i + 1]["start_s"] / scale - gap_start
            ax.broken_barh([(gap_start, gap)], (row - height / 4, height / 2), color="#bbbbbb")
    for x in summary["interruption_details"]:
        end = x["end_s"] / scale
        ax.axvline(end, color="#c0392b", linewidth=1.2, alpha=0.8)
        if x["lost_s"]:
            lost = x["lost_s"] / scale
            ax.broken_barh([(end - lost, lost)], (row - height / 2, height), facecolor="none",
                           edgecolor="#c0392b", hatch="////", linewidth=0)  # fmt: skip
    saves = [s for seg in segments for s in seg["saves"]]
    for ok in (True, False):
        chosen = [s for s in saves if bool(s["ok"]) == ok]
        if chosen:
            ax.scatter(
                [s["at_s"] / scale for s in chosen],
                [ROWS["saves"]] * len(chosen),
                marker="|" if ok else "x",
                s=[400 if s["reason"] == "emergency" else 150 for s in chosen],
                color="black" if ok else "#c0392b",
                linewidths=1.5,
            )
    notices = [n for seg in segments for n in seg["notices"]]
    for n in notices:
        kept = n.get("committed")
        ax.scatter(
            [n["at_s"] / scale],
            [ROWS["notices"]],
            marker="v" if n.get("kind") == "interruption" else "d",
            s=90,
            facecolors="#c0392b" if kept else "none",
            edgecolors="#c0392b",
        )
    silent = [seg["silent"] for seg in segments if seg["silent"]]
    if silent:  # failures without a notice: a node lost, a hang
        ax.scatter([x["at_s"] / scale for x in silent], [ROWS["notices"]] * len(silent), marker="X", s=90,
                   color="#7d3c98")  # fmt: skip
    ax.set_yticks(list(ROWS.values()), list(ROWS))
    ax.set_ylim(-0.6, 2.6)
    ax.set_xlim(-0.01 * wall / scale, wall / scale * 1.01)
    ax.set_xlabel(f"time since the first segment started ({unit})")
    goodput = summary["goodput"]
    ax.set_title(
        f"{summary['segments']} segment(s), {summary['interruptions']} interruption(s), "
        f"{summary['steps_lost']} step(s) lost, goodput {100 * goodput:.1f} %"
        if goodput is not None
        else "no wall time recorded"
    )
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=_legend(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return fig


def _legend() -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Patch(color="#3a9d5d", label="training"),
        Patch(color="#f0a030", label="resume"),
        Patch(color="#bbbbbb", label="not running"),
        Patch(facecolor="none", edgecolor="#c0392b", hatch="////", label="lost work"),
        Line2D([], [], color="black", marker="|", linestyle="none", markersize=10, label="save"),
        Line2D([], [], color="#c0392b", marker="x", linestyle="none", label="failed save"),
        Line2D([], [], color="#c0392b", marker="v", linestyle="none", label="notice, committed"),
        Line2D([], [], color="#c0392b", marker="v", markerfacecolor="none", linestyle="none", label="notice, lost"),
        Line2D([], [], color="#7d3c98", marker="X", linestyle="none", label="silent failure (node lost, hang)"),
        Line2D([], [], color="#c0392b", label="interruption"),
    ]


def write_plot(summary: dict[str, Any], path: Path, text: str) -> None:
    """Draw the timeline into `path` (.png, or .html with the picture as SVG above `text`)."""
    fig = timeline_figure(summary)
    if path.suffix.lower() == ".png":
        fig.savefig(path, dpi=110)
        return
    svg = io.StringIO()
    fig.savefig(svg, format="svg")
    page = (
        "<!doctype html>\n<html><head><meta charset='utf-8'><title>spotguard report</title></head>\n<body>\n"
        f"{svg.getvalue()[svg.getvalue().index('<svg') :]}\n<pre>{html.escape(text)}</pre>\n</body></html>\n"
    )
    path.write_text(page)
