"""The command blocks of the project's Markdown, and what each is marked as.

A command block is a fenced block whose info string is ``bash``, ``sh``, ``shell`` or ``console``.
The line before its opening fence (blank lines between are allowed) is its marker, one of

    <!-- run: tests/docs/test_quickstarts.py -->     run verbatim by that test
    <!-- not-run: REASON -->                         not run by any test, and why

(HTML comments: invisible on the rendered page). ``tests/docs/test_markers.py`` requires one on
every command block of README.md, docs/ and the folder READMEs; ``test_quickstarts.py`` runs the
blocks marked for it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMAND_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^<!--\s*(run|not-run):\s*(.*?)\s*-->\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    section: str  # the nearest heading above it
    marker: tuple[str, str] | None  # ("run", test file) | ("not-run", reason) | None

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def blocks(text: str, path: str = "<text>") -> list[Block]:
    """Every fenced block of ``text`` (a Markdown file), in order."""
    out: list[Block] = []
    lines = text.splitlines()
    section, i = "", 0
    while i < len(lines):
        h = HEADING.match(lines[i])
        if h:
            section = h.group(2)
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[0] * len(fence)):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k].strip()) if k >= 0 else None
        out.append(Block(path, start + 1, lang.lower(), "\n".join(body) + "\n", section,
                         (mk.group(1), mk.group(2)) if mk else None))
    return out


def doc_files() -> list[Path]:
    """README.md, every page under docs/, and the folder READMEs: the project's documentation."""
    return sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *REPO.glob("*/README.md")])


def command_blocks(path: Path) -> list[Block]:
    rel = path.relative_to(REPO).as_posix()
    return [b for b in blocks(path.read_text(encoding="utf-8"), rel) if b.lang in COMMAND_LANGS]


def marked_for(test_file: str, path: str, section: str | None = None) -> list[Block]:
    """The command blocks of ``path`` (relative) marked ``run: test_file``, in order; only those
    under the heading ``section`` when given."""
    return [b for b in command_blocks(REPO / path)
            if b.marker == ("run", test_file) and (section is None or b.section == section)]
