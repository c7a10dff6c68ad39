"""Notice detection latency per cloud: from "the notice appears in the metadata service"
to "the watcher's callback runs", on the localhost metadata emulators.

    python bench/detection_latency.py [--trials 30] [--interval 1.0] [--clouds aws,gcp,azure] [--json]

For each cloud, every trial starts a fresh `Watcher` on `cloud_sources(cloud, url)`
(fresh, so de-duplication never hides the next notice), lets it settle, waits a
random phase in [0, interval) so the notice lands anywhere in the polling cycle,
raises an interruption with the emulator's `raise_notice()` (synchronous: the
notice is in the served state when it returns), and records
t(callback) - t(raise) with `time.monotonic()` in this one process. The emulator
is cleared between trials. AWS and Azure are polled every --interval; GCP uses
its hanging GET, so its latency should not depend on the interval at all.

Baseline, measured in the same run: a naive fixed-interval poller of GCP's
`instance/preempted` (GET, sleep --interval, repeat), the way a hand-written
script watches it without the hanging GET. The output gives the ratio of its
latency to ours.

Goals: AWS and Azure <= interval + 50 ms, GCP <= 100 ms, judged on p99
(nearest rank, so with fewer than 100 trials p99 is the maximum).
Exit status: 0 when every goal is met, 1 when a goal is missed or a watcher
never delivered a notice within --timeout (a hang).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere in the checkout

import requests  # noqa: E402

from cloud_adapters.aws.emulator import AWSMetadataEmulator  # noqa: E402
from cloud_adapters.azure.emulator import AzureMetadataEmulator  # noqa: E402
from cloud_adapters.emulation import MetadataEmulator  # noqa: E402
from cloud_adapters.gcp.emulator import GCPMetadataEmulator  # noqa: E402
from cloud_adapters.notice import Notice  # noqa: E402
from cloud_adapters.sources import CLOUDS, cloud_sources  # noqa: E402
from spotguard.watcher import Watcher  # noqa: E402

log = logging.getLogger("bench.detection_latency")

# How long a fresh watcher runs before the random phase starts, so the notice meets steady-state polling:
# AWS has its token, GCP its hanging GETs open. Azure reads its VM name, primes, and polls once more
# 0.25 s later (its request spacing) before settling into the interval.
SETTLE_S = 0.3
AZURE_SETTLE_S = 0.6
STOP_JOIN_S = 0.1  # a GCP hanging GET is abandoned, not waited out; it ends when the emulator stops
POLL_SLACK_MS = 50.0  # the polled clouds' goal: interval + this
HANGING_GET_GOAL_MS = 100.0
NAIVE = "gcp-naive"

EMULATORS: dict[str, Callable[[], MetadataEmulator]] = {
    "aws": AWSMetadataEmulator,
    "gcp": GCPMetadataEmulator,
    # The real 5 requests/s limit stays on: one watcher per trial stays well under it.
    "azure": AzureMetadataEmulator,
}

Stop = Callable[[], None]
Starter = Callable[[str, Callable[[], None]], Stop]  # (metadata URL, on_detect) -> stop


@dataclasses.dataclass(frozen=True)
class Target:
    """One row of the table: what watches which emulator, and the goal it must meet."""

    name: str
    cloud: str  # the emulator it runs against
    mechanism: str
    goal_ms: float | None  # None: a baseline, judged by nothing
    settle_s: float
    start: Starter


def start_watcher(cloud: str, interval_s: float) -> Starter:
    """What spotguard runs: a Watcher on every notice source of `cloud`."""

    def start(url: str, on_detect: Callable[[], None]) -> Stop:
        def on_notice(notice: Notice) -> None:
            if notice.is_interruption:
                on_detect()

        watcher = Watcher(cloud_sources(cloud, url), on_notice, interval_s=interval_s).start()
        return lambda: watcher.stop(timeout_s=STOP_JOIN_S)

    return start


def start_naive_gcp_poller(interval_s: float) -> Starter:
    """The baseline: GET instance/preempted, sleep a fixed interval, repeat."""

    def start(url: str, on_detect: Callable[[], None]) -> Stop:
        stop = threading.Event()
        session = requests.Session()
        session.trust_env = False  # localhost only, whatever proxy the environment names

        def loop() -> None:
            while not stop.is_set():
                answer = session.get(
                    f"{url}/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"}, timeout=5
                )
                if answer.text.strip() == "TRUE":
                    on_detect()
                    return
                time.sleep(interval_s)

        thread = threading.Thread(target=loop, name="naive-gcp-poller", daemon=True)
        thread.start()

        def halt() -> None:
            stop.set()
            thread.join(timeout=interval_s + 5)
            session.close()

        return halt

    return start


def targets(clouds: list[str], interval_s: float) -> list[Target]:
    rows = [
        Target(
            cloud,
            cloud,
            "hanging GET" if cloud == "gcp" else f"poll every {interval_s:g} s",
            HANGING_GET_GOAL_MS if cloud == "gcp" else interval_s * 1000 + POLL_SLACK_MS,
            AZURE_SETTLE_S if cloud == "azure" else SETTLE_S,
            start_watcher(cloud, interval_s),
        )
        for cloud in clouds
    ]
    if "gcp" in clouds:
        rows.append(
            Target(
                NAIVE, "gcp", f"naive poll every {interval_s:g} s", None, SETTLE_S, start_naive_gcp_poller(interval_s)
            )
        )
    return rows


def measure_once(
    emulator: MetadataEmulator, target: Target, interval_s: float, timeout_s: float, rng: random.Random
) -> float | None:
    """One trial's latency in ms, or None when nothing was detected within `timeout_s`."""
    detected = threading.Event()
    stamps: list[float] = []

    def on_detect() -> None:
        stamps.append(time.monotonic())  # first thing: the callback's own work is not latency
        detected.set()

    stop = target.start(emulator.url, on_detect)
    try:
        time.sleep(target.settle_s + rng.uniform(0, interval_s))
        raised = time.monotonic()  # before the call: its own cost (well under 1 ms) counts against us
        emulator.raise_notice()
        if not detected.wait(timeout_s):
            return None
        return (stamps[0] - raised) * 1000
    finally:
        stop()
        emulator.clear()


