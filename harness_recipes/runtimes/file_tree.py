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
symlinks pointing outside (absolute, or climbing out with ..), anything else (fifos, sockets,
devices), files over MAX_FILE_BYTES. Left out silently: every `.git` path component (git cannot
track those), and empty directories (git has no such thing).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import subprocess
import tarfile
import tempfile
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


@dataclass
class Snapshot:
    """One file tree: path -> (mode, blob id), and what was left out of it (path, why)."""
    entries: dict[str, tuple[str, str]] = field(default_factory=dict)
    dropped: list[tuple[str, str]] = field(default_factory=list)


class ObjectStore:
    """A bare git repository only the node writes: blobs, trees, diffs, under a git that reads no config."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._home = Path(tempfile.mkdtemp(prefix="polar-git-home-", dir=self.path.parent))
        self.git(["init", "-q", "--bare", str(self.path)], bare_dir=False)

    def env(self) -> dict[str, str]:
        # No system or global config, an empty HOME (no ~/.gitconfig, no XDG config), no attributes.
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self._home), "LANG": "C",
                "XDG_CONFIG_HOME": str(self._home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                "GIT_ATTR_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0", "GIT_DIR": str(self.path)}

    def git(self, args: list[str], stdin: bytes = b"", env: dict | None = None, bare_dir: bool = True) -> bytes:
        e = {**self.env(), **(env or {})}
        if not bare_dir:
            e.pop("GIT_DIR")
        proc = subprocess.run(["git", *GIT_OPTS, *args], input=stdin, env=e, capture_output=True, cwd=self._home)
        if proc.returncode != 0:
            raise TreeError(f"git {' '.join(args[:3])} failed: {proc.stderr.decode(errors='replace')[-400:]}")
        return proc.stdout

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
        """A git tree of these entries (path -> (mode, blob id)); the id of the empty tree for none."""
        if not entries:
            return EMPTY_TREE
        with tempfile.TemporaryDirectory(dir=self.path.parent) as d:
            env = {"GIT_INDEX_FILE": str(Path(d) / "index")}
            lines = b"".join(f"{mode} {oid}\t".encode() + os.fsencode(p) + b"\0" for p, (mode, oid) in entries.items())
            self.git(["update-index", "--add", "-z", "--index-info"], stdin=lines, env=env)
            return self.git(["write-tree"], env=env).decode().strip()

    def diff(self, a: str, b: str) -> bytes:
        """The patch from tree a to tree b: binary files as git binary patches, new and deleted files, modes."""
        return self.git(["diff-tree", "-r", "-p", "--binary", "--full-index", "--no-renames", "--no-ext-diff",
                         "--no-textconv", "--no-color", a, b])


def _git_path(rel: str) -> bool:
    return ".git" in rel.split("/")


def link_escapes(rel: str, target: str) -> bool:
    """Does a symlink at rel (relative to the tree's root) point outside the tree?"""
    if target.startswith("/") or not target:
        return True
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    return resolved == ".." or resolved.startswith("../")


def _add_link(snap: Snapshot, store: ObjectStore, rel: str, target: str) -> None:
    if link_escapes(rel, target):
        snap.dropped.append((rel, f"symlink pointing outside the repository (-> {target})"))
    else:
        snap.entries[rel] = ("120000", store.blob(os.fsencode(target)))


def _add_file(snap: Snapshot, store: ObjectStore, rel: str, mode: int, size: int, read) -> None:
    if size > MAX_FILE_BYTES:
        snap.dropped.append((rel, f"file of {size} bytes, over the {MAX_FILE_BYTES}-byte limit"))
        return
    snap.entries[rel] = ("100755" if mode & stat.S_IXUSR else "100644", store.blob(read()))


def snapshot_dir(root: Path, store: ObjectStore) -> Snapshot:
    """The tree under root, read from the host's filesystem (no link is followed)."""
    snap = Snapshot()
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
                walk_into.append(name)
            elif stat.S_ISLNK(st.st_mode):
                _add_link(snap, store, rel, os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                _add_file(snap, store, rel, st.st_mode, st.st_size, lambda p=full: Path(p).read_bytes())
            else:
                snap.dropped.append((rel, "not a regular file, directory or symlink"))
        dirnames[:] = walk_into
    return snap


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
    """The tree in a tar stream whose one top directory is the workspace (docker's get_archive of it)."""
    snap = Snapshot()
    with tarfile.open(fileobj=_ChunkReader(chunks), mode="r|") as tar:
        for m in tar:
            parts = m.name.split("/", 1)
            if len(parts) < 2 or not parts[1].strip("/"):
                continue  # the top directory itself
            rel = posixpath.normpath(parts[1])
            if rel.startswith("../") or rel == ".." or rel.startswith("/") or _git_path(rel):
                continue
            if m.isdir():
                continue
            if m.issym():
                _add_link(snap, store, rel, m.linkname)
            elif m.isreg():
                _add_file(snap, store, rel, m.mode, m.size, lambda m=m: tar.extractfile(m).read())
            elif m.islnk():
                # a hard link to an earlier member: the same content (a stream cannot seek back to it)
                target = posixpath.normpath(m.linkname.split("/", 1)[-1])
                if target in snap.entries:
                    snap.entries[rel] = snap.entries[target]
                else:
                    snap.dropped.append((rel, f"hard link to {m.linkname}, not in the tree"))
            else:
                snap.dropped.append((rel, "not a regular file, directory or symlink"))
    return snap
