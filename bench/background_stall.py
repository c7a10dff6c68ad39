"""How long a background save holds the training thread, against a plain memcpy of the same bytes.

    python bench/background_stall.py [--gb 1.0] [--repeat 5] [--dir DIR]

One process holds a state of --gb GB of float32 tensors (64 MiB each, like a model's layers).
Timed on the training thread, in the same run:

  memcpy              copy every tensor into buffers allocated beforehand (the floor: the bytes
                      have to be copied once for the step's values to survive the next step)
  fresh copy          clone every tensor into newly allocated memory (what a snapshot does when
                      it allocates each time: page faults on every save)
  dcp.async_save      torch.distributed.checkpoint.async_save with defaults, the call's own time
  spotguard           Checkpointer.save(wait=False): stage into reused host buffers and return;
                      the first save allocates them and is not counted

Each is the median of --repeat rounds (the background writes are waited for between rounds,
outside the timing). Goal (CPU): spotguard's stall <= 2x the memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from _common import table  # also puts the checkout on sys.path

from spotguard.checkpoint import Checkpointer  # noqa: E402

TENSOR_NUMEL = 16 << 20  # 64 MiB of float32


def median_s(run, repeat: int, between=lambda: None) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
        between()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", help="where the background saves write (default: a temporary directory)")
    args = parser.parse_args()
    torch.manual_seed(0)
    count = max(1, int(args.gb * 1e9 / (TENSOR_NUMEL * 4)))
    state = {f"layer{i}": torch.randn(TENSOR_NUMEL) for i in range(count)}
    nbytes = count * TENSOR_NUMEL * 4

    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    memcpy = median_s(lambda: [buffers[k].copy_(v) for k, v in state.items()], args.repeat)
    fresh = median_s(lambda: {k: v.clone() for k, v in state.items()}, args.repeat)

    with tempfile.TemporaryDirectory(prefix="spotguard-bench-stall-", dir=args.dir) as tmp:
        root = Path(tmp)
        pending = []

        def async_save() -> None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore")  # "assuming the intent is to save in a single process"
                pending.append(dcp.async_save(state, checkpoint_id=str(root / f"dcp{len(pending)}"), no_dist=True))

        async_dcp = median_s(async_save, args.repeat, lambda: pending[-1].result())

        with Checkpointer(str(root / "spotguard")) as ckpt:
            steps = iter(range(1, 10_000))
            ckpt.save(next(steps), state, reason="periodic", wait=False)  # allocates the buffers
            ckpt.wait()
            ours = median_s(
                lambda: ckpt.save(next(steps), state, reason="periodic", wait=False), args.repeat, ckpt.wait
            )

    print(f"state: {nbytes / 1e9:.2f} GB in {count} float32 tensors, one process, torch {torch.__version__}")
    rows = [
        ["memcpy into buffers allocated beforehand (the floor)", f"{memcpy:.3f}", "1.00"],
        ["fresh copy (clone into new memory)", f"{fresh:.3f}", f"{fresh / memcpy:.2f}"],
        ["dcp.async_save, defaults", f"{async_dcp:.3f}", f"{async_dcp / memcpy:.2f}"],
        ["spotguard background save (reused buffers)", f"{ours:.3f}", f"{ours / memcpy:.2f}"],
    ]
    print(table(["stall on the training thread", "seconds (median)", "vs memcpy"], rows))
    print(f"goal: spotguard's stall <= 2x memcpy: {'met' if ours <= 2 * memcpy else 'NOT met'}")


if __name__ == "__main__":
    main()
