"""Fault matrix: does a metadata fault ever blind the watcher, stall the training loop or cost
the emergency checkpoint? Every cloud against every fault, with a real Guard.

    python bench/fault_matrix.py [--clouds aws,gcp,azure] [--faults none,5xx,...] [--json]

Each cell starts a fresh metadata emulator (behind a FaultProxy from tests/servers.py when the
fault lives on the network), a fresh single-process Guard (`poll_interval_s=1.0`, a fresh checkpoint
dir) and a training loop of a tiny model with ~10 ms steps. A driver thread plays the cloud:

    t = 1.5 s  fault on (AWS, Azure: a watcher that settled; token cached, Azure primed)
    t = 3.5 s  interruption raised with the emulator's raise_notice()
    t = 4.5 s  fault off as soon as the watcher's next request has arrived: that request met the
               fault, the worst phase for faults that hold a request (faults that fire once are
               over as soon as they are on)

GCP's fault goes on before the Guard is entered instead: its sources sit in hanging GETs, and a
fault that starts after one opened never reaches it (the state change answers it), so the fault
must meet the requests the watcher makes while blind.

Recorded per cell: detected (a timeline "notice" entry), late (raise -> that entry), the longest
`guard.step()` call that did not save (the loop stall), committed (`step()` returned True with
the emergency checkpoint committed) and the WARNING/ERROR log lines of the run (the emulator's
and the proxy's own threads not counted). Goals: detected; after the fault went off (after the
raise, when it never did), back to the normal cadence within one interval: at most the poll
interval + 1 s, plus the client's read timeout for the faults that hold the request in flight
(`slow`, `blackhole`: that request ends only at its timeout); longest step < 50 ms; committed.
Exit status 1 when a cell misses one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import torch
from _common import table  # also puts the checkout on sys.path
from aiohttp import web

import spotguard
from cloud_adapters.aws import metadata as aws_metadata
from cloud_adapters.azure import metadata as azure_metadata
from cloud_adapters.emulation import FAULT_ERROR, FAULT_MALFORMED, FAULT_RESET, FAULT_SLOW, MetadataEmulator
from cloud_adapters.gcp import metadata as gcp_metadata
from cloud_adapters.notice import utc_now
from cloud_adapters.sources import CLOUDS, metadata_emulator
from tests.servers import FaultProxy

POLL_INTERVAL_S = 1.0
STEP_S = 0.01
FAULT_AT_S = 1.5  # after entering the Guard
RAISE_AT_S = 3.5
CLEAR_AT_S = 4.5
GOAL_AFTER_OFF_MS = (POLL_INTERVAL_S + 1.0) * 1000  # detected within this of the fault going off (or the raise)
HOLDING_FAULTS = ("slow", "blackhole")  # ... plus the read timeout: the request in flight ends only then
MAX_STALL_MS = 50.0
GIVE_UP_S = 15.0  # after the raise: a cell that has not committed by then counts as blind
FAULT_BEFORE_GUARD = ("gcp",)  # see the module docstring
# Each client's read timeout: a slow answer comes one second after it, a drip over connect + read + 1 s
# (the whole-answer deadline: every single byte arrives well within the read timeout).
READ_TIMEOUT_S = {
    "aws": aws_metadata.DEFAULT_TIMEOUT_S,
    "gcp": gcp_metadata.DEFAULT_REQUEST_TIMEOUT_S,
    "azure": azure_metadata.POLL_TIMEOUT_S,
}
TOKEN_GARBAGE = "<html><body>Proxy authentication required</body></html>"  # 200, but no token
SERVER_THREADS = {"fault-proxy", *(f"{cloud}-emulator" for cloud in CLOUDS)}  # their logs are not the run's


class MatrixProxy(FaultProxy):
    """FaultProxy plus the two faults it lacks: bodies that drip in, and garbage for the next
    IMDSv2 token PUT(s) only."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.drip_s = 0.0  # each answer's body takes this long; 0: at once (also for a drip under way)
        self.garbage_tokens = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.garbage_tokens and request.method == "PUT" and request.path == aws_metadata.TOKEN_PATH:
            self.garbage_tokens -= 1
            return web.Response(text=TOKEN_GARBAGE, content_type="text/html")
        answer = await super()._handle(request)
        if not self.drip_s or not isinstance(answer, web.Response) or not answer.body:
            return answer
        body = bytes(answer.body)
        stream = web.StreamResponse(status=answer.status, headers={**answer.headers, "Content-Length": str(len(body))})
        await stream.prepare(request)
        for i in range(len(body)):
            await stream.write(body[i : i + 1])
            pause_until = time.monotonic() + self.drip_s / len(body)
            while self.drip_s and time.monotonic() < pause_until:  # a network that heals delivers the rest
                await asyncio.sleep(0.02)
        await stream.write_eof()
        return stream


