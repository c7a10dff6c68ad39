"""Several "nodes" on one host, for the elastic demo, the tests and the benchmarks: one torchrun
agent each (static rendezvous on 127.0.0.1 hosted by node 0; or elastic: `--nnodes MIN:MAX`, c10d
rendezvous on a store this process hosts, as a host that is never reclaimed would), each with its
own AWS metadata emulator, its own staging dir and its own snapshot dir (its host memory). A caller
reclaims a node through its emulator and may SIGKILL it (the agent and its workers: the VM
vanishes) at a moment it picks from what the node prints. The training script takes
`--checkpoint-dir`, `--local-dir` and `--cloud`. A node runs one worker unless asked for more
(`nproc_per_node`: one count for every node, or one per node for an uneven layout)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from spotguard.demo.processes import free_port


class LocalNodeError(RuntimeError):
    """A node did not print what was awaited, or did not end in time."""


class LocalNode:
    """One node: a torchrun agent running `nproc` workers of `script` (a path, or `--module`, NAME) with
    `args`, its own AWS metadata emulator and staging dir under `tmp`; every line they print is kept in
    `lines`."""

    def __init__(
        self,
        rank: int,
        rdzv: list[str],
        script: list[str],
        ckpt: str,
        tmp: Path,
        args: list[str],
        env: dict[str, str],
        nproc: int = 1,
    ) -> None:
        self.rank = rank
        self.rdzv = rdzv
        self.emulator = AWSMetadataEmulator().__enter__()
        self.local_dir = tmp / f"node{rank}"
        self.snapshot_dir = tmp / f"node{rank}-memory"  # SPOTGUARD_SNAPSHOT_DIR: this node's host memory
        self.exit_file = tmp / f"exit-node{rank}.json"  # SPOTGUARD_EXIT_FILE: how the node's job ended
        self.lines: list[str] = []
        self.arrived: list[float] = []  # when each line was read (monotonic)
        self._new_line = threading.Condition()
        cmd = [
            sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(nproc),
            *script,
            "--checkpoint-dir", ckpt, "--local-dir", str(self.local_dir), "--cloud", "aws", *args,
        ]  # fmt: skip
        env = {**os.environ, **env, "SPOTGUARD_METADATA_URL": self.emulator.url, "OMP_NUM_THREADS": "1"}
        env["SPOTGUARD_EXIT_FILE"] = str(self.exit_file)
        env.setdefault("SPOTGUARD_SNAPSHOT_DIR", str(self.snapshot_dir))
        env.update(GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self.arrived.append(time.monotonic())
                self._new_line.notify_all()
        with self._new_line:
            self.lines.append("<eof>")
            self._new_line.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120) -> str | None:
        """The first output line matching `pattern`, waiting for it; None if the node ends without one."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new_line:
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                    if line == "<eof>":
                        return None
                seen = len(self.lines)
                if not self._new_line.wait(max(0.0, deadline - time.monotonic())):
                    raise LocalNodeError(f"node {self.rank}: no line like {pattern!r} in {timeout} s:\n{self.tail()}")

    def step_reached(self, step: int, timeout: float = 120) -> None:
        """Wait until rank 0 (on node 0) printed `step`."""

        def printed(line: str) -> bool:
            return line.startswith('{"step"') and json.loads(line)["step"] >= step

        deadline = time.monotonic() + timeout
        while not any(printed(line) for line in list(self.lines)):
            if "<eof>" in self.lines or time.monotonic() > deadline:
                raise LocalNodeError(f"node {self.rank} never reached step {step}:\n{self.tail()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """The VM vanishes: SIGKILL the agent and its workers. torchrun starts each worker in a session
        of its own, so killing the agent's process group alone would leave them training on."""
        self._signal_all(signal.SIGKILL)

    def freeze(self) -> None:
        """The VM stops answering with its connections open (frozen, powered off, cut off: no FIN, no RST):
        SIGSTOP the agent and its workers. `kill()` ends a frozen node."""
        self._signal_all(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: signal.Signals) -> None:
        groups = {self.proc.pid} | {g for g in map(_group_of, _descendants(self.proc.pid)) if g is not None}
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LocalNodeError(f"node {self.rank} still running after {timeout} s:\n{self.tail()}") from None
        finally:
            self.emulator.stop()

    def output(self) -> str:
        self.wait_for("^<eof>$", timeout=30)
        return "\n".join(self.lines)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:  # it ended meanwhile
        return None


def run_nodes(
    nnodes: int,
    script: list[str],
    ckpt: str | Path,
    tmp: Path,
    args: list[str],
    out: Path | None = None,
    env: dict[str, str] | None = None,
    nproc_per_node: int | Sequence[int] = 1,
) -> dict | None:
    """A whole static run with no interruption; returns what rank 0 wrote to `out` (`--out`)."""
    args = [*args, *(["--out", str(out)] if out else [])]
    nodes = start_nodes(nnodes, script, str(ckpt), tmp, args, env, nproc_per_node)
    try:
        codes = [node.finish(180) for node in nodes]
    finally:
        stop_all(nodes)
    if codes != [0] * nnodes:
        raise LocalNodeError(
            f"a static run of {nnodes} node(s) ended with {codes}:\n" + "\n".join(n.tail() for n in nodes)
        )
    return json.loads(out.read_text()) if out else None


def start_nodes(
    nnodes: int,
    script: list[str],
    ckpt: str,
    tmp: Path,
    args: list[str],
    env: dict[str, str] | None = None,
    nproc_per_node: int | Sequence[int] = 1,
) -> list[LocalNode]:
    """`nnodes` agents with a static rendezvous hosted by node 0, each running `nproc_per_node` workers
    (a count per node: node i's ranks follow node i-1's, as torchrun numbers them)."""
    nprocs = [nproc_per_node] * nnodes if isinstance(nproc_per_node, int) else list(nproc_per_node)
    if len(nprocs) != nnodes:
        raise ValueError(f"{len(nprocs)} worker counts for {nnodes} nodes")
    port = free_port()
    static = ["--nnodes", str(nnodes), "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--max-restarts", "0"]  # fmt: skip
    return [
        LocalNode(i, [*static, "--node-rank", str(i)], script, ckpt, tmp, args, env or {}, nproc)
        for i, nproc in enumerate(nprocs)
    ]


def joining_node(
    job: LocalNode,
    rank: int,
    script: list[str],
    ckpt: str,
    tmp: Path,
    args: list[str],
    env: dict[str, str] | None = None,
) -> LocalNode:
    """A node (`rank` names it here) that joins the running job of `job`, its node 0 (a static rendezvous), in
    the job's processes (`spotguard.run`): an agent of its own (`--standalone`), pointed at the job's store."""
    port = job.rdzv[job.rdzv.index("--master-port") + 1]
    return LocalNode(
        rank, ["--standalone"], script, ckpt, tmp, args, {**(env or {}), "SPOTGUARD_JOIN": f"127.0.0.1:{port}"}
    )


class Rendezvous:
    """The c10d rendezvous store of an elastic job, hosted here (where nothing is reclaimed), and
    the nodes that join it, each running `script`: short heartbeats and last call, so that a
    vanished node is dropped in ~3 s and a round closes 1 s after MIN agents are in."""

    def __init__(self, nnodes: str, max_restarts: int, script: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False)
        self.script = script
        # Each round's workers get a store of their own (their rank 0 hosts it): with torchrun's shared
        # agent store, an agent joining a later round never gets its address (torch 2.13) and the round fails.
        self.env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
        self.args = [
            "--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", "job", "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", "--local-addr",
            "127.0.0.1",
            "--rdzv-conf", "is_host=false,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
        ]  # fmt: skip

    def join(self, name: int, ckpt: str, tmp: Path, args: list[str], env: dict[str, str] | None = None) -> LocalNode:
        """Start a node's agent (`name` tells nodes apart here; the rendezvous gives it its rank)."""
        return LocalNode(name, self.args, self.script, ckpt, tmp, args, {**self.env, **(env or {})})


def stop_all(nodes: list[LocalNode]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.kill()
        node.finish(30)
