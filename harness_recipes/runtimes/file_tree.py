"""A workspace's file tree read by the node, never through the agent's git: into a private git object store.

The agent controls everything in its workspace, its `.git` included: hooks, `core.fsmonitor`,
`diff.external`, attributes, `info/exclude`, the index. So the node does not ask that git what
changed. It reads the files themselves (a directory on the host, or the tar stream of docker's
`get_archive`), hashes each one into a git object store of its own (a bare repository in a
temporary directory, objects written by this module), builds a tree from them and diffs two trees
(store.diff) with a git that reads no configuration but the command line's: no hooks, no
fsmonitor, no external diff or textconv, no attributes (a bare store without a HEAD has none).

What a tree holds: regular files (mode 100644, or 100755 when the owner may execute) and symlinks
whose target stays inside the tree (120000). Left out, and recorded in `dropped` with the reason:
symlinks that resolve outside (absolute, climbing out with .., or through another link of the tree:
`a/b -> ..` then `esc -> a/b/..`; loops), anything else (fifos, sockets, devices: never opened, their
nominal size never read), sparse files (holes: their nominal size is not what they cost the agent,
and reading it would cost the node; in a tar stream, which has no holes, a large all-zero file),
files over the budget's per-file bound, and paths git refuses (`git update-index` skips them with
"Ignoring path": `.GIT`, `git~1`, a `.gitmodules` symlink, ...). Left
out silently: every `.git` path component (git cannot track those), and empty directories.

Reading is bounded (Budget, carried by the ObjectStore): the files and bytes of a tree, the patch's
changed files and bytes (node/model_patch.py), and a deadline around snapshot and diff (each git
command gets what is left of it). Crossing one raises OverBudget: the agent's doing, a graded 0
with that reason (node/grading.py).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import subprocess
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILE_BYTES = 64 << 20
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
# Settings on every command line: whatever git config could still be found, these win.
GIT_OPTS = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "diff.external=",
            "-c", "core.attributesFile=/dev/null", "-c", "core.quotePath=true", "-c", "diff.noprefix=false")


class TreeError(RuntimeError):
    pass


class OverBudget(TreeError):
    """A tree or patch crossed a bound of its Budget: the agent's doing (a graded 0 with this reason)."""


