"""MkDocs hook: the configuration reference's tables, generated from `spotguard.options` at build
time (the `<!-- guard-options -->` marker), so the page cannot drift from the code."""

from __future__ import annotations

from typing import Any

MARKER = "<!-- guard-options -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from spotguard.options import describe

    parts = []
    for group, title, rows in describe():
        parts.append(f"### `{group}=`: {title}\n")
        parts.append("| keyword | default | meaning |\n|---|---|---|")
        parts += [f"| `{name}` | {default} | {doc} |" for name, default, doc in rows]
        parts.append("")
    return markdown.replace(MARKER, "\n".join(parts))