def run_target(
    target: Target, trials: int, interval_s: float, timeout_s: float, rng: random.Random
) -> list[float | None]:
    """Latencies in ms of up to `trials` trials; a trailing None when a notice never arrived."""
    emulator = EMULATORS[target.cloud]()
    emulator.start()
    try:
        samples: list[float | None] = []
        for i in range(trials):
            samples.append(measure_once(emulator, target, interval_s, timeout_s, rng))
            if samples[-1] is None:  # a hang is a bug, not a slow sample: more trials would only wait it out again
                log.error(
                    "%s trial %d: no notice within %g s; skipping the remaining trials", target.name, i + 1, timeout_s
                )
                break
        return samples
    finally:
        emulator.stop()


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile: a value that was actually measured."""
    return sorted_values[max(math.ceil(q / 100 * len(sorted_values)) - 1, 0)]


def summarise(target: Target, samples: list[float | None]) -> dict[str, Any]:
    got = sorted(s for s in samples if s is not None)
    missed = len(samples) - len(got)
    row: dict[str, Any] = {
        "name": target.name, "cloud": target.cloud, "mechanism": target.mechanism,
        "trials": len(samples), "missed": missed,
        "median_ms": round(statistics.median(got), 3) if got else None,
        "p99_ms": round(percentile(got, 99), 3) if got else None,
        "max_ms": round(got[-1], 3) if got else None,
        "min_ms": round(got[0], 3) if got else None,
        "goal_ms": target.goal_ms, "settle_s": target.settle_s,
        "samples_ms": [None if s is None else round(s, 3) for s in samples],
    }  # fmt: skip
    if target.goal_ms is None:
        row["result"] = "baseline"
    else:
        row["result"] = "pass" if not missed and row["p99_ms"] <= target.goal_ms else "FAIL"
    return row


def ratios(rows: list[dict[str, Any]]) -> dict[str, float] | None:
    """How much slower the naive GCP poller is than our hanging GET."""
    by_name = {row["name"]: row for row in rows}
    ours, naive = by_name.get("gcp"), by_name.get(NAIVE)
    if not ours or not naive or ours["missed"] or naive["missed"]:
        return None
    return {stat: round(naive[stat] / max(ours[stat], 1e-3), 1) for stat in ("median_ms", "p99_ms", "max_ms")}


def print_table(rows: list[dict[str, Any]], ratio: dict[str, float] | None) -> None:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    header = ("target", "mechanism", "trials", "median ms", "p99 ms", "max ms", "goal ms", "result")
    lines = [header] + [
        (row["name"], row["mechanism"], f"{row['trials']}" + (f" ({row['missed']} missed)" if row["missed"] else ""),
         ms(row["median_ms"]), ms(row["p99_ms"]), ms(row["max_ms"]),
         "-" if row["goal_ms"] is None else f"<= {row['goal_ms']:g}", row["result"])
        for row in rows
    ]  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    if ratio:
        print(
            f"naive GCP poller / spotguard hanging GET: median {ratio['median_ms']:.0f}x, "
            f"p99 {ratio['p99_ms']:.0f}x, max {ratio['max_ms']:.0f}x slower"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30, help="trials per cloud, at least 20 (default 30)")
    parser.add_argument("--interval", type=float, default=1.0, help="poll interval in seconds (default 1.0)")
    parser.add_argument("--clouds", default=",".join(CLOUDS), help="comma-separated subset of aws,gcp,azure")
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="seconds a trial waits for the callback before it counts as a hang (default 10)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random phases (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--verbose", action="store_true", help="show the watcher's log (one line per notice)")
    args = parser.parse_args(argv)
    if args.trials < 20:
        parser.error(f"--trials must be at least 20, got {args.trials}")
    if not 0 < args.interval <= 10:
        parser.error(f"--interval must be in (0, 10] seconds, got {args.interval:g}")
    if args.timeout <= args.interval:
        parser.error(f"--timeout must exceed --interval ({args.interval:g} s), got {args.timeout:g}")
    args.clouds = [c.strip() for c in args.clouds.split(",") if c.strip()]
    unknown = sorted(set(args.clouds) - set(CLOUDS))
    if unknown or not args.clouds:
        got = ",".join(unknown) or "nothing"
        parser.error(f"--clouds takes a comma-separated subset of {','.join(CLOUDS)}, got {got}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # The watcher logs every start and every notice, lines a trial; its failures (429s, errors) still show.
        watcher_log = logging.getLogger("spotguard.watcher")
        watcher_log.setLevel(logging.WARNING)
        watcher_log.addFilter(lambda record: " notice from " not in str(record.msg))
        logging.getLogger("cloud_adapters").setLevel(logging.WARNING)
    rng = random.Random(args.seed)
    rows = []
    started = time.monotonic()
    for target in targets(args.clouds, args.interval):
        log.info("%s: %d trials (%s)", target.name, args.trials, target.mechanism)
        rows.append(summarise(target, run_target(target, args.trials, args.interval, args.timeout, rng)))
    elapsed = time.monotonic() - started
    ratio = ratios(rows)
    if args.json:
        print(json.dumps({
            "interval_s": args.interval, "trials": args.trials, "seed": args.seed, "timeout_s": args.timeout,
            "elapsed_s": round(elapsed, 1), "cpus": os.cpu_count(),
            "python": platform.python_version(), "rows": rows, "naive_gcp_over_ours": ratio,
        }, indent=2))  # fmt: skip
    else:
        print(
            f"detection latency, notice raised -> callback; {args.trials} trials each, interval {args.interval:g} s, "
            f"seed {args.seed}, {os.cpu_count()} CPUs, {elapsed:.0f} s"
        )
        print_table(rows, ratio)
    missed = [row["name"] for row in rows if row["missed"]]
    failed = [row["name"] for row in rows if row["result"] == "FAIL"]
    if missed:
        log.error("no notice delivered within %g s in some trials of: %s", args.timeout, ", ".join(missed))
    elif failed:
        log.error("goal missed by: %s", ", ".join(failed))
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
