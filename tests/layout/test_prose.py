"""Prose that cannot rot: what the docs, comments and docstrings point at exists in the repository.

Four checks, pure text scanning of the tracked files (no imports of the product, no network):

(a) a relative markdown link (``[text](target)`` in a ``.md`` file) whose target file, or whose
    ``#anchor`` (a heading's GitHub slug), does not exist;
(b) a ``*.md`` file named in prose (docs, code comments, docstrings and other string literals,
    Makefile and CI scripts) that the repository does not have; a bare name must be some file's
    name, a path must resolve from the repository root or from the naming file's folder;
(c) a module path named in prose (docs, comments, docstrings) that does not exist: a path under a
    project folder (``addon/foo.py``, ``harness_recipes/x/``, ``tests/vllm/test_capture_*.py``), a
    bare module name whose module became a package (``swebench.py`` for ``tasks/swebench/``), or a
    dotted name under a project package (``polar_recon.link``,
    ``polar_contracts.shards.SHARD_SCHEMA``: the modules must exist, and the first name after the
    last module must appear in that module's source). ``tests/`` and ``data/`` paths are checked
    when their first folder exists (``tests/test_x.py`` is as often a path in a task's repository);
    ``trainer.`` and ``tests.`` dotted names (also everyday variable names: ``trainer.state``) when
    their first part is a module of the package or they follow ``import`` / ``from`` / ``-m``;
(d) an "issue N" / "issue #N" reference: the repository has no issue tracker to resolve it.

URLs are left out of every check (an upstream issue or file is cited by its URL). Third-party
files kept verbatim (licenses, the SWE-bench harness's generated eval script, pip requirement
pins) are not prose of this project and are not scanned.
"""
from __future__ import annotations

import ast
import fnmatch
import functools
import io
import re
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

REPO = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

# Importable package name -> its folder (polar_data is installed from data/).
PACKAGES = {"polar_data": "data", "polar_contracts": "polar_contracts", "addon": "addon", "polar_recon": "polar_recon",
            "polar_serve": "polar_serve", "trainer": "trainer", "harness_recipes": "harness_recipes",
            "tests": "tests"}

# Copied verbatim from elsewhere: their words are not this project's prose.
NOT_PROSE = re.compile(r"(^|/)(LICENSE[^/]*|[^/]*\.LICENSE|[^/]*COPYING[^/]*)$"
                       r"|^data/swebench-verified/repos/|^tests/rollout/data/|\.constraints\.txt$")


@dataclass(frozen=True)
class Hit:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


# ---- the tree -------------------------------------------------------------------------------------

def repo_files(root: Path = REPO) -> frozenset[str]:
    """Tracked files plus new ones git does not ignore (so a file added but not yet committed counts)."""
    if not (root / ".git").exists():
        pytest.skip(f"{root} is not a git checkout: the prose checks read the file list from git")
    out = subprocess.run(["git", "-C", str(root), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         capture_output=True, text=True, check=True).stdout
    return frozenset(p for p in out.split("\0") if p and (root / p).is_file())


@functools.lru_cache(maxsize=8)
def directories(files: frozenset[str]) -> set[str]:
    return {str(parent) for f in files for parent in PurePosixPath(f).parents if str(parent) != "."}


def prose_files(files: frozenset[str]) -> list[str]:
    """The files whose words are this project's: docs, Python, config, Makefile, CI scripts."""
    keep = []
    for f in sorted(files):
        p = PurePosixPath(f)
        if NOT_PROSE.search(f):
            continue
        if p.suffix in (".md", ".py", ".toml", ".cfg", ".sh") or f in ("Makefile",) or f.startswith(".ci/") \
                or (p.suffix == ".txt" and len(p.parts) == 1):
            keep.append(f)
    return keep


# ---- text extraction --------------------------------------------------------------------------------

URL = re.compile(r"\b(?:https?|file|s3)://[^\s)>\]`'\"]+")


def _blank(text: str, pattern: re.Pattern) -> str:
    """Replace each match by spaces (newlines kept), so offsets and line numbers stay right."""
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def python_prose(source: str, strings: str = "all") -> str:
    """The comments and string literals (``strings="all"``) or only the comments and docstrings
    (``strings="docstrings"``) of a Python file, in place (everything else blanked)."""
    return python_proses(source)[strings]


def python_proses(source: str) -> dict[str, str]:
    """Both readings of python_prose, from one pass over the tokens."""
    lines = source.splitlines(keepends=True)
    blank = [re.sub(r"[^\n]", " ", line) for line in lines]
    out = {"all": list(blank), "docstrings": list(blank)}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        docstrings = _docstring_starts(ast.parse(source))
    except (tokenize.TokenError, SyntaxError):
        return {"all": source, "docstrings": source}  # not parseable as Python: scan it whole
    string_types = (tokenize.STRING, getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_MIDDLE", -1),
                    getattr(tokenize, "FSTRING_END", -1))
    for tok in tokens:
        if tok.type == tokenize.COMMENT or tok.start in docstrings:
            kinds = ("all", "docstrings")
        elif tok.type in string_types:
            kinds = ("all",)
        else:
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            line = lines[r - 1]
            a = c0 if r == r0 else 0
            b = c1 if r == r1 else len(line.rstrip("\n"))
            for k in kinds:
                out[k][r - 1] = out[k][r - 1][:a] + line[a:b] + out[k][r - 1][b:]
    return {k: "".join(v) for k, v in out.items()}


def _docstring_starts(node: ast.AST) -> set[tuple[int, int]]:
    """(line, column) where each module, class and function docstring starts (statements only are
    walked: a docstring is a body's first statement)."""
    starts = set()
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef |
                                                      ast.AsyncFunctionDef):
        first = body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            starts.add((first.lineno, first.col_offset))
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, None) or ():
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case):
                starts |= _docstring_starts(child)
    return starts


FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)


def prose_of(path: str, text: str) -> dict[str, str]:
    """What the checks read in one file, no URLs: Python's comments and strings ("all") or comments
    and docstrings ("docstrings"); other files whole under both keys."""
    if not path.endswith(".py"):
        text = _blank(text, URL)
        return {"all": text, "docstrings": text}
    return {k: _blank(v, URL) for k, v in python_proses(text).items()}


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# ---- (a) markdown links ---------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ dropped,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(_blank(markdown, FENCE)):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def link_hits(path: str, text: str, files: frozenset[str], read=lambda p: (REPO / p).read_text()) -> list[Hit]:
    """Relative links of one markdown file whose file or heading anchor does not exist."""
    dirs = directories(files)
    here = PurePosixPath(path).parent
    body = _blank(_blank(text, FENCE), CODE_SPAN)
    hits = []
    for m in LINK.finditer(body):
        target = m.group(1)
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        if file_part:
            resolved = _normalise(here / file_part)
            if resolved is None or (resolved not in files and resolved not in dirs):
                hits.append(Hit(path, line_of(body, m.start()), f"link to {target}: no file {resolved or file_part}"))
                continue
        else:
            resolved = path
        if anchor and resolved.endswith(".md") and resolved in files:
            if anchor not in anchors(text if resolved == path else read(resolved)):
                hits.append(Hit(path, line_of(body, m.start()), f"link to {target}: {resolved} has no heading #{anchor}"))
    return hits


def _normalise(p: PurePosixPath) -> str | None:
    """a/b/../c -> a/c; None when it climbs out of the repository."""
    parts: list[str] = []
    for part in p.parts:
        if part == "..":
            if not parts:
                return None
            parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/".join(parts)


# ---- (b) named files ------------------------------------------------------------------------------

NAMED_FILE = re.compile(r"(?<![\w./{}$*<-])((?:\.{1,2}/)*[\w-]+(?:[./][\w-]+)*\.md)\b(?![\w/-])")


def named_file_hits(path: str, prose: str, files: frozenset[str]) -> list[Hit]:
    """*.md names in prose that no file of the repository has."""
    names = _names(files)
    here = PurePosixPath(path).parent
    hits = []
    for m in NAMED_FILE.finditer(prose):
        ref = m.group(1)
        if "/" in ref:
            ok = ref.lstrip("./") in files or _normalise(here / ref) in files
        else:
            ok = ref in names
        if not ok:
            hits.append(Hit(path, line_of(prose, m.start()), f"names {ref}, which the repository does not have"))
    return hits


