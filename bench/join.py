"""A node joining a job of two: the survivors' pause, in-process (`SPOTGUARD_JOIN`) against today's restart
path (an elastic torchrun agent joining the rendezvous), and the joining rank's state transfer against the
loopback's bandwidth, in the same run.

    python bench/join.py [--runs 3] [--size-gb 1.0] [--join-at 4] [--after 6] [--logs DIR] [--quick]

Torchrun agents on this host stand for the nodes (tests/nodes.py: one rank each, its own snapshot dir in
/dev/shm: the node's memory) and train examples/train_ddp.py (DDP) at the --hidden whose params + AdamW
moments are --size-gb GB per rank, snapshots on (SPOTGUARD_SNAPSHOT_EVERY=1000: step 0's). Once rank 0 has
printed step --join-at at world 2, a third node is started:

- in-process: the job runs `--in-process` (spotguard.run, static rendezvous); the third node is launched
  with `torchrun --standalone` and SPOTGUARD_JOIN. Every rank stops at an agreed step S and takes its
  snapshot; the next generation is formed at world 3 in the same processes, and the joining rank loads
  S from the survivors' snapshot servers.
- restart path (baseline): elastic torchrun (`--nnodes 2:3`, c10d, localnodes.Rendezvous); the third agent
  joins the rendezvous, every worker is restarted, and the new workers load the newest snapshot from the
  nodes' memory at world 3.

The pause: rank 0's last step line at world 2 -> its first at world 3, as this process read the lines (one
step at world 3 is in it; the median step at world 3 is shown beside it). The transfer: the joining rank's
resume (its guard watching -> its `resumed` line: the model built, the load) and its load alone (the snapshot's
bytes from the peers into its tensors, as the loader logs it), the state's bytes over the load against a plain
TCP transfer of the same bytes over 127.0.0.1 measured here first (one socket, `sendall` / `recv_into`).
The goal: a pause <= 2 s plus the state's transfer at half the loopback bandwidth. The weights of the
in-process join are checked against a restart from the same step in tests/test_inprocess.py (this bench
saves nothing durably).
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _common import table  # also puts the checkout on sys.path
from inprocess import hidden_for, keep, records, wait_step, with_common_arguments

from tests.nodes import Node, join_node, rendezvous, start_nodes, stop_all  # noqa: E402

ENV = {"SPOTGUARD_SNAPSHOT_EVERY": "1000"}  # step 0's snapshot, then only the join's
WATCHING, RESUMED = r"spotguard.watcher: watching", r"timeline: .* resumed +step="


def loopback_gbps(size: int) -> float:
    """GB/s of one TCP connection on 127.0.0.1 moving `size` bytes (chunks of 64 MiB from one buffer)."""
    chunk = bytearray(64 << 20)
    server = socket.create_server(("127.0.0.1", 0))

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(bytearray(64 << 20)), 0
        while got < size:
            n = conn.recv_into(view)
            if not n:
                break
            got += n
        conn.close()

    reader = threading.Thread(target=receive)
    reader.start()
    with socket.create_connection(server.getsockname()) as sender:
        started = time.perf_counter()
        for sent in range(0, size, len(chunk)):
            sender.sendall(memoryview(chunk)[: min(len(chunk), size - sent)])
        sender.shutdown(socket.SHUT_WR)
        reader.join()
        took = time.perf_counter() - started
    server.close()
    return size / took / 1e9


def pause(nodes: list[Node]) -> dict:
    """Rank 0's last line at world 2 -> its first at world 3 (s), the step gone on from, the median step after."""
    rank0 = sorted((t, r["step"], r["world"]) for r, t in records(nodes) if r["rank"] == 0)
    before = [(t, s) for t, s, w in rank0 if w == 2]
    after = [(t, s) for t, s, w in rank0 if w == 3 and t > before[-1][0]]
    if not after:
        raise RuntimeError("rank 0 never printed a step at world 3:\n" + "\n".join(n.tail(15) for n in nodes))
    steps = [b - a for (a, _), (b, _) in zip(after, after[1:])]
    return {"pause": after[0][0] - before[-1][0], "step": after[0][1] - 1,
            "step_s": statistics.median(steps or [float("nan")])}  # fmt: skip


def transfer(node: Node) -> tuple[float, float]:
    """The joining rank's resume (s: its guard watching -> its `resumed` line: the model built, the load), and
    its load alone (s: the snapshot's bytes from the peers into its tensors, as the loader logs it)."""
    times = [(t, line) for line, t in zip(node.lines, node.arrived)]
    start = next(t for t, line in times if re.search(WATCHING, line))
    resumed = next(t for t, line in times if t > start and re.search(RESUMED, line)) - start
    (load,) = re.findall(r"MB read into the state in ([\d.]+) s", node.output())
    return resumed, float(load)