@dataclass(frozen=True)
class Budget:
    """The bounds on grading one episode's tree. Defaults fit any SWE-bench repository with room to spare
    (the largest working trees hold about 10k files, 100 MB) and any patch a task asks for; a tree
    of a million empty files or gigabytes of zeros stops at the bound instead of stalling the node."""

    max_file_bytes: int = MAX_FILE_BYTES  # one file over it is dropped (recorded), not an error
    max_tree_files: int = 200_000  # files, links and directories in one tree
    max_tree_bytes: int = 2 << 30  # bytes read for one tree (nominal sizes, counted before reading)
    max_patch_files: int = 2_000  # changed paths kept in the model patch
    max_patch_bytes: int = 16 << 20  # the model patch's size
    seconds: float = 300.0  # reading the agent's tree; then reading the pristine tree and the diff

    def __post_init__(self):
        for name in ("max_file_bytes", "max_tree_files", "max_tree_bytes", "max_patch_files", "max_patch_bytes",
                     "seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"grading budget: {name} must be positive, got {getattr(self, name)!r}")


class _Tally:
    """What reading one tree has cost so far, against the store's budget and deadline."""

    def __init__(self, store: ObjectStore):
        self.budget, self.store = store.budget, store
        self.files = 0
        self.bytes = 0

    def add(self, rel: str, size: int) -> None:
        """Count one entry of ``size`` bytes before it is read; over a bound: OverBudget."""
        self.files += 1
        self.add_bytes(rel, size)

    def add_bytes(self, rel: str, size: int) -> None:
        self.bytes += size
        b = self.budget
        if self.files > b.max_tree_files:
            raise OverBudget(f"the tree holds more than {b.max_tree_files} entries (max_tree_files), at {rel}")
        if self.bytes > b.max_tree_bytes:
            raise OverBudget(f"the tree holds more than {b.max_tree_bytes} bytes (max_tree_bytes), at {rel}")
        self.store.check_time(f"reading the tree, at {rel}")


@dataclass
class Snapshot:
    """One file tree: path -> (mode, blob id), and what was left out of it (path, why)."""
    entries: dict[str, tuple[str, str]] = field(default_factory=dict)
    dropped: list[tuple[str, str]] = field(default_factory=list)


class ObjectStore:
    """A bare git repository only the node writes: blobs, trees, diffs, under a git that reads no config."""

    def __init__(self, path: Path, budget: Budget | None = None):
        self.path = Path(path)
        self.budget = budget or Budget()
        # The deadline of reading and diffing (restart_clock: grading restarts it for the pristine tree + diff).
        self.deadline = time.monotonic() + self.budget.seconds
        self._home = Path(tempfile.mkdtemp(prefix="polar-git-home-", dir=self.path.parent))
        self.git(["init", "-q", "--bare", str(self.path)], bare_dir=False)

    def env(self) -> dict[str, str]:
        # No system or global config, an empty HOME (no ~/.gitconfig, no XDG config), no attributes.
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self._home), "LANG": "C",
                "XDG_CONFIG_HOME": str(self._home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "GIT_DIR": str(self.path)}

    def restart_clock(self) -> None:
        """A fresh deadline (budget.seconds from now): each grading phase gets the whole bound."""
        self.deadline = time.monotonic() + self.budget.seconds

    def check_time(self, what: str) -> float:
        """Seconds left before the deadline; past it: OverBudget naming what was being done."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise OverBudget(f"grading's snapshot and diff took over {self.budget.seconds:g} s (seconds), {what}")
        return left

    def git(self, args: list[str], stdin: bytes = b"", env: dict | None = None, bare_dir: bool = True,
            stderr: bool = False) -> bytes:
        """git's stdout (its stderr with ``stderr``); a failure raises TreeError, the deadline OverBudget."""
        e = {**self.env(), **(env or {})}
        if not bare_dir:
            e.pop("GIT_DIR")
        left = self.check_time(f"before git {args[0]}")
        try:
            proc = subprocess.run(["git", *GIT_OPTS, *args], input=stdin, env=e, capture_output=True, cwd=self._home,
                                  timeout=left)
        except subprocess.TimeoutExpired:
            raise OverBudget(f"git {args[0]} ran past grading's {self.budget.seconds:g} s (seconds)") from None
        if proc.returncode != 0:
            raise TreeError(f"git {' '.join(args[:3])} failed: {proc.stderr.decode(errors='replace')[-400:]}")
        return proc.stderr if stderr else proc.stdout

    def blob(self, data: bytes) -> str:
        """Write one blob (a loose object, as git writes them) and return its id."""
        raw = b"blob %d\0" % len(data) + data
        oid = hashlib.sha1(raw).hexdigest()
        obj = self.path / "objects" / oid[:2] / oid[2:]
        if not obj.exists():
            obj.parent.mkdir(exist_ok=True)
            tmp = obj.with_name(f".tmp-{os.getpid()}-{oid[2:]}")
            tmp.write_bytes(zlib.compress(raw, 1))
            tmp.replace(obj)
        return oid

    def tree(self, entries: dict[str, tuple[str, str]]) -> str:
        """A git tree of these entries (path -> (mode, blob id)); the id of the empty tree for none.
        Snapshots have dropped the paths git refuses (refused_path, ObjectStore.drop_refused)."""
        if not entries:
            return EMPTY_TREE
        with tempfile.TemporaryDirectory(dir=self.path.parent) as d:
            env = {"GIT_INDEX_FILE": str(Path(d) / "index")}
            lines = b"".join(f"{mode} {oid}\t".encode() + os.fsencode(p) + b"\0" for p, (mode, oid) in entries.items())
            self.git(["update-index", "--add", "-z", "--index-info"], stdin=lines, env=env)
            return self.git(["write-tree"], env=env).decode().strip()

    def drop_refused(self, snap: Snapshot) -> None:
        """Drop, in git's own words, each path git still refuses past refused_path's rules (a newer git's
        rule). `update-index --index-info` skips such a path with "Ignoring path P" on stderr rather than
        failing: without this the path would vanish from the tree unrecorded."""
        if not snap.entries:
            return
        with tempfile.TemporaryDirectory(dir=self.path.parent) as d:
            env = {"GIT_INDEX_FILE": str(Path(d) / "index")}
            lines = b"".join(f"{mode} {oid}\t".encode() + os.fsencode(p) + b"\0" for p, (mode, oid) in snap.entries.items())
            err = self.git(["update-index", "--add", "-z", "--index-info"], stdin=lines, env=env, stderr=True)
        for line in err.decode(errors="surrogateescape").splitlines():
            if line.startswith("Ignoring path ") and (p := line[len("Ignoring path "):]) in snap.entries:
                del snap.entries[p]
                snap.dropped.append((p, "a path git refuses (git update-index: Ignoring path)"))

    def diff(self, a: str, b: str) -> bytes:
        """The patch from tree a to tree b: binary files as git binary patches, new and deleted files, modes."""
        return self.git(["diff-tree", "-r", "-p", "--binary", "--full-index", "--no-renames", "--no-ext-diff",
                         "--no-textconv", "--no-color", a, b])


