"""Several "nodes" on one host: one torchrun agent each (`--nnodes N --node-rank i`, static
rendezvous on 127.0.0.1 hosted by node 0), each with its own AWS metadata emulator and its
own local staging dir, running examples/train_ddp.py. A test reclaims one node through its
emulator and may SIGKILL it (the agent and its workers: the VM vanishes) at a moment it
picks from what the node logs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from tests.ckpt_workers import free_port

ROOT = Path(__file__).resolve().parents[1]


class Node:
    """One node: a torchrun agent with its workers, its own emulator and staging dir."""

    def __init__(
        self, rank: int, nnodes: int, port: int, ckpt: str, tmp: Path, args: list[str], env: dict[str, str]
    ) -> None:
        self.rank = rank
        self.emulator = AWSMetadataEmulator().__enter__()
        self.local_dir = tmp / f"node{rank}"
        self.exit_file = tmp / f"exit-node{rank}.json"  # SPOTGUARD_EXIT_FILE: how the node's job ended
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--node-rank", str(rank), "--nproc-per-node", "1",
            "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--max-restarts", "0",
            str(ROOT / "examples" / "train_ddp.py"),
            "--checkpoint-dir", ckpt, "--local-dir", str(self.local_dir), "--cloud", "aws", *args,
        ]  # fmt: skip
        env = {**os.environ, **env, "SPOTGUARD_METADATA_URL": self.emulator.url, "OMP_NUM_THREADS": "1"}
        env["SPOTGUARD_EXIT_FILE"] = str(self.exit_file)
        env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
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
                    raise AssertionError(f"node {self.rank}: no line like {pattern!r} in {timeout} s:\n{self.tail()}")

    def step_reached(self, step: int, timeout: float = 120) -> None:
        """Wait until rank 0 (on node 0) printed `step`."""

        def printed(line: str) -> bool:
            return line.startswith("{") and json.loads(line)["step"] >= step

        deadline = time.monotonic() + timeout
        while not any(printed(line) for line in list(self.lines)):
            if "<eof>" in self.lines or time.monotonic() > deadline:
                raise AssertionError(f"node {self.rank} never reached step {step}:\n{self.tail()}")
            time.sleep(0.02)

    def kill(self) -> None:
        """The VM vanishes: SIGKILL the agent and its workers."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node {self.rank} still running after {timeout} s:\n{self.tail()}") from None
        finally:
            self.emulator.stop()

    def output(self) -> str:
        self.wait_for("^<eof>$", timeout=30)
        return "\n".join(self.lines)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def start_nodes(nnodes: int, ckpt: str, tmp: Path, args: list[str], env: dict[str, str] | None = None) -> list[Node]:
    port = free_port()
    return [Node(i, nnodes, port, ckpt, tmp, args, env or {}) for i in range(nnodes)]


def stop_all(nodes: list[Node]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.kill()
        node.finish(30)
