"""checkov, installed by .ci/install-terraform-tools in a venv of its own, run offline on a folder."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

CHECKOV = Path(__file__).resolve().parents[1] / ".ci-venvs" / "checkov" / "bin" / "checkov"
needs_checkov = pytest.mark.skipif(
    not CHECKOV.exists(), reason="checkov not installed: run .ci/install-terraform-tools"
)


def assert_checkov_passes(directory: Path, framework: str, cwd: Path, *, at_least: int = 50) -> None:
    """No failed check and no parsing error in `directory` for `framework`; more than `at_least` passed."""
    done = subprocess.run(
        [str(CHECKOV), "-d", str(directory), "--framework", framework, "--skip-download", "--quiet", "--compact"]
        + ["-o", "json"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
    )
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']})"
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    summary = reports[0]["summary"]
    assert summary["parsing_errors"] == 0 and summary["passed"] > at_least, summary
    assert done.returncode == 0, done.stderr
