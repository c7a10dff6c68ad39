"""`spotguard demo`: a small multi-rank CPU training interrupted by an emulated cloud,
saved, resumed and compared with a run that was never interrupted.

The parent process runs the cloud's metadata emulator and launches the ranks as
subprocesses (gloo on 127.0.0.1); it raises the interruption once rank 0 is
training, so no cloud account and no setup are needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from spotguard.demo.processes import free_port, rank_env

STEPS = 60
NOTICE_AT_STEP = 20
STEP_SLEEP_S = 0.05  # makes the run long enough to watch; the model itself is tiny


def _say(text: str) -> None:
    print(text, flush=True)


class _Run:
    """One launch of all ranks; rank 0's progress lines are read to time the notice."""

    def __init__(self, name: str, ckpt_dir: Path, world_size: int, cloud: str, metadata_url: str, result: Path) -> None:
        port = free_port()
        self.name = name
        self.result_path = result
        self.logs = []
        self.procs = []
        ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
        for rank in range(world_size):
            env = rank_env(rank, world_size, port)
            cmd = [
                sys.executable,
                "-m",
                "spotguard.demo.local",
                "--worker",
                str(ckpt_dir),
                "--cloud",
                cloud,
                "--metadata-url",
                metadata_url,
                "--result",
                str(result),
            ]
            self.logs.append(ckpt_dir.parent / f"{name.replace(' ', '')}-rank{rank}.log")
            with open(self.logs[-1], "w") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=log, text=True
                    )
                )

    def wait_for_step(self, step: int) -> None:
        """Read rank 0's progress until `step` is done (or rank 0 ends)."""
        for line in self.procs[0].stdout:
            if line.startswith("{") and json.loads(line).get("step", -1) >= step:
                break
        threading.Thread(target=self.procs[0].stdout.read, daemon=True).start()  # keep draining

    def __enter__(self) -> _Run:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:  # a rank still running after a failure would write into a removed directory
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def wait(self, timeout_s: float = 180) -> list[int]:
        return [p.wait(timeout=timeout_s) for p in self.procs]

    def result(self) -> dict:
        """Rank 0's result; a DemoFailed with the end of its log when the run did not get that far."""
        try:
            return json.loads(self.result_path.read_text())
        except (OSError, ValueError):
            tails = "\n".join(f"--- {log}:\n" + "\n".join(log.read_text().splitlines()[-6:]) for log in self.logs)
            raise DemoFailed(f"{self.name} failed; the end of each rank's log:\n{tails}") from None


class DemoFailed(RuntimeError):
    pass


def run_demo(directory: str | None = None, *, world_size: int = 2, cloud: str = "aws") -> int:
    """Run the demo in `directory` (kept), or in a temporary directory removed at the end."""
    if directory is not None:
        return _demo(Path(directory), world_size, cloud, kept=True)
    with tempfile.TemporaryDirectory(prefix="spotguard-demo-", ignore_cleanup_errors=True) as scratch:
        return _demo(Path(scratch), world_size, cloud, kept=False)


def _demo(work: Path, world_size: int, cloud: str, *, kept: bool) -> int:
    from cloud_adapters.sources import metadata_emulator

    started = time.monotonic()
    _say(f"spotguard demo: {world_size} ranks (gloo, CPU), {STEPS} steps, checkpoints in {work / 'ckpt'}")
    with metadata_emulator(cloud) as emulator, contextlib.ExitStack() as runs:
        _say(f"  {cloud} metadata emulator on {emulator.url}")

        _say(f"run 1: training; the emulator raises an interruption once step {NOTICE_AT_STEP} is done")
        first = runs.enter_context(_Run("run 1", work / "ckpt", world_size, cloud, emulator.url, work / "run1.json"))
        first.wait_for_step(NOTICE_AT_STEP)
        emulator.raise_notice()
        codes = first.wait()
        r1 = first.result()
        _say(f"  ranks exited with {codes} after an emergency checkpoint (143 = 'restart me')")
        _say("  timeline of rank 0:")
        for line in r1["timeline"]:
            _say(f"    {line}")

        _say(
            "run 2: a replacement VM resumes from the newest committed checkpoint; beside it, a reference run "
            "of the same training that is never interrupted"
        )
        emulator.clear()
        second = runs.enter_context(_Run("run 2", work / "ckpt", world_size, cloud, emulator.url, work / "run2.json"))
        ref = runs.enter_context(
            _Run("reference", work / "reference-ckpt", world_size, cloud, emulator.url, work / "ref.json")
        )
        codes2 = second.wait()
        ref.wait()
        r2, r3 = second.result(), ref.result()
        _say(f"  run 2 resumed at step {r2['start']}, finished step {STEPS - 1}, exit codes {codes2}")

    same = r2["digest"] == r3["digest"]
    _say(
        f"final weights identical to the uninterrupted run: {'YES' if same else 'NO'} "
        f"(sha256 {r2['digest'][:16]}... vs {r3['digest'][:16]}...)"
    )
    where = f"inspect with: spotguard ls {work / 'ckpt'}" if kept else "its directory is removed (--dir DIR keeps it)"
    _say(f"demo finished in {time.monotonic() - started:.1f} s; {where}")
    ok = same and all(c == 143 for c in codes) and all(c == 0 for c in codes2)
    return 0 if ok else 1


# ---- one rank ------------------------------------------------------------------
def _worker(ckpt_dir: str, cloud: str, metadata_url: str, result: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import spotguard
    from spotguard.checkpoint import state_digest

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    # DDP reduces the first backward in a bucket laid out in parameter order, then rebuilds it in
    # gradient-ready order: a resumed run's first step would sum in another order than the same step
    # of a fresh run, which at 3+ ranks changes the last bits (float addition is not associative).
    # One backward before training gives every step of every run the rebuilt bucket.
    ddp(torch.zeros(1, 32)).sum().backward()
    optimizer.zero_grad(set_to_none=True)  # no step taken; DCP's optimizer loading needs grads unset
    state = {"model": ddp, "optim": optimizer}
    with spotguard.Guard(ckpt_dir, cloud=cloud, metadata_url=metadata_url, poll_interval_s=0.1) as guard:
        start = guard.resume(state)
        for step in range(start, STEPS):
            g = torch.Generator().manual_seed(step * 1000 + rank)  # the data of a step never changes
            x = torch.randn(16, 32, generator=g)
            loss = F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(json.dumps({"step": step, "loss": round(loss.item(), 5)}), flush=True)
            time.sleep(STEP_SLEEP_S)
            if guard.step(step, state):
                break
        if rank == 0:
            digest = state_digest(model.state_dict())
            timeline = guard.timeline.format().splitlines()
            Path(result).write_text(json.dumps({"start": start, "digest": digest, "timeline": timeline}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--cloud", required=True)
    parser.add_argument("--metadata-url", required=True)
    parser.add_argument("--result", required=True)
    a = parser.parse_args()
    _worker(a.worker, a.cloud, a.metadata_url, a.result)
