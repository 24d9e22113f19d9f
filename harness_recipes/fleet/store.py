"""The storage a fleet shares: a filesystem URI (``file:///shared/run``, ``s3://bucket/run``, any
pyarrow filesystem). Layout under the root:

    logs/<episode_id>.arrow                 each finished episode's capture log
    rollout/records/<episode_id>.json       its rollout record (names the node that ran it)
    shards/shard-NNNNNN.parquet             the fleet's shards (one recon over logs/, + its manifest)
    staging/<node>/<episode_id>.arrow       a log on its way in: the queue moves it into logs/ if the
                                            node's attempt is still current (fleet.TaskQueue.publish)

Every object is written once, under a temporary name then moved into place (a rename on a local
or shared POSIX filesystem; object stores put whole objects), so a reader (the trainer, a resumed
fleet) never sees half a file. Nothing is appended to: object stores cannot append.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

LOGS, RECORDS, SHARDS, STAGING = "logs", "rollout/records", "shards", "staging"
_URI_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError, OSError)


class StoreError(ValueError):
    """A store URI that cannot be used; the message names it and why."""


class Store:
    def __init__(self, uri: str):
        self.uri = uri
        try:
            self.fs, root = pafs.FileSystem.from_uri(uri)
        except _URI_ERRORS as exc:
            raise StoreError(f"--store {uri!r}: not a filesystem URI pyarrow can open ({exc}); e.g. "
                             f"file:///shared/polar-run or s3://bucket/polar-run") from None
        self.root = root.rstrip("/")
        try:
            self.fs.create_dir(self.root, recursive=True)
        except OSError as exc:
            raise StoreError(f"--store {uri!r}: cannot create {self.root!r}: {exc}") from None

    def __reduce__(self):  # (sent to Ray actors as its URI: a filesystem handle may not pickle)
        return Store, (self.uri,)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel.lstrip('/')}"

    def put_bytes(self, rel: str, data: bytes) -> str:
        dest = self.path(rel)
        parent = dest.rsplit("/", 1)[0]
        self.fs.create_dir(parent, recursive=True)
        tmp = f"{parent}/.{dest.rsplit('/', 1)[1]}.{uuid.uuid4().hex[:8]}.tmp"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, dest)
        return dest

    def put_file(self, local: str | Path, rel: str) -> str:
        return self.put_bytes(rel, Path(local).read_bytes())

    def put_json(self, rel: str, obj) -> str:
        return self.put_bytes(rel, (json.dumps(obj, sort_keys=True) + "\n").encode())

    def get_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def list(self, rel: str) -> list[str]:
        """The names (relative to ``rel``) of the finished files under ``rel``, recursively, sorted."""
        base = self.path(rel)
        info = self.fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            return []
        sel = pafs.FileSelector(base, recursive=True)
        names = [i.path[len(base) + 1:] for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File]
        return sorted(n for n in names if not n.rsplit("/", 1)[-1].startswith("."))

    def records(self) -> list[dict]:
        return [json.loads(self.get_bytes(f"{RECORDS}/{n}")) for n in self.list(RECORDS) if n.endswith(".json")]