@functools.lru_cache(maxsize=8)
def _names(files: frozenset[str]) -> set[str]:
    return {PurePosixPath(f).name for f in files}


# ---- (c) module paths -----------------------------------------------------------------------------

# Folders whose paths are checked from the first part on; tests/ and data/ from their second.
CHECKED_ROOTS = ("addon", "polar_contracts", "polar_recon", "polar_serve", "trainer", "harness_recipes", "bench",
                 "docs", ".ci")
SECOND_PART_ROOTS = ("tests", "data")
_ROOTS = "|".join(re.escape(r) for r in CHECKED_ROOTS + SECOND_PART_ROOTS)
SLASH_PATH = re.compile(r"(?<![\w./@:~$-])((?:" + _ROOTS + r")/[\w./*{}<>-]*[\w/*}>])")
_HEADS = "|".join(sorted(PACKAGES, key=len, reverse=True))
DOTTED = re.compile(r"(?<![\w./@:-])((?:" + _HEADS + r")(?:\.[A-Za-z_]\w*)+)")
BARE_PY = re.compile(r"(?<![\w./-])([A-Za-z_]\w*)\.py\b")
AMBIGUOUS = ("trainer", "tests")  # also everyday variable names
IMPORT_BEFORE = re.compile(r"(?:\bimport|\bfrom|-m)\s+$")


def module_path_hits(path: str, prose: str, files: frozenset[str], read=lambda p: (REPO / p).read_text()) -> list[Hit]:
    """Folder paths (addon/x.py, harness_recipes/fleet/) and dotted names (polar_recon.link) that do
    not exist."""
    dirs = directories(files)
    hits = []
    for m in SLASH_PATH.finditer(prose):
        ref = m.group(1).rstrip("/.")
        parts = ref.split("/")
        if parts[0] in SECOND_PART_ROOTS and (len(parts) < 2 or "/".join(parts[:2]) not in dirs):
            continue
        if "<" in ref or "{" in ref:  # a placeholder: shard-<n>.parquet, {name}.toml
            continue
        if "*" in ref:
            if any(fnmatch.fnmatchcase(f, ref) for f in files):
                continue
        elif ref in files or ref in dirs:
            continue
        hits.append(Hit(path, line_of(prose, m.start()), f"names {ref}, which does not exist"))
    # A bare module file name whose module became a package (swebench.py -> tasks/swebench/): the
    # other bare names are as often an upstream project's files (vLLM's sampler.py).
    packages = _package_folders(files)
    names = _names(files)
    for m in BARE_PY.finditer(prose):
        if f"{m.group(1)}.py" not in names and m.group(1) in packages:
            hits.append(Hit(path, line_of(prose, m.start()), f"names {m.group(1)}.py, which is now the package "
                                                               f"{packages[m.group(1)]}/"))
    for m in DOTTED.finditer(prose):
        ref = m.group(1)
        if prose[m.end():m.end() + 1] in ("-", "/"):  # tests.fixtures.harness-requests: a file name
            continue
        head, second = ref.split(".")[:2]
        if head in AMBIGUOUS and not IMPORT_BEFORE.search(prose[max(0, m.start() - 10):m.start()]) \
                and _dotted_missing(f"{head}.{second}", files, dirs, read, modules_only=True):
            continue
        why = _dotted_missing(ref, files, dirs, read)
        if why:
            hits.append(Hit(path, line_of(prose, m.start()), f"names {ref}: {why}"))
    return hits


@functools.lru_cache(maxsize=8)
def _package_folders(files: frozenset[str]) -> dict[str, str]:
    """folder name -> its path, for the Python packages inside the project's packages."""
    roots = tuple(f"{d}/" for d in PACKAGES.values())
    return {PurePosixPath(f).parent.name: str(PurePosixPath(f).parent) for f in files
            if f.endswith("/__init__.py") and f.startswith(roots) and f.count("/") > 1}