def one_way(tmp: Path, shm: Path, train: list[str], args: argparse.Namespace, way: str, name: str) -> dict:
    for i in range(3):
        (shm / f"node{i}").mkdir(parents=True)
        (tmp / f"node{i}-memory").symlink_to(shm / f"node{i}")
    ckpt = str(tmp / "ckpt")
    if way == "in-process":
        nodes = start_nodes(2, ckpt, tmp, [*train, "--in-process"], ENV)
        join = lambda: join_node(nodes[0], 2, ckpt, tmp, [*train, "--in-process"], ENV)  # noqa: E731
    else:
        rdzv = rendezvous("2:3", max_restarts=3)
        nodes = [rdzv.join(i, ckpt, tmp, train, ENV) for i in range(2)]
        join = lambda: rdzv.join(2, ckpt, tmp, train, ENV)  # noqa: E731
    try:
        wait_step(nodes, args.join_at, 2)
        nodes.append(join())
        codes = [node.finish(900) for node in nodes]
        if codes != [0, 0, 0]:
            raise RuntimeError(f"{way} ended with {codes}:\n" + "\n".join(n.tail() for n in nodes))
    finally:
        stop_all(nodes)
        keep(args.logs, name, nodes)
    result = pause(nodes)
    text = "\n".join(n.output() for n in nodes)
    result["source"] = "/".join(sorted(set(re.findall(rf"resumed +step={result['step']} .*tier=(\w+)", text)))) or "?"
    result["resume_s"], result["load_s"] = transfer(nodes[2]) if way == "in-process" else (None, None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-at", type=int, default=4, help="rank 0's step at world 2 after which node 2 starts")
    parser.add_argument("--after", type=int, default=6, help="steps trained after the join (about; default 6)")
    args = with_common_arguments(parser).parse_args()
    hidden = 256 if args.quick else hidden_for(args.size_gb)
    size = 12 * 129 * (hidden + 1)  # params + AdamW's two moments, float32
    runs = 1 if args.quick else args.runs
    # The node's agent, interpreter and model take seconds to start: the job trains on meanwhile.
    steps = args.join_at + args.after + (60 if args.quick else 12)
    train = ["--steps", str(steps), "--hidden", str(hidden), "--log-samples", *(["--step-time", "0.2"] * args.quick)]
    loopback = loopback_gbps(max(size, 1 << 28))
    allowed = 2 + size / (loopback / 2 * 1e9)
    print(f"\n== a third node joins a job of 2 after step {args.join_at}: state {size / 1e9:.3f} GB per rank "
          f"(--hidden {hidden}: params + AdamW), 1 rank per node; loopback (one TCP connection) {loopback:.2f} GB/s; "
          f"goal: pause <= 2 s + the state at half of it = {allowed:.2f} s", flush=True)  # fmt: skip
    rows = []
    for run in range(1, runs + 1):
        ways = ["in-process", "restart"]
        result = {}
        for way in ways if run % 2 else ways[::-1]:
            with (
                tempfile.TemporaryDirectory(prefix="spotguard-bench-join-") as tmp,
                tempfile.TemporaryDirectory(prefix="spotguard-bench-join-", dir="/dev/shm") as shm,
            ):
                r = result[way] = one_way(Path(tmp), Path(shm), train, args, way, f"join-run{run}-{way}")
            print(f"run {run} {way}: went on from step {r['step']} at world 3, pause {r['pause']:.2f} s", flush=True)
        a, b = result["in-process"], result["restart"]
        rate = size / a["load_s"] / 1e9
        rows.append([run, a["step"], f"{a['pause']:.2f}", "met" if a["pause"] <= allowed else "missed",
                     f"{a['resume_s']:.2f}", f"{a['load_s']:.2f}", f"{rate:.2f} ({rate / loopback:.0%})",
                     f"{a['step_s']:.2f}", a["source"], f"{b['pause']:.2f}", f"{b['pause'] / a['pause']:.1f}x",
                     b["source"]])  # fmt: skip
    print("\nthe survivors' pause: rank 0's last step at world 2 -> its first at world 3")
    print(table(["run", "went on from", "in-process pause s", f"goal <= {allowed:.2f} s", "joining rank's resume s",
                 "its load s", "load GB/s (of loopback)", "step at world 3 s", "state from", "restart-path pause s",
                 "restart / in-process", "restart: state from"], rows))  # fmt: skip
    if runs > 1:
        ratios = sorted(float(r[-2][:-1]) for r in rows)
        print(f"restart path / in-process: median {statistics.median(ratios):.1f}x (min {ratios[0]:.1f}x, "
              f"max {ratios[-1]:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
