"""One node of two reclaimed, with sharded (FSDP2) state: how soon is the leaving node free to go,
and how soon have the survivors committed?

Two torchrun agents on this host stand for two nodes (tests/nodes.py: each with its own AWS
metadata emulator and staging dir) and train examples/train_ddp.py with --fsdp and a hidden width
that gives about `--gb-per-rank` of model and Adam state per rank. Node 1's emulator raises a spot
interruption; node 1 hands the shards that exist only on it to node 0 over TCP and is free to go;
node 0 writes everything and commits. Measured from the nodes' own logs (one host, one clock):

- agreed step reached (the leaving node's "save-start as=leaving") -> leaving node free to go (the
  handoff), against the baseline: the same bytes written to the leaving node's own disk with fsync
  (what it did before survivors committed alone), timed in this run on the same disk with two
  writer threads;
- notice -> agreed step reached (the training step in flight when the notice came) and notice ->
  leaving node free to go, the sum of the two;
- notice -> committed by the survivors, against GCP's 30 s window.

    python bench/survivors.py [--gb-per-rank 1.0]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from _common import table  # also puts the checkout on sys.path

from tests.nodes import start_nodes, stop_all  # noqa: E402

GCP_WINDOW_S = 30.0
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
_ISO_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z")


def when(line: str) -> float:
    """The time a log line was written (the timeline's ISO time when it has one), as a UNIX time."""
    iso = _ISO_TIME.search(line)
    if iso:
        return datetime.fromisoformat(iso.group(1)).replace(tzinfo=timezone.utc).timestamp()
    stamp = _LOG_TIME.match(line)
    if not stamp:
        raise ValueError(f"no time in {line!r}")
    return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()


def hidden_for(gb_per_rank: float) -> int:
    """examples/train_ddp.py's model has ~129 x hidden parameters; with Adam the state is 3 floats each."""
    return int(gb_per_rank * 2 * 1e9 / (3 * 4 * 129))


def disk_write_s(nbytes: int, where: Path, threads: int = 2) -> float:
    """Write `nbytes` in `threads` files with fsync: the leaving node saving its own shards."""
    block = os.urandom(8 << 20)
    per_file = nbytes // threads

    def write(path: Path) -> None:
        with open(path, "wb") as f:
            left = per_file
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())

    started = time.monotonic()
    workers = [threading.Thread(target=write, args=(where / f"shard{i}",)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb-per-rank", type=float, default=1.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="spotguard-bench-survivors-") as tmp_dir:
        tmp = Path(tmp_dir)
        train = ["--fsdp", "--hidden", str(hidden_for(args.gb_per_rank)), "--steps", "1000"]
        nodes = start_nodes(2, str(tmp / "ckpt"), tmp, train)
        try:
            nodes[0].step_reached(1, timeout=600)
            nodes[1].emulator.raise_notice()
            started = nodes[1].wait_for(r"save-start .*as=leaving", timeout=300)
            handing = nodes[1].wait_for(r"is leaving: handing", timeout=300)
            free = nodes[1].wait_for(r"free to go", timeout=300)
            committed = nodes[0].wait_for(r"committed +step=", timeout=300)
            noticed = nodes[1].wait_for(r"timeline: .*notice +source=", timeout=10)
            for node in nodes:
                node.finish(300)
        finally:
            stop_all(nodes)
        if not (started and handing and free and committed and noticed):
            sys.exit("the run did not get as far as a commit by the survivors:\n" + nodes[0].tail() + nodes[1].tail())
        mb = float(re.search(r"\(([\d.]+) MB\)", handing).group(1))
        baseline = disk_write_s(int(mb * 1e6), tmp)

    t0, t_step = when(noticed), when(started)
    free_s, committed_s, step_s = when(free) - t_step, when(committed) - t0, t_step - t0
    print(f"leaving node's unique shards: {mb / 1e3:.2f} GB (rank 1 of 2, FSDP2 model + Adam state)")
    rows = [
        ["leaving node writes its shards to its own disk + fsync (baseline)", f"{baseline:.2f}", "1.00"],
        ["agreed step reached -> leaving node free to go (handoff)", f"{free_s:.2f}", f"{free_s / baseline:.2f}"],
        ["  of which the transfer to the survivor", f"{when(free) - when(handing):.2f}", ""],
        ["notice -> agreed step reached (the training step in flight)", f"{step_s:.2f}", ""],
        ["notice -> leaving node free to go", f"{when(free) - t0:.2f}", ""],
        ["notice -> committed by the survivor", f"{committed_s:.2f}", ""],
    ]
    print(table(["what (one host, 2 nodes)", "seconds", "vs own disk write"], rows))
    print(f"goal: free to go in <= 0.5x the own-disk write: {'met' if free_s <= 0.5 * baseline else 'NOT met'}")
    print(f"goal: committed within GCP's {GCP_WINDOW_S:.0f} s: {'met' if committed_s <= GCP_WINDOW_S else 'NOT met'}")


if __name__ == "__main__":
    main()