MAX_LINK_HOPS = 40  # as the kernel's ELOOP bound


def _git_path(rel: str) -> bool:
    return ".git" in rel.split("/")


def _dot_git_like(name: str) -> bool:
    """A name git treats as `.git` on a case-insensitive, NTFS or HFS+ checkout (core.protectNTFS and
    core.protectHFS: refused everywhere by default): `.GIT`, `.git.`, `.git ` , `git~1`, and `.git`
    with HFS+'s ignorable code points in it."""
    folded = "".join(c for c in name if c not in _HFS_IGNORABLE).lower()
    return folded.rstrip(". ") == ".git" or folded == "git~1"


_HFS_IGNORABLE = {chr(c) for c in (0x200C, 0x200D, 0x200E, 0x200F, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E,
                                   0x206A, 0x206B, 0x206C, 0x206D, 0x206E, 0x206F, 0xFEFF)}
_NO_LINK = {".gitmodules"}  # git 2.39; later gits may refuse more (drop_refused asks git itself)


def refused_path(rel: str, link: bool = False) -> str:
    """Why git would refuse ``rel`` as a path of its tree ('' when it takes it): empty, `.` or `..`
    components, `.git` by any spelling, a symlink named
    `.gitmodules` (and the other files git reads from the tree)."""
    parts = rel.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            return "an empty, . or .. path component"
        if _dot_git_like(part):
            return f"{part!r} is .git to a case-insensitive, NTFS or HFS+ checkout"
    if link and parts[-1].lower().rstrip(". ") in _NO_LINK:
        return f"a symlink named {parts[-1]!r} (git reads it from the tree)"
    return ""


def link_escapes(rel: str, target: str) -> bool:
    """Does a symlink at rel (relative to the tree's root) point outside the tree, on its own (lexically)?
    resolve_links also follows the tree's other links."""
    if target.startswith("/") or not target:
        return True
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return resolved == ".." or resolved.startswith("../")


