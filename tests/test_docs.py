"""The documentation: the site builds with warnings as errors (broken links, anchors, docstrings),
its Python examples compile (those of the quickstart and settings pages run), and it names every
option, exit code and documented API name."""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_prose import PAGES, auto_bounds, auto_bounds_of, guard_calls, keywords_of, python_blocks

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


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


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
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
    """The page's tables are generated from spotguard.options at build time (docs/hooks): every
    field of every group and every parameter of Guard() appears, with the documentation it carries."""
    import dataclasses

    from spotguard.guard import Guard
    from spotguard.options import GROUPS

    sys.path.insert(0, str(DOCS / "hooks"))
    try:
        import options_reference
    finally:
        sys.path.pop(0)
    source = (DOCS / "reference" / "configuration.md").read_text()
    assert options_reference.MARKER in source
    page = options_reference.on_page_markdown(source, page=None)
    fields = [f for kind in GROUPS.values() for f in dataclasses.fields(kind)]
    assert all(f.metadata["doc"] for f in fields)
    missing = [f.name for f in fields if f"| `{f.name}` |" not in page]
    missing += [name for name in inspect.signature(Guard).parameters if name != "options" and f"`{name}" not in page]
    assert not missing, f"Guard options not in the configuration reference: {missing}"
    assert "| `keep_last` | all | the highest committed steps to keep" in page


def test_every_keyword_the_docs_give_guard_or_an_options_group_is_one_it_takes():
    """A renamed or misspelt keyword in a page's `Guard(...)`, `SaveOptions(...)` or `guarded(...)` (code
    blocks parsed, inline code read; tests/doc_prose.py): the example would fail with a TypeError."""
    calls = guard_calls()
    wrong = [
        f"{c.where()}: {c.name}() takes no {sorted(keywords - keywords_of(callee))}"
        for c in calls
        for callee, keywords in [c.value]
        if keywords - keywords_of(callee)
    ]
    assert not wrong, "\n".join(wrong)
    assert {c.name for c in calls} >= {"Guard", "SaveOptions", "guarded"}  # the scan still finds them


def test_the_bounds_of_an_auto_interval_written_in_the_prose_are_the_code_s():
    """ "between 10 s and 900 s" next to `snapshot_interval_s="auto"`, for instance (tests/doc_prose.py)."""
    said = auto_bounds()
    wrong = [s for s in said if s.value != auto_bounds_of(s.name)]
    assert not wrong, "\n".join(f"{s.where()}: {s.name} {s.value}, the code's {auto_bounds_of(s.name)}" for s in wrong)
    assert "snapshot_interval_s" in {s.name for s in said}  # the scan still finds it


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


# Pages whose examples run as they are, against a real S3 protocol server (their bucket renamed to the
# test's); the names the prose leaves to the reader are bound to a tiny real model and loop. The
# framework pages' snippets stand for the scripts in examples/, which their own tests run in full.
RUNNABLE = ["README.md", "docs/index.md", "docs/reference/configuration.md"]


@pytest.mark.parametrize("page", RUNNABLE)
def test_python_examples_run(page, storage_servers, monkeypatch, tmp_path):
    import torch

    from spotguard.goodput.ledger import read_ledger
    from tests.conftest import backend_for
    from tests.servers import free_port

    backend = backend_for("s3", storage_servers, monkeypatch, tmp_path)
    monkeypatch.setenv("SPOTGUARD_METADATA_URL", f"http://127.0.0.1:{free_port()}")  # "auto" probes here only
    blocks = [b for b in python_blocks(ROOT / page) if not b.lstrip().startswith("--8<--")]
    assert blocks, f"{page} has no Python example"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step() -> None:
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()

    for block in blocks:
        code = block.replace("s3://bucket/", f"s3://{backend.bucket}/")
        namespace = {"ddp_model": model, "optimizer": optimizer, "total_steps": 3, "train_step": train_step}
        exec(compile(code, page, "exec"), namespace)  # noqa: S102 - the documentation's own code
    if "with spotguard.Guard(" in blocks[0]:  # the quickstart ran a guarded loop: its segment is in the ledger
        from cloud_adapters.stores import open_store

        records = read_ledger(open_store(f"s3://{backend.bucket}/run-7")).records
        assert [r.EVENT for r in records][:2] == ["start", "resume"] and records[-1].why == "finished"
