"""`spotguard report`: what interruptions cost a job, from its goodput ledger.

Per segment (one launch): wall time from its first record to its last, the resume and the save
stalls, the steps it trained (first step to the last one any record names). Across segments:

  goodput            useful training time / wall time, where wall time runs from the first
                     segment's start to the last record (the gaps between segments included) and
                     useful training time is training time less the work redone after resuming;
  steps lost         per interruption: the last step the interrupted segment trained, + 1, less the
                     step the next segment resumed at (before a next segment: less the last step
                     committed); a segment that ended without an exit record (killed hard) is
                     known up to its last record only, so its loss is a lower bound;
  time to resume     from the interrupted segment's last record to the next one's resume done;
  interruptions/h    per hour of running (the segments' wall time, not the gaps).
"""

from __future__ import annotations

import statistics
from datetime import datetime
from typing import Any

from cloud_adapters.notice import parse_iso8601
from spotguard.goodput.ledger import LedgerContents
from spotguard.goodput.records import (
    CadenceChange,
    Exit,
    NoticeSeen,
    Progress,
    Record,
    Recovered,
    Resume,
    Save,
    SilentEnd,
)

INTERRUPTED = "interrupted"


def _at(record: Record) -> datetime:
    return parse_iso8601(record.at)


def _segments(records: list[Record]) -> list[list[Record]]:
    groups: dict[str, list[Record]] = {}
    for record in records:
        groups.setdefault(record.segment, []).append(record)
    return list(groups.values())  # records come sorted by segment (start time), then seq


def _segment(records: list[Record], origin: datetime) -> dict[str, Any]:
    start, end = _at(records[0]), _at(records[-1])
    resume = next((r for r in records if isinstance(r, Resume)), None)
    exit_ = next((r for r in reversed(records) if isinstance(r, Exit)), None)
    saves = [r for r in records if isinstance(r, Save)]
    notices = [r for r in records if isinstance(r, NoticeSeen)]
    silent = next((r for r in records if isinstance(r, SilentEnd)), None)
    recovered = next((r for r in records if isinstance(r, Recovered)), None)
    steps = [r.step for r in saves if r.ok]
    steps += [r.last_step for r in records if isinstance(r, (Progress, Exit, SilentEnd)) and r.last_step is not None]
    steps += [r.agreed_step for r in notices if r.agreed_step is not None]
    first_step = resume.next_step if resume else None
    last_step = max(steps) if steps else (first_step - 1 if first_step else None)
    resume_s = resume.resume_s if resume else 0.0
    stall_s = sum(r.stall_s or 0.0 for r in saves)
    wall_s = (end - start).total_seconds()
    interruptions = [n for n in notices if n.kind == "interruption"]
    ended = exit_.why if exit_ else "no exit record"
    if interruptions and ended != INTERRUPTED and exit_ is None:
        ended = INTERRUPTED + " (no exit record)"
    return {
        "segment": records[0].segment,
        "start": records[0].at,
        "end": records[-1].at,
        "start_s": (start - origin).total_seconds(),
        "wall_s": wall_s,
        "resume_s": resume_s,
        "resumed_from": resume.step if resume else None,
        "resumed_tier": resume.tier if resume else None,  # "durable", "snapshot" (the nodes' memory), None
        "resumed_resharded": resume.resharded if resume else None,  # [W, W']: a snapshot of another world size
        "first_step": first_step,
        "last_step": last_step,
        "steps": last_step + 1 - first_step if last_step is not None and first_step is not None else 0,
        "saves": [_save(r, origin) for r in saves],
        "save_stall_s": sum(r.stall_s or 0.0 for r in saves if r.reason not in ("emergency", "manual")),
        "emergency_save_s": sum(r.stall_s or 0.0 for r in saves if r.reason == "emergency"),
        "training_s": max(0.0, wall_s - resume_s - stall_s),
        "notices": [{**n.to_json(), "at_s": (_at(n) - origin).total_seconds()} for n in notices],
        # a failure without a notice that ended the segment: cause, culprit, noticed_after_s
        "silent": {**silent.to_json(), "at_s": (_at(silent) - origin).total_seconds()} if silent else None,
        "cadence": [r.to_json() for r in records if isinstance(r, CadenceChange)],
        # began with an in-process recovery: cause, generation, world_before/after, step, paused_s, source
        "recovered": recovered.to_json() if recovered else None,
        "exit_code": exit_.code if exit_ else None,
        "ended": ended,
        "committed": bool(exit_ and exit_.committed) or any(n.committed for n in interruptions),
        "last_committed_step": max((r.step for r in saves if r.ok), default=None),
        "exact": exit_ is not None,
    }


def _save(record: Save, origin: datetime) -> dict[str, Any]:
    keys = ("step", "reason", "ok", "bytes", "stall_s", "write_s", "commit_s", "upload_s", "durable", "error")
    return {**{k: getattr(record, k) for k in keys}, "at_s": (_at(record) - origin).total_seconds()}