def _dotted_missing(ref: str, files: frozenset[str], dirs: set[str], read, modules_only: bool = False) -> str | None:
    """Why the dotted name does not resolve, else None. Modules must exist; the first name after
    the last module must appear in that module's source (a definition or an import)."""
    head, *rest = ref.split(".")
    if rest and rest[-1] in ("py", "md", "json", "jsonl", "toml", "txt", "log", "arrow", "parquet"):
        return None  # a file name (addon.log, trainer.json), not a module path
    folder = PACKAGES[head]
    if folder not in dirs:
        return f"no package folder {folder}/"
    current = f"{folder}/__init__.py"
    for i, part in enumerate(rest):
        if current.endswith("__init__.py"):
            pkg = current.rsplit("/", 1)[0]
            if f"{pkg}/{part}.py" in files:
                current = f"{pkg}/{part}.py"
                continue
            if f"{pkg}/{part}/__init__.py" in files or f"{pkg}/{part}" in dirs:
                current = f"{pkg}/{part}/__init__.py"
                continue
        source = "" if modules_only or current not in files else read(current)
        if re.search(rf"\b{re.escape(part)}\b", source):
            return None
        mod = ".".join([head, *rest[:i]])
        return f"{mod} has no module or name {part}"
    return None


# ---- (d) issue references -------------------------------------------------------------------------

ISSUE = re.compile(r"\bissues?\s+#?\d+|\bissue\s+#\d+", re.I)


def issue_hits(path: str, prose: str) -> list[Hit]:
    return [Hit(path, line_of(prose, m.start()), f"'{m.group(0)}' points at a tracker the repository does not have")
            for m in ISSUE.finditer(prose)]


# ---- the whole tree -------------------------------------------------------------------------------

def scan(root: Path = REPO) -> dict[str, list[Hit]]:
    files = repo_files(root)

    @functools.cache
    def read(p):
        return (root / p).read_text(errors="replace")

    def check(f: str, text: str, prose: dict[str, str]) -> dict[str, list[Hit]]:
        return {"links": link_hits(f, text, files, read) if f.endswith(".md") else [],
                "named files": named_file_hits(f, prose["all"], files),
                "module paths": module_path_hits(f, prose["docstrings"], files, read),
                "issues": issue_hits(f, prose["all"])}

    found: dict[str, list[Hit]] = {"links": [], "named files": [], "module paths": [], "issues": []}
    for f in prose_files(files):
        if f == SELF:  # its planted bad examples are the point
            continue
        text = read(f)
        raw = _blank(text, URL)
        hits = check(f, text, {"all": raw, "docstrings": raw})
        # Tokenizing Python is the slow part: only a file whose raw text has a hit can have one in its
        # comments and strings (they are the raw text with the code blanked).
        if f.endswith(".py") and any(hits.values()):
            hits = check(f, text, prose_of(f, text))
        for k, v in hits.items():
            found[k] += v
    return found


@pytest.fixture(scope="module")
def tree_hits() -> dict[str, list[Hit]]:
    return scan()


@pytest.mark.parametrize("check", ["links", "named files", "module paths", "issues"])
def test_the_tree_has_no_rotten_prose(tree_hits, check):
    hits = tree_hits[check]
    assert not hits, f"{len(hits)} {check} that point nowhere:\n" + "\n".join(map(str, hits))


# ---- each check fails on a planted bad example ----------------------------------------------------

FILES = frozenset({"README.md", "trainer/__init__.py", "docs/guide.md", "docs/benchmarks/proxy.md", "addon/__init__.py",
                   "addon/stream.py",
         "polar_recon/__init__.py", "polar_recon/link.py", "harness_recipes/fleet/driver.py",
         "harness_recipes/__init__.py", "harness_recipes/fleet/__init__.py", "docs/pic.png"})
SOURCES = {"docs/guide.md": "# Guide\n\n## Planning: `polar-rollout swebench plan FILE`\n\n## Twice\n\n## Twice\n",
           "polar_recon/__init__.py": "from polar_contracts.log.reader import read_log\n",
           "polar_recon/link.py": "def link_calls():\n    pass\n",
           "addon/__init__.py": "", "trainer/__init__.py": "", "harness_recipes/__init__.py": "",
           "harness_recipes/fleet/__init__.py": ""}


def _read(p):
    return SOURCES[p]


def test_slugs_follow_github():
    assert slug("Planning: `polar-rollout swebench plan FILE`") == "planning-polar-rollout-swebench-plan-file"
    assert slug("Installing, make targets, tests") == "installing-make-targets-tests"
    assert slug("Against the real vLLM 0.32") == "against-the-real-vllm-032"
    assert anchors("# A\n```\n# not a heading\n```\n## Twice\n## Twice\n") == {"a", "twice", "twice-1"}


