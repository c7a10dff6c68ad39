"""The documentation: the site builds with warnings as errors (broken links, anchors, docstrings),
its Python examples compile, and it names every option, exit code and documented API name."""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_the_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "api" / "index.html").read_text().count("spotguard.guard.Guard") > 0


@pytest.mark.parametrize(
    "page", sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *DOCS.rglob("*.md")])
)
def test_python_examples_compile(page):
    for block in python_blocks(ROOT / page):
        if block.lstrip().startswith("--8<--"):
            continue  # a file included as it is (examples/ run in their own tests)
        ast.parse(block, filename=page)


def test_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first_block = re.search(r"```sh\n(.*?)```", text, flags=re.S).group(1)
    assert "spotguard demo" in first_block and ".ci/run" in first_block


def test_every_guard_option_is_in_the_configuration_reference():
    from spotguard.guard import Guard

    page = (DOCS / "reference" / "configuration.md").read_text()
    missing = [name for name in inspect.signature(Guard).parameters if f"`{name}`" not in page]
    assert not missing, f"Guard options not documented in docs/reference/configuration.md: {missing}"


def test_every_exit_code_is_in_the_operations_guide():
    from spotguard import guard

    page = (DOCS / "guide" / "operations.md").read_text()
    for code in (guard.DEFAULT_EXIT_CODE, guard.DEFAULT_LOST_EXIT_CODE, guard.UNAVAILABLE_EXIT_CODE):
        assert re.search(rf"^\| {code} \|", page, flags=re.M), f"exit code {code} not in the operations guide"


def test_the_api_reference_documents_exactly_what_spotguard_exports():
    import spotguard

    page = (DOCS / "reference" / "api.md").read_text()
    documented = {}
    for path in re.findall(r"^::: ([\w.]+)$", page, flags=re.M):
        module, _, name = path.rpartition(".")
        documented[name] = getattr(importlib.import_module(module), name)
    exported = {name: getattr(spotguard, name) for name in spotguard.__all__ if name != "__version__"}
    assert documented == exported