@dataclasses.dataclass(frozen=True)
class Fault:
    """One column of the matrix: how to turn it on and off in a cell."""

    name: str
    what: str
    on: Callable[[MetadataEmulator, MatrixProxy | None, str], None]
    off: Callable[[MetadataEmulator, MatrixProxy | None], None] = lambda emu, proxy: None
    proxied: bool = False  # the fault lives on the network: the Guard reaches the emulator through a proxy
    once: bool = False  # over as soon as it is on
    clouds: tuple[str, ...] = CLOUDS


def emulator_fault(mode: str, params: Callable[[str], dict[str, Any]] = lambda cloud: {}) -> dict[str, Any]:
    """A fault the emulator serves to every request until it is off; `params(cloud)` for set_fault."""

    def on(emu: MetadataEmulator, proxy: MatrixProxy | None, cloud: str) -> None:
        emu.set_fault(mode, **params(cloud))

    return {"on": on, "off": lambda emu, proxy: emu.set_fault(None)}


def set_attr(name: str, on: Callable[[str], Any], off: Any) -> dict[str, Any]:
    """A fault that is one attribute of the proxy."""
    return {
        "on": lambda emu, proxy, cloud: setattr(proxy, name, on(cloud)),
        "off": lambda emu, proxy: setattr(proxy, name, off),
        "proxied": True,
    }


def expire_token_then_garbage(emu: MetadataEmulator, proxy: MatrixProxy | None, cloud: str) -> None:
    proxy.garbage_tokens = 1
    emu.set_fault("token-expiry", count=1)  # the next GET gets 401, so the client asks for a new token


FAULTS = {
    fault.name: fault
    for fault in (
        Fault("none", "no fault (baseline)", on=lambda emu, proxy, cloud: None),
        Fault("5xx", "every request answered 503", **emulator_fault(FAULT_ERROR, lambda cloud: {"status": 503})),
        Fault(
            "slow",
            "every answer 1 s after the client's read timeout",
            **emulator_fault(FAULT_SLOW, lambda cloud: {"delay_s": READ_TIMEOUT_S[cloud] + 1}),
        ),
        Fault(
            "drip",
            "every body a byte at a time over the client's connect + read timeouts + 1 s (proxy)",
            **set_attr("drip_s", lambda cloud: 2 * READ_TIMEOUT_S[cloud] + 1, 0.0),
        ),
        Fault("reset", "every connection closed without an answer", **emulator_fault(FAULT_RESET)),
        Fault("malformed", "every answer a 200 whose body does not parse", **emulator_fault(FAULT_MALFORMED)),
        Fault(
            "blackhole",
            "requests never answered (proxy); ones sent while it is on are held until the cell ends",
            **set_attr("blackhole", lambda cloud: True, False),
        ),
        Fault(
            "token-garbage",
            "tokens expire and the next token PUT gets an HTML page (200) instead, once (proxy)",
            on=expire_token_then_garbage,
            proxied=True,
            once=True,
            clouds=("aws",),
        ),
        Fault(
            "no-etag",
            "answers without their ETag (proxy drop_headers)",
            **set_attr("drop_headers", lambda cloud: {"etag"}, set()),
            clouds=("gcp",),
        ),
    )
}


