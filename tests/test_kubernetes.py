"""The Kubernetes manifest in deploy/kubernetes: checkov's Kubernetes framework passes it, its
podFailurePolicy ignores exactly spotguard's "restart me" exit codes, and its torchrun wrapper
exits with the code the node leader wrote to the exit file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spotguard.ending.exit_policy import DEFAULT_EXIT_CODE, DEFAULT_LOST_EXIT_CODE, EXIT_FILE_ENV
from spotguard.options import NoticeOptions
from tests.checkov import assert_checkov_passes, needs_checkov

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "deploy" / "kubernetes" / "training-job.yaml"


def job() -> dict:
    return next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "Job")


def test_reclaimed_pods_are_ignored_and_given_time_to_save():
    spec = job()["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    ignored = {code for r in rules if r["action"] == "Ignore" for code in r.get("onExitCodes", {}).get("values", [])}
    assert ignored == {DEFAULT_EXIT_CODE, DEFAULT_LOST_EXIT_CODE}
    assert any(c["type"] == "DisruptionTarget" for r in rules for c in r.get("onPodConditions", []))
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    grace_s = NoticeOptions().grace_s
    assert pod["terminationGracePeriodSeconds"] > grace_s
    (trainer,) = pod["containers"]
    assert {"name": EXIT_FILE_ENV, "value": "/tmp/spotguard/exit.json"} in trainer["env"]


@pytest.mark.parametrize("written, expected", [(143, 143), (75, 75), (None, 1)])
def test_the_wrapper_exits_with_the_exit_files_code(tmp_path, written, expected):
    """torchrun exits 1 when a worker exits 143; the container must exit with the code the
    node leader recorded, or the podFailurePolicy never sees 143 or 75."""
    (trainer,) = job()["spec"]["template"]["spec"]["containers"]
    exit_file = tmp_path / "exit.json"
    fake = tmp_path / "bin"
    fake.mkdir()
    record = json.dumps({"exit_code": written, "committed": written == 143}) if written else ""
    (fake / "torchrun").write_text(
        "#!/bin/sh\n" + (f"echo '{record}' > \"$SPOTGUARD_EXIT_FILE\"\n" if written else "") + "exit 1\n"
    )
    (fake / "torchrun").chmod(0o755)
    (fake / "python").symlink_to(sys.executable)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", JOB_COMPLETION_INDEX="0")
    env[EXIT_FILE_ENV] = str(exit_file)
    done = subprocess.run([*trainer["command"], *trainer["args"]], env=env, timeout=60)
    assert done.returncode == expected


@needs_checkov
def test_checkov_finds_no_failed_check(tmp_path):
    assert_checkov_passes(MANIFEST.parent, "kubernetes", tmp_path)
