"""`spotguard` — watch, simulate, demo, ls, verify, report, join-address."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from cloud_adapters import validation as check
from cloud_adapters.endpoints import normalise_base_url
from cloud_adapters.notice import Notice
from cloud_adapters.signals import parse_signal
from cloud_adapters.sources import CLOUDS, metadata_emulator
from cloud_adapters.storage import StoreError
from cloud_adapters.stores import check_location, local_path

log = logging.getLogger("spotguard")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return check.seconds("", value)  # argparse names the flag: "argument --grace: must be ..."
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def _url(text: str) -> str:
    try:
        return normalise_base_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _signals(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    try:
        for name in names:
            parse_signal(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


class _Parser(argparse.ArgumentParser):
    """A bad flag gets one line (argparse would print the whole usage above it); subcommands inherit this."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spotguard", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    watch = sub.add_parser("watch", help="watch for interruption notices and print one line per notice")
    watch.add_argument("--cloud", choices=CLOUDS + ("none", "auto"), default="auto")
    watch.add_argument("--metadata-url", type=_url, help="metadata service base URL (an emulator, say)")
    watch.add_argument("--interval", type=_seconds, default=1.0, help="seconds between polls (default 1)")
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    watch.add_argument("--once", action="store_true", help="exit 0 after the first interruption")
    watch.add_argument(
        "--signals",
        type=_signals,
        default=("SIGTERM",),
        help="comma-separated signals that count as an interruption (default SIGTERM)",
    )
    watch.add_argument("--grace", type=_seconds, default=25.0, help="deadline after a signal, seconds")
    watch.add_argument(
        "--exec",
        dest="exec_cmd",
        metavar="CMD",
        help="run CMD (a shell command) per notice, with the notice as JSON in SPOTGUARD_NOTICE",
    )

    sim = sub.add_parser("simulate", help="run a cloud's metadata emulator on localhost")
    sim.add_argument("--cloud", choices=CLOUDS, required=True)
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=_port, default=0)
    sim.add_argument("--notice-after", type=_seconds, metavar="S", help="raise an interruption after S seconds")

    demo = sub.add_parser("demo", help="an end-to-end run: training, interruption, emergency save, resume")
    demo.add_argument("--dir", help="checkpoint directory (default: a fresh temporary one)")
    demo.add_argument("--world-size", type=int, choices=range(1, 5), metavar="N", help="ranks (default 2)")
    demo.add_argument("--cloud", choices=CLOUDS, help="whose notice (default aws)")
    demo.add_argument(
        "--elastic", action="store_true", help="two torchrun nodes: one reclaimed, the other trains on, one joins"
    )

    # Both use SPOTGUARD_CHECKPOINT_KEY when it is set: steps not signed with it are then not committed / BAD.
    ls = sub.add_parser("ls", help="list checkpoints of a directory or bucket")
    ls.add_argument("location")
    ls.add_argument("--json", action="store_true", help="one JSON array of the steps ([] when there is none)")

    verify = sub.add_parser("verify", help="check checkpoints against their manifests")
    verify.add_argument("location", help="DIR, DIR/step-N, or a bucket URL")

    report = sub.add_parser("report", help="what interruptions cost, from the goodput ledger")
    report.add_argument("location", help="the checkpoint directory or bucket URL")
    report.add_argument("--json", action="store_true", help="one JSON object with every number")
    report.add_argument("--plot", metavar="OUT", help="draw the timeline into OUT.png or OUT.html (needs matplotlib)")

    found = sub.add_parser(
        "join-address",
        help="the store address of a running in-process job that takes nodes (exit 1: none; start as usual)",
    )
    found.add_argument("registry", help="HOST:PORT the job's rank 0 records it in ($SPOTGUARD_JOIN_REGISTRY there)")
    found.add_argument("--job", required=True, help="the job's id (torchrun's --rdzv-id)")
    found.add_argument(
        "--timeout",
        type=_seconds,
        default=10.0,
        help="seconds to wait for the registry, then for the job to show it takes nodes (10)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = args.command == "demo"  # the demo prints its own timeline; its logs go to files
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler = {"watch": _watch, "simulate": _simulate, "demo": _demo, "ls": _ls, "verify": _verify, "report": _report,
               "join-address": _join_address}[args.command]  # fmt: skip
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, StoreError) as exc:  # a user's input or environment: one line, no traceback
        print(f"spotguard {args.command}: {exc}", file=sys.stderr)
        return 2