def summarize(contents: LedgerContents) -> dict[str, Any]:
    """The report's numbers (the `--json` object) from a ledger's records."""
    records = contents.records
    if not records:
        return {"segments": 0, "goodput": None, "interruptions": 0, "steps_lost": 0, "torn_lines": contents.torn}
    origin = _at(records[0])
    segments = [_segment(group, origin) for group in _segments(records)]
    lost_list = []
    for i, seg in enumerate(segments):
        following = segments[i + 1] if i + 1 < len(segments) else None
        interrupted = (
            seg["ended"].startswith(INTERRUPTED)
            or seg["silent"] is not None
            or (seg["ended"] == "no exit record" and following)
        )
        if not interrupted:
            continue
        lost_list.append(_interruption(seg, following))
    wall_s = (_at(records[-1]) - origin).total_seconds()
    running_h = sum(s["wall_s"] for s in segments) / 3600
    training_s = sum(s["training_s"] for s in segments)
    lost_s = sum(x["lost_s"] or 0.0 for x in lost_list)
    saves = [s for seg in segments for s in seg["saves"]]
    to_resume = [x["time_to_resume_s"] for x in lost_list if x["time_to_resume_s"] is not None]
    margins = [x["margin_s"] for x in lost_list if x["margin_s"] is not None]
    cadence = [c for seg in segments for c in seg["cadence"]]
    return {
        "goodput": (training_s - lost_s) / wall_s if wall_s > 0 else None,
        "wall_s": wall_s,
        "training_s": training_s,
        "useful_s": training_s - lost_s,
        "segments": len(segments),
        "interruptions": len(lost_list),
        "interruptions_per_hour": len(lost_list) / running_h if running_h > 0 else None,
        "steps_lost": sum(x["steps_lost"] or 0 for x in lost_list),
        "lost_s": lost_s,
        "saves": len(saves),
        "failed_saves": sum(1 for s in saves if not s["ok"]),
        "save_overhead_s": sum(s["save_stall_s"] for s in segments),
        "emergency_save_s": sum(s["emergency_save_s"] for s in segments),
        "resume_s": sum(s["resume_s"] for s in segments),
        "time_to_resume_s": to_resume,
        "margins_s": margins,
        "cadence": cadence[-1] if cadence else None,
        "cadence_changes": len(cadence),
        "torn_lines": contents.torn,
        "segment_details": segments,
        "interruption_details": lost_list,
    }


def _interruption(seg: dict[str, Any], following: dict[str, Any] | None) -> dict[str, Any]:
    notice = next((n for n in reversed(seg["notices"]) if n.get("kind") == "interruption"), None)
    silent = seg["silent"]
    resumed_at = following["first_step"] if following else None
    if following is not None and resumed_at is None:
        resumed_at = 0  # the next segment started afresh: everything was redone
    if resumed_at is None:  # no next segment yet: resume will start after the newest committed step
        resumed_at = (seg["last_committed_step"] + 1) if seg["last_committed_step"] is not None else 0
    steps_lost = max(0, seg["last_step"] + 1 - resumed_at) if seg["last_step"] is not None else None
    step_s = seg["training_s"] / seg["steps"] if seg["steps"] > 0 else None
    resume_done_s = None
    if following is not None:
        resume_done_s = following["start_s"] + following["resume_s"]
    end_s = seg["start_s"] + seg["wall_s"]
    return {
        "segment": seg["segment"],
        "at_s": notice["at_s"] if notice else silent["at_s"] if silent else end_s,
        "cause": silent["cause"] if silent else "notice" if notice else None,  # None: unrecorded
        "culprit": silent.get("culprit") if silent else None,
        "noticed_after_s": silent.get("noticed_after_s") if silent else None,
        "cloud": notice.get("cloud") if notice else None,
        "action": notice.get("action") if notice else None,
        "agreed_step": notice.get("agreed_step") if notice else None,
        "committed": seg["committed"],
        "margin_s": notice.get("margin_s") if notice else None,
        "steps_lost": steps_lost,
        "exact": seg["exact"],  # False: the segment ended without an exit record, the loss is a lower bound
        "lost_s": steps_lost * step_s if steps_lost is not None and step_s is not None else None,
        "end_s": end_s,
        "time_to_resume_s": resume_done_s - end_s if resume_done_s is not None else None,
    }


def _num(value: float | None, fmt: str = ".1f", unit: str = " s") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):.1f} s, min {min(values):.1f} s, max {max(values):.1f} s"