def link_resolution(rel: str, links: dict[str, str]) -> str:
    """Where the link at ``rel`` leads, following every link of the tree (``links``: path -> target) as
    the kernel would: '' when it stays inside the tree, else why not (outside, loop)."""
    stack = rel.split("/")[:-1]  # the link's directory
    todo = [c for c in links[rel].split("/")][::-1]
    if links[rel].startswith("/") or not links[rel]:
        return f"pointing outside the repository (-> {links[rel]})"
    hops, via = 0, ""
    while todo:
        c = todo.pop()
        if c in ("", "."):
            continue
        if c == "..":
            if not stack:
                return f"resolving outside the repository (-> {links[rel]}" + (f", through {via})" if via else ")")
            stack.pop()
            continue
        stack.append(c)
        here = "/".join(stack)
        if here in links:
            hops += 1
            if hops > MAX_LINK_HOPS:
                return f"a symlink loop (-> {links[rel]})"
            via = f"{here} -> {links[here]}"
            target = links[here]
            if target.startswith("/") or not target:
                return f"resolving outside the repository (-> {links[rel]}, through {here} -> {target})"
            stack.pop()
            todo.extend(target.split("/")[::-1])
    return ""


def resolve_links(snap: Snapshot, links: dict[str, str]) -> None:
    """Drop each link that resolves outside the tree, chains through the tree's links included (a link
    judged lexically on its own, `esc -> a/b/..`, is inside; with `a/b -> ..` it leads to the parent)."""
    for rel in sorted(links):
        why = link_resolution(rel, links)
        if why:
            snap.entries.pop(rel, None)
            snap.dropped.append((rel, f"symlink {why}"))


def _add_link(snap: Snapshot, store: ObjectStore, tally: _Tally, links: dict[str, str], rel: str, target: str) -> None:
    if why := refused_path(rel, link=True):
        snap.dropped.append((rel, f"a path git refuses: {why}"))
        return
    tally.add(rel, len(target))
    links[rel] = target
    snap.entries[rel] = ("120000", store.blob(os.fsencode(target)))


def _add_file(snap: Snapshot, store: ObjectStore, rel: str, mode: int, size: int, read) -> None:
    """Add one regular file (already counted by the caller's tally), or drop it saying why."""
    if why := refused_path(rel):
        snap.dropped.append((rel, f"a path git refuses: {why}"))
        return
    limit = store.budget.max_file_bytes
    if size > limit:
        snap.dropped.append((rel, f"file of {size} bytes, over the {limit}-byte limit"))
        return
    snap.entries[rel] = ("100755" if mode & stat.S_IXUSR else "100644", store.blob(read()))


def _finish(snap: Snapshot, store: ObjectStore, links: dict[str, str]) -> Snapshot:
    resolve_links(snap, links)
    store.drop_refused(snap)
    return snap


def has_holes(fd: int, size: int) -> bool:
    """Does the open regular file have a hole before its end (a sparse file)? SEEK_HOLE answers from the
    file's extents, nothing is read; where the filesystem cannot tell, it answers size (no hole)."""
    if size == 0:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError:
        return False
    finally:
        os.lseek(fd, 0, os.SEEK_SET)  # SEEK_HOLE moved the offset: the content is read from the start


