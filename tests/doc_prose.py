"""What the documentation says about the Guard's settings, read by convention, for the tests that hold
it to the code (test_docs.py, test_options.py).

The configuration reference is generated from spotguard.options; these are the places written by hand:

- calls: every `Guard(...)` and `XxxOptions(...)` in a page, in Python blocks (parsed), other code
  blocks and inline code (their top-level `name=`), and every call in a Python block to a spotguard
  function that passes its `**options` on to `Guard`;
- defaults, X a number (in s or not) or a code span: "`name` (default X)", "`name` (X by default...)",
  "`name` (X)", "`name`, defaults to X", "`name=X`, the default", "[`a`, `b`] (X and Y by default)";
  a row "| `name` | ... | X |" of a table with a "default" column; for the variable an option reads,
  "NAME=... # default X" and "(`name`, `$NAME`, or `X`)";
- auto bounds: "between X s and Y s" in a paragraph that names `name="auto"` (or `NAME=auto`, the
  option's variable).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Said:
    """One thing a page says: where, about which setting (or callee), and what."""

    page: str
    line: int
    name: str
    value: Any

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


# ---- the code's side -----------------------------------------------------------------------------


def option_fields() -> dict[str, dataclasses.Field]:
    from spotguard.options import GROUPS

    return {f.name: f for group in GROUPS.values() for f in dataclasses.fields(group)}


def option_envs() -> dict[str, str]:
    """{environment variable: the option that reads it}, as each field's documented default names it."""
    found = {}
    for name, field in option_fields().items():
        for env in re.findall(r"\$(SPOTGUARD_\w+)", field.metadata.get("shown") or ""):
            found[env] = name
    return found


def guard_keywords() -> set[str]:
    """What `Guard(...)` takes by name: its parameters and every option field (not the renamed ones)."""
    from spotguard.guard import Guard

    params = inspect.signature(Guard).parameters
    return {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD} | set(option_fields())


def keywords_of(callee: Any) -> set[str] | None:
    """The keywords `callee` takes: an options group's fields; a function's parameters, with every
    keyword of Guard where it passes `**options` on to one (the integrations' convention); None when
    it takes any other `**kwargs` (nothing to check)."""
    from spotguard.guard import Guard

    if callee is Guard:
        return guard_keywords()
    if isinstance(callee, type) and dataclasses.is_dataclass(callee):
        return {f.name for f in dataclasses.fields(callee)}
    params = inspect.signature(callee).parameters
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    rest = [n for n, p in params.items() if p.kind is p.VAR_KEYWORD]
    if not rest:
        return named
    return named | guard_keywords() if rest == ["options"] else None


def default_of(name: str) -> Any:
    """The value option `name` takes when neither the call nor the environment gives one: the field's
    default once checked, or for the fields resolved later (None in the dataclass), what they resolve to."""
    from spotguard import options
    from spotguard.ending import elastic
    from spotguard.goodput import cadence
    from spotguard.snapshots import node_dir

    field = option_fields()[name]
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SPOTGUARD_")}
    try:
        for group in options.GROUPS.values():
            if field in dataclasses.fields(group):
                value = getattr(group(), name)
        later = {
            "min_save_interval_s": cadence.DEFAULT_MIN_S,
            "max_save_interval_s": cadence.DEFAULT_MAX_S,
            "snapshot_dir": node_dir.DEFAULT_BASE,
            "min_nodes": elastic.min_nodes(None),
        }
        return later[name] if value is None and name in later else value
    finally:
        os.environ.update(saved)


def auto_bounds_of(name: str) -> tuple[float, float]:
    """The bounds of option `name`'s "auto" interval, from the cadence the code makes for it."""
    from spotguard.options import SaveOptions, SnapshotOptions

    made = {
        "save_interval_s": lambda: SaveOptions(save_interval_s="auto"),
        "snapshot_interval_s": lambda: SnapshotOptions(snapshot_interval_s="auto"),
        "snapshot_every": lambda: SnapshotOptions(snapshot_interval_s="auto"),  # $SPOTGUARD_SNAPSHOT_EVERY=auto
    }
    chosen = made[name]().cadence()
    return chosen.min_s, chosen.max_s


def matches(said: Said) -> bool:
    """Whether a default the prose writes is the code's. One computed per run, written with a placeholder
    (`$TMPDIR/spotguard-staging/<hash>`), is held to the wording of the configuration reference."""
    if same(said.value, default_of(said.name)):
        return True
    shown = option_fields()[said.name].metadata.get("shown") or ""
    return bool(re.search(r"<\w+>", said.value)) and said.value in shown


def same(written: str, actual: Any) -> bool:
    """Whether a value as the prose writes it ("25 s", "`\"auto\"`", "/dev/shm", "1") is `actual`."""
    text = written.strip().strip("`").strip('"').removesuffix(" s")
    if isinstance(actual, (int, float)) and not isinstance(actual, bool):
        try:
            return float(text) == float(actual)
        except ValueError:
            return False
    return text == str(actual)


# ---- the pages' side -----------------------------------------------------------------------------