def format_text(summary: dict[str, Any], location: str) -> str:
    """The report as a person reads it: totals, a table of segments, a table of interruptions."""
    if not summary["segments"]:
        return f"no goodput ledger records in {location}"
    s = summary
    lines = [
        f"goodput ledger of {location}: {s['segments']} segment(s), {s['interruptions']} interruption(s)"
        + (f"; {s['torn_lines']} torn line(s) skipped" if s["torn_lines"] else ""),
        "",
        f"  goodput                {_num(s['goodput'] and 100 * s['goodput'], '.1f', ' %')}"
        f"   (useful training {s['useful_s']:.1f} s of {s['wall_s']:.1f} s wall time)",
        f"  training time          {s['training_s']:.1f} s (wall time less resumes and save stalls)",
        f"  lost work              {s['steps_lost']} step(s), {s['lost_s']:.1f} s redone",
        f"  save overhead          {s['saves']} save(s), {s['save_overhead_s']:.2f} s stalled on the training thread"
        + (f", {s['failed_saves']} failed" if s["failed_saves"] else ""),
        f"  emergency saves        {s['emergency_save_s']:.2f} s",
        f"  resume                 {s['resume_s']:.1f} s in resume() in all",
        f"  time to resume         {_spread(s['time_to_resume_s'])}",
        f"  interruptions / hour   {_num(s['interruptions_per_hour'], '.2f', '')} (per hour of running)",
        f"  margin to deadlines    {_spread(s['margins_s'])}",
    ]
    if s["cadence"]:
        lines.append(f"  save interval (auto)   {s['cadence']['explain']} ({s['cadence_changes']} change(s))")
    tiers = max((len(_tier(seg)) for seg in s["segment_details"]), default=0)
    width = max(8, tiers)
    lines += ["", f"  {'SEGMENT':<24} {'START':>9} {'WALL':>9} {'STEPS':>13} {'RESUME':>7} {'FROM':<{width}} "
                  f"{'SAVES':>5} {'STALL':>7}  ENDED"]  # fmt: skip
    for seg in s["segment_details"]:
        steps = f"{seg['first_step']}-{seg['last_step']}" if seg["last_step"] is not None else "-"
        code = f" ({seg['exit_code']})" if seg["exit_code"] is not None else ""
        lines.append(
            f"  {seg['segment']:<24} {seg['start_s']:>8.1f}s {seg['wall_s']:>8.1f}s {steps:>13} "
            f"{seg['resume_s']:>6.1f}s {_tier(seg):<{width}} {len(seg['saves']):>5} "
            f"{seg['save_stall_s']:>6.2f}s  {seg['ended']}{code}"
        )
    if s["interruption_details"]:
        lines += ["", f"  {'INTERRUPTION AT':>15} {'BY':<16} {'AGREED':>7} {'COMMITTED':>9} {'MARGIN':>8} "
                  f"{'STEPS LOST':>10} {'LOST':>8} {'TO RESUME':>10}  NOTICED AFTER, CULPRIT"]  # fmt: skip
        for x in s["interruption_details"]:
            by = f"{x['cloud']}:{x['action']}" if x["cloud"] else x["cause"] or "unrecorded"
            noticed = x["noticed_after_s"]
            silent = f"  {noticed:.1f} s, {x['culprit'] or '-'}" if noticed is not None else ""
            lost = "-" if x["steps_lost"] is None else f"{'' if x['exact'] else '>='}{x['steps_lost']}"
            lines.append(
                f"  {x['at_s']:>14.1f}s {by:<16} {x['agreed_step'] if x['agreed_step'] is not None else '-':>7} "
                f"{'yes' if x['committed'] else 'NO':>9} {_num(x['margin_s']):>8} {lost:>10} "
                f"{_num(x['lost_s']):>8} {_num(x['time_to_resume_s']):>10}{silent}"
            )
    recovered = [seg["recovered"] for seg in s["segment_details"] if seg.get("recovered")]
    if recovered:
        lines += ["", f"  {'IN-PROCESS RECOVERY':<20} {'CAUSE':<13} {'WORLD':>8} {'STEP':>7} {'PAUSED':>8}  STATE FROM"]
        for r in recovered:
            world = f"{r['world_before']} -> {r['world_after']}"
            lines.append(f"  {'generation ' + str(r['generation']):<20} {r['cause']:<13} {world:>8} {r['step']:>7} "
                         f"{_num(r['paused_s']):>8}  {r['source'] or '-'}")  # fmt: skip
    if s["torn_lines"]:
        lines += ["", f"  {s['torn_lines']} line(s) of the ledger were torn (a writer killed mid-line): skipped"]
    return "\n".join(lines)


def _tier(segment: dict[str, Any]) -> str:
    """Where a segment's step came from, as the table says it: "snapshot, resharded 3 -> 2", say."""
    tier, resharded = segment["resumed_tier"] or "-", segment.get("resumed_resharded")
    if isinstance(resharded, list) and len(resharded) == 2:
        return f"{tier}, resharded {resharded[0]} -> {resharded[1]}"
    return tier
