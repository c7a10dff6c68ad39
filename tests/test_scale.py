"""Invariant 1 at scale: 256 ranks (threads over 4 processes around one TCPStore server, each rank a
real Guard with a stated topology) all agree on one step, for an interruption and for a requested
save, at a constant number of store requests per rank and none while idle. This runs the scale
benchmark once at two sizes for its correctness; its timings are the benchmark's business."""

import json
import subprocess
import sys

from tests.ckpt_workers import ROOT

SMALL, LARGE = 32, 256
KINDS = ("interruption", "request")


def test_256_ranks_agree_on_one_step_with_a_few_requests_each():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--ranks", f"{SMALL},{LARGE}", "--trials", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trials = json.loads(done.stdout)["trials"]
    assert sorted((t["ranks"], t["kind"]) for t in trials) == [(n, k) for n in (SMALL, LARGE) for k in KINDS]
    per_rank = {(t["ranks"], t["kind"]): t["round_requests"] / t["ranks"] for t in trials}
    for t in trials:
        assert t["all_knew"] and t["one_step"] and t["acted_ok"], t
        assert t["idle_requests_per_rank_per_10s"] == 0, t
    # O(1) per rank: 8x the ranks, the same requests per rank (within one: the round's fixed few are spread
    # over fewer ranks at 32). A rank that read every rank's key would cost 8x more; log N, 3 more.
    for kind in KINDS:
        assert abs(per_rank[SMALL, kind] - per_rank[LARGE, kind]) <= 1 and per_rank[LARGE, kind] <= 8, per_rank
