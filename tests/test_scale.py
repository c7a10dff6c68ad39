"""Invariant 1 at scale: 256 ranks (threads over 4 processes around one TCPStore server, each rank a
real Guard with a stated topology) all agree on one step, for an interruption and for a requested
save, at a constant number of store requests per rank and none while idle. This runs the scale
benchmark once at one size for its correctness; its timings are the benchmark's business."""

import json
import subprocess
import sys

from tests.ckpt_workers import ROOT


def test_256_ranks_agree_on_one_step_with_a_few_requests_each():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", "256", "--trials", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trials = json.loads(done.stdout)["trials"]
    assert sorted(t["kind"] for t in trials) == ["interruption", "request"]
    for t in trials:
        assert t["ranks"] == 256 and t["all_knew"] and t["one_step"] and t["acted_ok"], t
        assert t["round_requests"] / 256 <= 8, t  # O(1) per rank: no rank reads all N keys
        assert t["idle_requests_per_rank_per_10s"] == 0, t
