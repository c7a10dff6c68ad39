"""The published figures: every table of docs/benchmarks.md says when, on which code and with which
script it was measured, and the README's figures are the ones docs/benchmarks.md reports."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MEASURED = re.compile(r"^\*Measured (\d{4}-\d\d-\d\d) on the code of ([0-9a-f]{7,40})\b[^;]*; `([^`]+)`; ([^*]+)\.\*$")
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def titled_results() -> list[tuple[str, str]]:
    """(the bold title that opens each result, the line just above it) in docs/benchmarks.md."""
    lines = BENCHMARKS.read_text().splitlines()
    return [(line, lines[i - 2] if i >= 2 else "") for i, line in enumerate(lines)
            if line.startswith("**") and "`bench/" in line]  # fmt: skip


def test_every_result_in_the_benchmarks_page_says_when_on_what_code_and_with_which_script() -> None:
    results = titled_results()
    assert len(results) >= 15, "the benchmarks page lost its results?"
    for title, label in results:
        found = MEASURED.match(label)
        assert found, f"no '*Measured DATE on the code of COMMIT; `python bench/...`; ...' line above {title[:60]!r}"
        script = shlex.split(found.group(3).replace("[", "").replace("]", ""))[1]
        assert (ROOT / script).is_file(), f"{title[:50]!r} names {script}, which is not in the checkout"


def _numbers(text: str) -> list[str]:
    return [n.replace(",", "") for n in NUMBER.findall(text)]


def _decimals(number: str) -> int:
    return len(number.split(".")[1]) if "." in number else 0


def _has(values: list[float], number: str) -> bool:
    half = 0.5 * 10 ** -_decimals(number) + 1e-9  # as rounded for the README, either way at a half
    return any(abs(value - float(number)) <= half for value in values)


def test_every_figure_in_the_readme_is_one_the_benchmarks_page_reports() -> None:
    """Each row's figures (result and baseline) all appear, as rounded, in one result of the benchmarks page."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Measured") : readme.index("## Documentation")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 6
    results = re.split(r"^\*Measured ", BENCHMARKS.read_text(), flags=re.M)[1:]
    sections = [[float(n) for n in _numbers(result)] for result in results]
    for row in rows:
        figures = _numbers(" ".join(row.split("|")[2:]))  # the result and the baseline cells
        assert any(all(_has(values, n) for n in figures) for values in sections), (
            f"README's {figures} ({row.split('|')[1].strip()[:50]!r}) are not all in one result of docs/benchmarks.md"
        )