_VALUE = r"(?:-?\d+(?:\.\d+)?(?: s)?|`[^`]+`)"
_DEFAULT_PATTERNS = [  # each with the groups name and value
    re.compile(rf"`(?P<name>\w+)` \((?:default )?(?P<value>{_VALUE})(?: by default)?[),:;]"),
    re.compile(rf"`(?P<name>\w+)`,? defaults to (?P<value>{_VALUE})"),
    re.compile(r"`(?P<name>\w+)=(?P<value>[^`]+)`,? the default\b"),
]
_PAIR = re.compile(rf"`(?P<a>\w+)`, `(?P<b>\w+)`\]? \((?P<x>{_VALUE}) and (?P<y>{_VALUE}) by default\)")
_ENV_COMMENT = re.compile(r"\b(?P<env>SPOTGUARD_\w+)=\S+\s+# default (?P<value>\S+)")
_ENV_LIST = re.compile(r"\(`(?P<name>\w+)`, `\$(?P<env>SPOTGUARD_\w+)`, or (?P<value>`[^`]+`)\)")
_BETWEEN = re.compile(r"between (?P<low>\d+(?:\.\d+)?) s and (?P<high>\d+(?:\.\d+)?) s")


def prose_defaults() -> list[Said]:
    """Every default value the pages write next to an option's name (see the module's docstring)."""
    fields, envs = option_fields(), option_envs()
    said = []
    for path in PAGES:
        text, page = path.read_text(), page_name(path)
        for pattern in _DEFAULT_PATTERNS:
            for m in pattern.finditer(text):
                if m["name"] in fields:
                    said.append(Said(page, _line(text, m.start()), m["name"], m["value"]))
        for m in _PAIR.finditer(text):
            for name, value in ((m["a"], m["x"]), (m["b"], m["y"])):
                if name in fields:
                    said.append(Said(page, _line(text, m.start()), name, value))
        for m in _ENV_COMMENT.finditer(text):
            if m["env"] in envs:
                said.append(Said(page, _line(text, m.start()), envs[m["env"]], m["value"]))
        for m in _ENV_LIST.finditer(text):
            if m["name"] in fields and envs.get(m["env"]) == m["name"]:
                said.append(Said(page, _line(text, m.start()), m["name"], m["value"]))
        said += _table_defaults(text, page, fields)
    return said


def _table_defaults(text: str, page: str, fields: dict[str, Any]) -> Iterator[Said]:
    """Rows "| `name` | ... |" of tables whose header has a "default" column: that column."""
    column = None
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            column = None
        elif column is None:
            column = cells.index("default") if "default" in cells else -1
        elif column >= 0 and len(cells) > column and (m := re.fullmatch(r"`(\w+)`", cells[0])) and m[1] in fields:
            yield Said(page, number, m[1], cells[column])


def auto_bounds() -> list[Said]:
    """Every "between X s and Y s" in a paragraph that names an option's "auto" (value: (X, Y))."""
    envs = {env: name for env, name in option_envs().items()}
    said = []
    for path in PAGES:
        text, page = path.read_text(), page_name(path)
        for paragraph in re.finditer(r"(?:[^\n]+\n?)+", text):
            body = paragraph.group(0)
            named = set(re.findall(r'`(\w+)="auto"`', body))
            named |= {envs[env] for env in re.findall(r"\b(SPOTGUARD_\w+)=auto\b", body) if env in envs}
            for m in _BETWEEN.finditer(body):
                for name in sorted(named):
                    at = _line(text, paragraph.start() + m.start())
                    said.append(Said(page, at, name, (float(m["low"]), float(m["high"]))))
    return said


def guard_calls() -> list[Said]:
    """Every call the pages make to Guard, an options group or a spotguard function that passes its
    options on to Guard (name: the callee's, value: (callee, keyword names))."""
    import spotguard.guard
    import spotguard.options

    named = {"Guard": spotguard.guard.Guard}
    named |= {n: getattr(spotguard.options, n) for n in dir(spotguard.options) if n.endswith("Options")}
    said = []
    for path in PAGES:
        text, page = path.read_text(), page_name(path)
        in_python = [(m.start(1), m.group(1)) for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]
        for start, block in in_python:
            if block.lstrip().startswith("--8<--"):
                continue  # a file included as it is (examples/ run in their own tests)
            for line, callee, keywords in _python_calls(block, named):
                said.append(Said(page, _line(text, start) + line - 1, callee.__name__, (callee, keywords)))
        blanked = text
        for start, block in in_python:  # the other code: inline spans and other fenced blocks
            blanked = blanked[:start] + re.sub(r"[^\n]", " ", block) + blanked[start + len(block) :]
        for m in re.finditer(rf"\b({'|'.join(named)})\(", blanked):
            keywords = _top_level_keywords(blanked, m.end())
            said.append(Said(page, _line(text, m.start()), m[1], (named[m[1]], keywords)))
    return said


def _python_calls(block: str, named: dict[str, Any]) -> Iterator[tuple[int, Any, set[str]]]:
    imported: dict[str, str] = {}  # local name -> module.attribute
    tree = ast.parse(block)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "spotguard":
            imported |= {(a.asname or a.name): f"{node.module}.{a.name}" for a in node.names}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        callee: Callable[..., Any] | None = None
        if isinstance(func, ast.Name) and func.id in imported:
            module, _, attr = imported[func.id].rpartition(".")
            callee = getattr(importlib.import_module(module), attr)
        elif name in named:
            callee = named[name]
        if callee is not None and keywords_of(callee) is not None:
            yield node.lineno, callee, {k.arg for k in node.keywords if k.arg is not None}


def _top_level_keywords(text: str, start: int) -> set[str]:
    """The `name=` at depth one of the call whose arguments begin at `start` (up to its closing paren)."""
    depth, found, i = 1, set(), start
    while i < len(text) and depth:
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
        elif depth == 1 and (m := re.match(r"(\w+)\s*=(?!=)", text[i:])) and not re.match(r"\w", text[i - 1]):
            found.add(m[1])
            i += m.end()
            continue
        i += 1
    return found