# ---- watch -----------------------------------------------------------------------
def format_notice(notice: Notice, as_json: bool) -> str:
    if as_json:
        return json.dumps(notice.to_json(), sort_keys=True)
    when = "no deadline"
    if notice.deadline is not None:
        when = f"deadline {notice.to_json()['deadline']} ({notice.describe_deadline()})"
    return f"{notice.kind.upper()} {notice.cloud} {notice.action} from {notice.source}: {when}"


def _watch(args: argparse.Namespace) -> int:
    from cloud_adapters.detect import detect_cloud
    from cloud_adapters.signals import SignalSource
    from cloud_adapters.sources import cloud_sources
    from spotguard.watcher import Watcher

    cloud = detect_cloud(args.metadata_url) if args.cloud == "auto" else args.cloud
    signals = SignalSource(tuple(parse_signal(s) for s in args.signals), grace_s=args.grace)
    signals.install()
    done = threading.Event()
    lock = threading.Lock()

    def on_notice(notice: Notice) -> None:
        with lock:
            print(format_notice(notice, args.json), flush=True)
            if args.exec_cmd:
                env = dict(os.environ, SPOTGUARD_NOTICE=json.dumps(notice.to_json()))
                code = subprocess.call(args.exec_cmd, shell=True, env=env)
                if code:
                    log.warning("--exec command exited with %d", code)
        # --once ends at the first interruption; a signal always ends the service (systemctl stop, docker stop).
        if (args.once and notice.is_interruption) or notice.cloud == "signal":
            done.set()

    log.info("watching %s%s", cloud, f" at {args.metadata_url}" if args.metadata_url else "")
    with Watcher([signals, *cloud_sources(cloud, args.metadata_url)], on_notice, interval_s=args.interval):
        while not done.wait(0.5):
            pass
    return 0


# ---- simulate ----------------------------------------------------------------------
def _simulate(args: argparse.Namespace) -> int:
    emulator = metadata_emulator(args.cloud, args.host, args.port)
    emulator.start()
    print(f"{args.cloud} metadata emulator on {emulator.url}", flush=True)
    print(f"  raise a notice: curl -X POST {emulator.url}/_spotguard/notice -d '{{}}'", flush=True)
    print(f"  watch it:       spotguard watch --cloud {args.cloud} --metadata-url {emulator.url}", flush=True)
    if args.notice_after:
        emulator.schedule_notice(args.notice_after)
        print(f"  an interruption will be raised in {args.notice_after:g} s", flush=True)
    try:
        threading.Event().wait()
    finally:
        emulator.stop()
    return 0


# ---- demo, ls, verify ----------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from spotguard.demo.local import DemoFailed, run_demo

    if args.elastic:
        if args.world_size is not None or args.cloud is not None:
            raise ValueError("--elastic runs two nodes of one rank each with AWS notices: drop --world-size / --cloud")
        from spotguard.demo.elastic import run_elastic_demo

        return run_elastic_demo(args.dir)
    try:
        return run_demo(args.dir, world_size=args.world_size or 2, cloud=args.cloud or "aws")
    except DemoFailed as exc:
        print(f"spotguard demo: {exc}", file=sys.stderr)
        return 1