def _read_host_file(full: str, st: os.stat_result):
    """(why it is dropped, '' to read it; a function returning its bytes) for a regular file on the host:
    opened without following a link or blocking (a fifo swapped in stays unread), checked again on the
    open descriptor, its holes found before any byte is read."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return f"unreadable ({type(e).__name__})", None
    fst = os.fstat(fd)
    if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        return "changed while the tree was read", None
    if has_holes(fd, fst.st_size) or (fst.st_blocks == 0 and fst.st_size > SPARSE_MIN):
        os.close(fd)
        return (f"sparse file ({fst.st_size} bytes nominal, {fst.st_blocks * 512} allocated): not read, "
                "its nominal size is not its content"), None

    def read() -> bytes:
        with os.fdopen(fd, "rb") as f:
            return f.read(fst.st_size + 1)[: fst.st_size]
    return "", read


SPARSE_MIN = 1 << 20  # no blocks at all, over this size: sparse where SEEK_HOLE cannot tell


def snapshot_dir(root: Path, store: ObjectStore) -> Snapshot:
    """The tree under root, read from the host's filesystem (no link is followed), within store.budget."""
    snap = Snapshot()
    tally, links = _Tally(store), {}
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        walk_into = []
        for name in sorted(dirnames + filenames):
            if name == ".git":
                continue
            full = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                tally.add(rel, 0)  # a million empty directories cost the walk too
                walk_into.append(name)
            elif stat.S_ISLNK(st.st_mode):
                _add_link(snap, store, tally, links, rel, os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                tally.add(rel, 0)
                if st.st_size > store.budget.max_file_bytes or refused_path(rel):
                    _add_file(snap, store, rel, st.st_mode, st.st_size, None)  # dropped, never opened
                    continue
                why, read = _read_host_file(full, st)
                if why:
                    snap.dropped.append((rel, why))
                else:
                    tally.add_bytes(rel, st.st_size)
                    _add_file(snap, store, rel, st.st_mode, st.st_size, read)
            else:
                snap.dropped.append((rel, "not a regular file, directory or symlink"))
        dirnames[:] = walk_into
    return _finish(snap, store, links)


class _ChunkReader:
    """A file object over an iterator of byte chunks (docker's get_archive stream)."""

    def __init__(self, chunks: Iterable[bytes]):
        self._it: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            try:
                self._buf += next(self._it)
            except StopIteration:
                break
        if n < 0:
            out, self._buf = self._buf, b""
        else:
            out, self._buf = self._buf[:n], self._buf[n:]
        return out


def snapshot_tar(chunks: Iterable[bytes], store: ObjectStore) -> Snapshot:
    """The tree in a tar stream whose one top directory is the workspace (docker's get_archive of it),
    within store.budget: each member counted by its header before its data is read."""
    snap = Snapshot()
    tally, links = _Tally(store), {}
    with tarfile.open(fileobj=_ChunkReader(chunks), mode="r|") as tar:
        for m in tar:
            parts = m.name.split("/", 1)
            if len(parts) < 2 or not parts[1].strip("/"):
                continue  # the top directory itself
            rel = posixpath.normpath(parts[1])
            if rel.startswith("../") or rel == ".." or rel.startswith("/") or _git_path(rel):
                continue
            if m.isdir():
                tally.add(rel, 0)
                continue
            if m.issym():
                _add_link(snap, store, tally, links, rel, m.linkname)
            elif m.isreg():
                # counted by its header before its data: a stream reads every byte, dropped or not
                tally.add(rel, m.size)
                if m.issparse():
                    snap.dropped.append((rel, f"sparse file ({m.size} bytes nominal): not read, its nominal size "
                                              "is not its content"))
                elif m.size > SPARSE_MIN and m.size <= store.budget.max_file_bytes:
                    # docker's archive streams a sparse file's holes as zeros: judged by its content
                    data = tar.extractfile(m).read()
                    if not data.strip(b"\0"):
                        snap.dropped.append((rel, f"zero-filled file ({m.size} bytes; a sparse file, as docker's "
                                                  "archive streams it): not hashed, not in the patch"))
                    else:
                        _add_file(snap, store, rel, m.mode, m.size, lambda data=data: data)
                else:
                    _add_file(snap, store, rel, m.mode, m.size, lambda m=m: tar.extractfile(m).read())
            elif m.islnk():
                # a hard link to an earlier member: the same content (a stream cannot seek back to it)
                target = posixpath.normpath(m.linkname.split("/", 1)[-1])
                tally.add(rel, 0)
                if why := refused_path(rel):
                    snap.dropped.append((rel, f"a path git refuses: {why}"))
                elif target in snap.entries:
                    snap.entries[rel] = snap.entries[target]
                else:
                    snap.dropped.append((rel, f"hard link to {m.linkname}, not in the tree"))
            else:
                snap.dropped.append((rel, "not a regular file, directory or symlink"))
    return _finish(snap, store, links)
