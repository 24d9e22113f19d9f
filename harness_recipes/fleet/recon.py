"""The fleet's one reconstruction: ``polar-recon watch`` over the store's logs while the fleet runs,
shards landing in ``<store>/shards`` as GRPO groups complete, then one last ``build`` for what is
left (a group given up after a dead node). One recon and one manifest for the whole fleet: an
episode reaches a shard once, whichever node ran it, a dead node's published ones too. The trainer
reads ``<store>/shards`` (``--shards``) as they land.

    recon = make_recon(store, group_size); recon.start(); ...; recon.finish()

- a local (or mounted, shared) filesystem store: watch reads ``<store>/logs`` and writes
  ``<store>/shards`` directly (LocalRecon);
- any other pyarrow filesystem (s3://, gs://, ...): polar-recon reads and writes local paths, so
  MirroredRecon copies each new log of ``<store>/logs`` to a local mirror, runs watch there, and
  uploads each finished shard (and then the manifest) to ``<store>/shards``, each object written
  whole under a temporary name and moved into place (Store.put_file), so a trainer listing the
  store never reads half a shard. At start it downloads the store's shards and manifest first, so
  a resumed fleet's recon knows what is built and builds no episode twice.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pyarrow.fs as pafs

from harness_recipes.fleet.store import LOGS, SHARDS, Store
from harness_recipes.node.processes import stop
from polar_contracts.shards import MANIFEST, SHARD_RE

POLL_S = 1.0


def recon_cmd(verb: str, logs: str, shards: str, group_size: int) -> list[str]:
    cmd = [sys.executable, "-m", "polar_recon.cli", verb, logs, shards]
    return cmd + (["--group-size", str(group_size), "--poll", str(POLL_S)] if verb == "watch" else [])


def build(logs: str, shards: str) -> None:
    proc = subprocess.run(recon_cmd("build", logs, shards, 0), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"polar-recon build {logs} {shards} failed ({proc.returncode}): {proc.stderr[-2000:]}")


class LocalRecon:
    """The store is a filesystem this machine reads: recon works on it in place."""

    def __init__(self, store: Store, group_size: int):
        self.store, self.group_size = store, group_size
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        logs, shards = self.store.path(LOGS), self.store.path(SHARDS)
        for d in (logs, shards):
            self.store.fs.create_dir(d, recursive=True)
        self.proc = subprocess.Popen(recon_cmd("watch", logs, shards, self.group_size))

    def abort(self) -> None:
        if self.proc is not None:
            stop(self.proc, signal.SIGINT, grace=30)

    def finish(self) -> dict:
        stop(self.proc, signal.SIGINT, grace=60)  # watch finishes the shard it is writing and exits 0
        logs, shards = self.store.path(LOGS), self.store.path(SHARDS)
        build(logs, shards)
        return {"built": True, "watch_rc": self.proc.returncode, "path": shards,
                "files": [n for n in self.store.list(SHARDS) if SHARD_RE.match(n)]}


class MirroredRecon:
    """The store is an object store (or any filesystem recon cannot open): mirror its logs here,
    build here, upload the shards. ``workdir``: the local mirror (default: a temporary directory,
    removed at the end)."""

    def __init__(self, store: Store, group_size: int, workdir: str | Path | None = None, poll_s: float = POLL_S):
        self.store, self.group_size, self.poll_s = store, group_size, poll_s
        self.own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="polar-fleet-recon-"))
        self.logs, self.shards = self.dir / "logs", self.dir / "shards"
        self.proc: subprocess.Popen | None = None
        self.uploaded: dict[str, int] = {}  # shard name -> size uploaded
        self.manifest_mtime = 0.0
        self.mirrored: set[str] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="polar-fleet-recon-sync", daemon=True)

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.shards.mkdir(parents=True, exist_ok=True)
        self._download_built()
        self.mirror()
        self.proc = subprocess.Popen(recon_cmd("watch", str(self.logs), str(self.shards), self.group_size))
        self._thread.start()

    def _download_built(self) -> None:
        """What the store's shards already hold (a resumed fleet): the shards and the manifest."""
        have = set(self.store.list(SHARDS))
        for name in sorted(n for n in have if SHARD_RE.match(n)):
            self._get(f"{SHARDS}/{name}", self.shards / name)
            self.uploaded[name] = (self.shards / name).stat().st_size
        try:
            data = self.store.get_bytes(f"{SHARDS}/{MANIFEST}")
        except (FileNotFoundError, OSError):
            return
        self._write(self.shards / MANIFEST, data)
        self.manifest_mtime = (self.shards / MANIFEST).stat().st_mtime

    def _get(self, rel: str, dest: Path) -> None:
        self._write(dest, self.store.get_bytes(rel))

    @staticmethod
    def _write(dest: Path, data: bytes) -> None:
        tmp = dest.with_name(f".{dest.name}.mirror.tmp")  # (hidden: recon reads only finished names)
        tmp.write_bytes(data)
        tmp.replace(dest)

    def mirror(self) -> int:
        """Copy the store's new logs here; how many."""
        n = 0
        for name in self.store.list(LOGS):
            if name in self.mirrored or not name.endswith(".arrow") or "/" in name:
                continue
            self._get(f"{LOGS}/{name}", self.logs / name)
            self.mirrored.add(name)
            n += 1
        return n

    def upload(self) -> int:
        """Put recon's new finished shards in the store, then its manifest when it changed; how many shards."""
        n = 0
        for f in sorted(self.shards.iterdir()):
            if SHARD_RE.match(f.name) and self.uploaded.get(f.name) != f.stat().st_size:
                self.store.put_file(f, f"{SHARDS}/{f.name}")
                self.uploaded[f.name] = f.stat().st_size
                n += 1
        m = self.shards / MANIFEST
        if m.exists() and m.stat().st_mtime != self.manifest_mtime:
            mtime = m.stat().st_mtime
            self.store.put_file(m, f"{SHARDS}/{MANIFEST}")
            self.manifest_mtime = mtime
        return n

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.mirror()
                self.upload()
            except OSError as exc:  # a store hiccup: the next round tries again; the last one must succeed
                self.errors.append(f"{type(exc).__name__}: {exc}"[:500])

    def abort(self) -> None:
        self._stop.set()
        if self.proc is not None:
            stop(self.proc, signal.SIGINT, grace=30)

    def finish(self) -> dict:
        self._stop.set()
        self._thread.join()
        stop(self.proc, signal.SIGINT, grace=60)
        self.mirror()  # the last logs, then one build for what is left
        build(str(self.logs), str(self.shards))
        self.upload()
        files = [n for n in self.store.list(SHARDS) if SHARD_RE.match(n)]
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        return {"built": True, "watch_rc": self.proc.returncode, "path": self.store.uri.split("?", 1)[0] + "/" + SHARDS,
                "files": files, "mirrored_logs": len(self.mirrored), "sync_errors": self.errors}


def make_recon(store: Store, group_size: int) -> LocalRecon | MirroredRecon:
    if isinstance(store.fs, pafs.LocalFileSystem):
        return LocalRecon(store, group_size)
    return MirroredRecon(store, group_size)