class LogTally(logging.Handler):
    """The run's WARNING and ERROR lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName not in SERVER_THREADS:
            self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}"[:300])


def tiny_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)}


def run_cell(cloud: str, fault: Fault) -> dict[str, Any]:
    emu = metadata_emulator(cloud)
    emu.start()
    proxy = MatrixProxy(emu.url) if fault.proxied else None
    tally = LogTally()
    logging.getLogger().addHandler(tally)
    stop = threading.Event()
    raised: list[datetime] = []  # when the notice was raised, once it was
    cleared: list[datetime] = []  # when the fault went off, once it did

    def requests_seen() -> int:
        return len(proxy.seen) if proxy is not None else emu.requests_seen

    def drive(started: float) -> None:
        def at(offset_s: float) -> bool:
            return not stop.wait(max(0.0, started + offset_s - time.monotonic()))

        if cloud not in FAULT_BEFORE_GUARD and at(FAULT_AT_S):
            fault.on(emu, proxy, cloud)
        if at(RAISE_AT_S):
            raised.append(utc_now())  # before the call: its own cost counts against us
            emu.raise_notice()
        if fault.once or not at(CLEAR_AT_S):
            return
        # Off right after the next request arrived, which met the fault: the worst phase for faults
        # that hold a request (slow, blackhole), since that request must run into its timeout first.
        seen = requests_seen()
        while requests_seen() == seen and not stop.wait(0.005):
            pass
        fault.off(emu, proxy)
        cleared.append(utc_now())

    longest_ms = save_ms = 0.0
    committed = False
    try:
        if cloud in FAULT_BEFORE_GUARD:
            fault.on(emu, proxy, cloud)
        with tempfile.TemporaryDirectory(prefix="fault-matrix-") as ckpt:
            state = tiny_state()
            x = torch.randn(16, 64)
            guard = spotguard.Guard(
                ckpt, cloud=cloud, metadata_url=(proxy or emu).url, poll_interval_s=POLL_INTERVAL_S, exit_code=None
            )
            with guard:
                started = time.monotonic()
                driver = threading.Thread(target=drive, args=(started,), name="fault-matrix-driver", daemon=True)
                driver.start()
                step = 0
                while time.monotonic() < started + RAISE_AT_S + GIVE_UP_S:
                    loss = state["model"](x).square().mean()
                    state["optim"].zero_grad()
                    loss.backward()
                    state["optim"].step()
                    time.sleep(STEP_S)
                    t0 = time.perf_counter()
                    done = guard.step(step, state)
                    took_ms = (time.perf_counter() - t0) * 1000
                    if done:  # this call saved: that is the checkpoint's time, not a stall
                        save_ms, committed = took_ms, guard.emergency_saved
                        break
                    longest_ms = max(longest_ms, took_ms)
                    step += 1
                stop.set()
                driver.join()
            notices = [e for e in guard.timeline.entries if e.event == "notice"]
            committed = committed and any(e.event == "committed" for e in guard.timeline.entries)
    finally:
        stop.set()
        if proxy is not None:
            proxy.close()
        emu.stop()
        logging.getLogger().removeHandler(tally)  # last: the servers' teardown lines go to it, not to stderr
    detected = bool(notices and raised)
    late_ms = (notices[0].at - raised[0]).total_seconds() * 1000 if detected else None
    # Judged from the later of the raise and the fault going off (a fault on until detection never went off).
    after_off_ms = (notices[0].at - max(raised + cleared)).total_seconds() * 1000 if detected else None
    misses = []
    if after_off_ms is None:
        misses.append("not detected")
    elif after_off_ms > goal_after_off_ms(cloud, fault.name):
        misses.append(f"{after_off_ms / 1000:.1f} s after the fault went off")
    if longest_ms >= MAX_STALL_MS:
        misses.append(f"step stalled {longest_ms:.0f} ms")
    if not committed:
        misses.append("not committed")
    return {
        "cloud": cloud, "fault": fault.name, "detected": detected,
        "late_ms": None if late_ms is None else round(late_ms, 1),
        "after_off_ms": None if after_off_ms is None else round(after_off_ms, 1),
        "off_after_raise_ms": round((cleared[0] - raised[0]).total_seconds() * 1000, 1) if cleared else None,
        "max_step_ms": round(longest_ms, 2), "save_ms": round(save_ms, 1), "steps": step, "committed": committed,
        "log_lines": len(tally.lines), "verdict": "pass" if not misses else "MISS: " + "; ".join(misses),
        "logs": tally.lines,
    }  # fmt: skip


def goal_after_off_ms(cloud: str, fault: str) -> float:
    return GOAL_AFTER_OFF_MS + (READ_TIMEOUT_S[cloud] * 1000 if fault in HOLDING_FAULTS else 0.0)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clouds", default=",".join(CLOUDS), help="comma-separated subset of " + ",".join(CLOUDS))
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of " + ",".join(FAULTS))
    parser.add_argument("--json", action="store_true", help="print one JSON document (with every log line)")
    args = parser.parse_args(argv)
    for option, known in (("clouds", CLOUDS), ("faults", tuple(FAULTS))):
        chosen = [name.strip() for name in getattr(args, option).split(",") if name.strip()]
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            parser.error(
                f"--{option} takes a comma-separated subset of {','.join(known)}, got {','.join(unknown) or 'nothing'}"
            )
        setattr(args, option, chosen)
    if not any(cloud in FAULTS[name].clouds for cloud in args.clouds for name in args.faults):
        parser.error("no cell to run: every fault chosen is for another cloud")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the watcher, the emulator and the proxy share the same two cores
    cells = [(cloud, FAULTS[name]) for cloud in args.clouds for name in args.faults if cloud in FAULTS[name].clouds]
    started = time.monotonic()
    rows = []
    for i, (cloud, fault) in enumerate(cells, 1):
        rows.append(run_cell(cloud, fault))
        print(f"[{i}/{len(cells)}] {cloud} {fault.name}: {rows[-1]['verdict']}", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started
    if args.json:
        print(json.dumps({
            "poll_interval_s": POLL_INTERVAL_S, "fault_at_s": FAULT_AT_S, "raise_at_s": RAISE_AT_S,
            "clear_at_s": CLEAR_AT_S, "goal_after_off_ms": GOAL_AFTER_OFF_MS, "max_stall_ms": MAX_STALL_MS,
            "holding_faults": HOLDING_FAULTS, "read_timeout_s": READ_TIMEOUT_S,
            "faults": {name: fault.what for name, fault in FAULTS.items()}, "elapsed_s": round(elapsed, 1),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__, "cells": rows,
        }, indent=2))  # fmt: skip
    else:
        print(
            f"fault matrix: {len(rows)} cells, poll interval {POLL_INTERVAL_S:g} s, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {elapsed:.0f} s"
        )
        print(table(
            ("cloud", "fault", "detected", "raise -> notice ms", "fault off -> notice ms", "max step ms",
             "save step ms", "committed", "warn/err lines", "verdict"),
            [(row["cloud"], row["fault"], "yes" if row["detected"] else "NO", ms(row["late_ms"]),
              ms(row["after_off_ms"]) if row["off_after_raise_ms"] is not None else "-", f"{row['max_step_ms']:.1f}",
              f"{row['save_ms']:.0f}", "yes" if row["committed"] else "NO", row["log_lines"], row["verdict"])
             for row in rows],
        ))  # fmt: skip
    return 0 if all(row["verdict"] == "pass" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