def _ls(args: argparse.Namespace) -> int:
    from spotguard.checkpoint import list_checkpoints
    from spotguard.checkpoint.format.auth import resolve_key

    rows = list_checkpoints(existing_location(args.location), key=resolve_key())
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=1, sort_keys=True))
        return 0
    if not rows:
        print(f"no checkpoints in {args.location}")
        return 0
    header = f"{'STEP':>10}  {'REASON':<10} {'SIZE':>10} {'FILES':>5}  {'COMMITTED':<9}  {'SIGNED':<6}  {'RUN':<16}"
    print(header + "  CREATED")
    for row in rows:
        print(
            f"{row.step:>10}  {row.reason or '-':<10} {_size(row.size):>10} {row.files:>5}  "
            f"{'yes' if row.committed else 'NO':<9}  {'yes' if row.signed else 'no':<6}  {row.run or '-':<16}  "
            f"{row.created_at or '-'}" + (f"  ({row.problem})" if row.problem else "")
        )
    return 0


def _verify(args: argparse.Namespace) -> int:
    from spotguard.checkpoint import verify_checkpoint
    from spotguard.checkpoint.format.auth import resolve_key
    from spotguard.checkpoint.io.progress import cli_progress

    location, step = split_step(args.location)
    existing_location(location)
    results = verify_checkpoint(location, step, progress=cli_progress, key=resolve_key())
    if not results:
        print(f"no checkpoints in {args.location}")
        return 1
    bad = 0
    for result in results:
        if result.ok:
            print(f"step {result.step}: OK")
        elif not result.committed:  # no manifest: not a checkpoint (resume and retention ignore it), not a fault
            print(f"step {result.step}: uncommitted (no manifest)")
        else:
            bad += 1
            print(f"step {result.step}: BAD")
            for problem in result.problems:
                print(f"  - {problem}")
    return 1 if bad or not any(r.committed for r in results) else 0  # no checkpoint at all: as for an empty dir


def _report(args: argparse.Namespace) -> int:
    from cloud_adapters.stores import open_store
    from spotguard.goodput.ledger import read_ledger
    from spotguard.goodput.report import format_text, summarize

    plot = None
    if args.plot:
        from spotguard.goodput.plot import check_plot_path, write_plot

        plot = check_plot_path(args.plot)  # before reading: a wrong suffix is said at once
    store = open_store(existing_location(args.location))
    summary = summarize(read_ledger(store))
    if not summary["segments"]:
        print(f"no goodput ledger in {args.location}", file=sys.stderr)
        return 1
    text = format_text(summary, args.location)
    if plot is not None:
        write_plot(summary, plot, text)
    print(json.dumps(summary, indent=1, sort_keys=True) if args.json else text)
    return 0


# ---- join-address ------------------------------------------------------------------
def _join_address(args: argparse.Namespace) -> int:
    from spotguard.inprocess.join_address import look_up

    try:
        address = look_up(args.registry, args.job, args.timeout)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - the registry's store does not answer: one line
        print(f"spotguard join-address: the registry at {args.registry} did not answer: {exc}", file=sys.stderr)
        return 1
    if address is None:
        print(f"spotguard join-address: no in-process job {args.job!r} takes nodes at {args.registry}", file=sys.stderr)
        return 1
    print(address)
    return 0


def existing_location(location: str) -> str:
    """`location` unless its form is wrong (an empty one would list the current directory) or it is
    a local path that is not a directory (a typo would list as empty)."""
    location = check_location(location, argument="location")
    path = local_path(location)
    if path is None:  # a bucket: its store tells what is wrong with it
        return location
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(f"{location}: {'not a directory' if directory.exists() else 'no such directory'}")
    return location


def split_step(location: str) -> tuple[str, int | None]:
    """`DIR/step-0000000042` -> (`DIR`, 42); anything else -> (location, None)."""
    head, _, tail = location.rstrip("/").rpartition("/")
    if head and tail.startswith("step-") and tail[5:].isdigit():
        return head, int(tail[5:])
    return location, None


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