def test_a_link_to_a_missing_file_or_heading_is_found():
    text = ("[ok](docs/guide.md#planning-polar-rollout-swebench-plan-file) [dir](addon/) [img](docs/pic.png)\n"
            "[second](docs/guide.md#twice-1) [web](https://example.com/x.md) [self](#top)\n"
            "[gone](docs/isolation.md)\n"
            "[bad anchor](docs/guide.md#planning)\n"
            "`[in code](nowhere.md)`\n"
            "```\n[fenced](nowhere.md)\n```\n"
            "# Top\n")
    hits = link_hits("README.md", text, FILES, _read)
    assert [(h.line, h.what.split(":")[0]) for h in hits] == [(3, "link to docs/isolation.md"),
                                                               (4, "link to docs/guide.md#planning")]
    # relative to the linking file, and not out of the repository
    assert link_hits("docs/benchmarks/proxy.md", "[up](../guide.md) [out](../../../x.md)", FILES, _read) == [
        Hit("docs/benchmarks/proxy.md", 1, "link to ../../../x.md: no file ../../../x.md")]


def test_a_named_file_the_repository_lacks_is_found():
    prose = ("see guide.md and docs/guide.md\n"
             "facts from wire-formats.md and shared/docs/harnesses.md\n"
             "{name}.md is a pattern, docs/*.md a glob\n")
    hits = named_file_hits("addon/x.py", prose, FILES)
    assert [(h.line, h.what.split(",")[0]) for h in hits] == [
        (2, "names wire-formats.md"), (2, "names shared/docs/harnesses.md")]
    assert named_file_hits("docs/benchmarks/proxy.md", "(../guide.md)", FILES) == []


def test_a_module_path_that_does_not_exist_is_found():
    prose = ("addon/stream.py and harness_recipes/fleet/ and polar_recon.link.link_calls, polar_recon.read_log\n"
             "addon/foo.py, polar_recon/bar.py, harness_recipes/x/y.py\n"
             "polar_recon.linker and polar_recon.link.nothing_here, addon.log is a file, trl/addon/z.py\n"
             "addon/*.py addon/st*.py addon/zz*.py addon/<name>.py tests/test_x.py (a task's) tests/addon/gone.py\n"
             "trainer.state.log_history, python -m trainer.gone, tests.fixtures.harness-requests\n"
             "fleet.py was a module, driver.py is one, vLLM's sampler.py is upstream\n")
    hits = module_path_hits("docs/guide.md", prose, FILES | {"tests/addon/test_a.py"}, _read)
    assert [(h.line, h.what) for h in hits] == [
        (2, "names addon/foo.py, which does not exist"),
        (2, "names polar_recon/bar.py, which does not exist"),
        (2, "names harness_recipes/x/y.py, which does not exist"),
        (4, "names addon/zz*.py, which does not exist"),
        (4, "names tests/addon/gone.py, which does not exist"),
        (6, "names fleet.py, which is now the package harness_recipes/fleet/"),
        (3, "names polar_recon.linker: polar_recon has no module or name linker"),
        (3, "names polar_recon.link.nothing_here: polar_recon.link has no module or name nothing_here"),
        (5, "names trainer.gone: trainer has no module or name gone"),
    ]


def test_an_issue_reference_is_found():
    prose = "as issue 25 says; Issue #16's rules; issues 3 and 4; see the tissue 5; https://x/issues/9\n"
    hits = issue_hits("a.py", _blank(prose, URL))
    assert [h.what.split("'")[1] for h in hits] == ["issue 25", "Issue #16", "issues 3"]


def test_python_prose_is_comments_and_strings_only():
    src = '"""doc: issue 5"""\nimport swebench_py as x  # see old.md\ny = x.translate.py\nz = "help: a.md"\n'
    prose = python_prose(src)
    assert "old.md" in prose and "issue 5" in prose and "a.md" in prose and "translate" not in prose
    assert prose.count("\n") == src.count("\n")
    docs = python_prose(src, "docstrings")
    assert "issue 5" in docs and "old.md" in docs and "a.md" not in docs
