"""Grading has bounds (runtimes/file_tree.py Budget, node/model_patch.py, node/grading.py): the agent's
tree and patch are budgeted, sparse and special files are never read, symlinks are judged by where
they resolve (chains included), paths git refuses are named. No docker, no sandbox: seconds."""
from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from harness_recipes.node.grading import grade_episode
from harness_recipes.node.model_patch import model_patch
from harness_recipes.runtimes import file_tree
from harness_recipes.runtimes.file_tree import (
    Budget,
    ObjectStore,
    OverBudget,
    link_resolution,
    refused_path,
    snapshot_dir,
    snapshot_tar,
)
from harness_recipes.runtimes.local import LocalRuntime
from harness_recipes.tasks.task_file import parse_task

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def tree(tmp_path: Path, name: str = "ws") -> Path:
    ws = tmp_path / name
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    return ws


def tar_of(root: Path, *extra: str) -> list[bytes]:
    """docker's get_archive of root: a tar stream whose one top directory is the workspace (GNU tar, so
    that ``-S`` can write sparse members as docker's does not)."""
    out = subprocess.run(["tar", "-C", str(root.parent), *extra, "-cf", "-", root.name], check=True,
                         capture_output=True).stdout
    return [out[i:i + 65536] for i in range(0, len(out), 65536)]


class CountingStore(ObjectStore):
    """An object store that remembers the size of every blob it was asked to write."""

    def __init__(self, path: Path, budget: Budget | None = None):
        super().__init__(path, budget)
        self.sizes: list[int] = []

    def blob(self, data: bytes) -> str:
        self.sizes.append(len(data))
        return super().blob(data)


# ---- symlinks judged by where they resolve --------------------------------------------------------

def chain(ws: Path) -> None:
    (ws / "a").mkdir()
    (ws / "a" / "b").symlink_to("..")  # the repository's root: inside
    (ws / "esc").symlink_to("a/b/..")  # lexically "a", resolved: the root's parent
    (ws / "deep").symlink_to("a/b/a/b/pkg/mod.py")  # a chain that stays inside
    (ws / "loop1").symlink_to("loop2")
    (ws / "loop2").symlink_to("loop1")
    (ws / "via_abs").symlink_to("abs/x")
    (ws / "abs").symlink_to("/etc")


@pytest.mark.parametrize("source", ["dir", "tar"])
def test_a_symlink_chain_out_of_the_tree_is_dropped(tmp_path, source):
    ws = tree(tmp_path)
    chain(ws)
    store = ObjectStore(tmp_path / "store.git")
    snap = snapshot_dir(ws, store) if source == "dir" else snapshot_tar(tar_of(ws), store)
    dropped = dict(snap.dropped)
    assert set(dropped) == {"esc", "loop1", "loop2", "via_abs", "abs"}, dropped
    assert "outside the repository" in dropped["esc"] and "through a/b -> .." in dropped["esc"]
    assert "loop" in dropped["loop1"] and "outside the repository" in dropped["via_abs"]
    assert {"a/b", "deep", "pkg/mod.py"} <= set(snap.entries)
    # and the patch the node computes from it carries none of them
    mp = model_patch(store, snapshot_dir(tree(tmp_path, "pristine"), store), snap)
    assert b"esc" not in mp.patch and b"new file mode 120000" in mp.patch


def test_link_resolution_follows_the_tree_like_the_kernel():
    links = {"a/b": "..", "esc": "a/b/..", "ok": "a/b/pkg", "x/y": "../a/b/a/b/../.."}
    assert link_resolution("a/b", links) == ""
    assert link_resolution("ok", links) == ""
    assert "outside" in link_resolution("esc", links)
    assert "outside" in link_resolution("x/y", links)  # a/b -> root, a/b -> root, .. -> out


# ---- sparse and special files ---------------------------------------------------------------------

def test_sparse_files_are_dropped_without_reading_them(tmp_path):
    """Structural, not a timing: eight 60 MiB sparse files cost no blob, no read, no patch bytes."""
    ws = tree(tmp_path)
    for i in range(8):
        with open(ws / f"sparse{i}.bin", "wb") as f:
            f.truncate(60 * MIB)
    if os.stat(ws / "sparse0.bin").st_blocks * 512 >= 60 * MIB:
        pytest.skip(f"the filesystem under {tmp_path} does not make sparse files: nothing to check")
    store = CountingStore(tmp_path / "store.git")
    snap = snapshot_dir(ws, store)
    assert max(store.sizes) < MIB, store.sizes
    dropped = dict(snap.dropped)
    assert all("sparse" in dropped[f"sparse{i}.bin"] for i in range(8)), dropped
    mp = model_patch(store, snapshot_dir(tree(tmp_path, "pristine"), store), snap)
    assert mp.patch == b""


def test_a_sparse_tar_member_is_dropped_unread(tmp_path):
    ws = tree(tmp_path)
    with open(ws / "sparse.bin", "wb") as f:
        f.truncate(60 * MIB)
    store = CountingStore(tmp_path / "store.git")
    snap = snapshot_tar(tar_of(ws, "--sparse"), store)
    assert "sparse" in dict(snap.dropped)["sparse.bin"]
    assert max(store.sizes) < MIB


def test_tar_members_count_against_the_budget_before_they_are_read(tmp_path):
    """docker's archive streams every byte, a sparse file's zeros too: each header's size is counted
    first, so the tree stops at max_tree_bytes before the member that crosses it is read."""
    ws = tree(tmp_path)
    for i in range(3):
        with open(ws / f"zeros{i}.bin", "wb") as f:
            f.truncate(2 * MIB)
        (ws / f"data{i}.bin").write_bytes(b"\1" * 2 * MIB)
    store = CountingStore(tmp_path / "store.git", Budget(max_tree_bytes=9 * MIB))
    with pytest.raises(OverBudget, match="max_tree_bytes"):
        snapshot_tar(tar_of(ws), store)  # not --sparse: the members are plain files
    # of the six 2 MiB members, four fit; the zero-filled ones among them were never hashed
    assert store.sizes.count(2 * MIB) <= 4 and len([s for s in store.sizes if s >= MIB]) < 4


def test_zero_filled_tar_members_are_dropped_as_sparse(tmp_path):
    ws = tree(tmp_path)
    for i in range(8):
        with open(ws / f"sparse{i}.bin", "wb") as f:
            f.truncate(3 * MIB)
    store = CountingStore(tmp_path / "store.git")
    snap = snapshot_tar(tar_of(ws), store)  # as docker's archive has them: plain members full of zeros
    assert all("zero-filled" in dict(snap.dropped)[f"sparse{i}.bin"] for i in range(8)), snap.dropped
    assert max(store.sizes) < MIB


def test_fifos_sockets_and_devices_are_never_opened(tmp_path):
    ws = tree(tmp_path)
    os.mkfifo(ws / "fifo")  # opening it for reading would block the node forever
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(ws / "sock"))
        store = ObjectStore(tmp_path / "store.git")
        snap = snapshot_dir(ws, store)
        tar_snap = snapshot_tar(tar_of(ws), store)
    for sn in (snap, tar_snap):
        dropped = dict(sn.dropped)
        assert "not a regular file" in dropped["fifo"]
        assert "fifo" not in sn.entries
    assert "not a regular file" in dict(snap.dropped)["sock"]  # tar leaves sockets out itself


def test_a_char_device_in_a_tar_is_dropped(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind in (("ws", tarfile.DIRTYPE), ("ws/zero", tarfile.CHRTYPE), ("ws/disk", tarfile.BLKTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, 0
            info.devmajor, info.devminor = 1, 5
            tar.addfile(info)
    snap = snapshot_tar([buf.getvalue()], ObjectStore(tmp_path / "store.git"))
    assert set(dict(snap.dropped)) == {"zero", "disk"} and not snap.entries


# ---- paths git refuses ----------------------------------------------------------------------------

def test_paths_git_refuses_are_named_in_the_dropped_list(tmp_path):
    ws = tree(tmp_path)
    for bad in (".GIT", "git~1", "pkg/.Git. "):
        (ws / bad).mkdir()
        (ws / bad / "hooks").write_text("#!/bin/sh\n")
    (ws / ".gitmodules").symlink_to("pkg/mod.py")
    store = ObjectStore(tmp_path / "store.git")
    snap = snapshot_dir(ws, store)
    dropped = dict(snap.dropped)
    assert {".GIT/hooks", "git~1/hooks", "pkg/.Git. /hooks", ".gitmodules"} <= set(dropped), dropped
    assert all("git refuses" in dropped[p] for p in (".GIT/hooks", "git~1/hooks", ".gitmodules"))
    store.tree(snap.entries)  # what is left builds a tree


def test_refused_path_rules():
    assert refused_path("a/.GIT/x") and refused_path("GIT~1") and refused_path(".git\u200c/x")
    assert refused_path(".gitmodules", link=True) and not refused_path(".gitmodules")
    assert not refused_path("pkg/.github/workflows/ci.yml") and not refused_path("a/.gitignore")


def test_a_path_only_git_knows_it_refuses_is_dropped_in_its_words(tmp_path, monkeypatch):
    """A newer git may refuse more than refused_path knows: ObjectStore asks git itself."""
    ws = tree(tmp_path)
    (ws / ".GIT").mkdir()
    (ws / ".GIT" / "config").write_text("x")
    monkeypatch.setattr(file_tree, "refused_path", lambda rel, link=False: "")
    snap = snapshot_dir(ws, ObjectStore(tmp_path / "store.git"))
    assert "Ignoring path" in dict(snap.dropped)[".GIT/config"]


# ---- the budget ------------------------------------------------------------------------------------

def test_the_patch_budget_files_and_bytes(tmp_path):
    pristine = tree(tmp_path, "pristine")
    ws = tree(tmp_path)
    for i in range(5):
        (ws / f"new{i}.py").write_text("x = 1\n" * 1000)
    store = ObjectStore(tmp_path / "a.git", Budget(max_patch_files=4))
    with pytest.raises(OverBudget, match=r"changes 5 paths, over the budget of 4 \(max_patch_files\)"):
        model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store))
    store = ObjectStore(tmp_path / "b.git", Budget(max_patch_bytes=10_000))
    with pytest.raises(OverBudget, match="max_patch_bytes"):
        model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store))
    # stripped paths (bytecode a test run wrote) are not the model's patch: not counted
    (ws / "__pycache__").mkdir()
    for i in range(10):
        (ws / "__pycache__" / f"m{i}.pyc").write_bytes(b"\0")
    store = ObjectStore(tmp_path / "c.git", Budget(max_patch_files=5))
    assert model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store)).patch


def test_the_tree_budget_and_the_deadline(tmp_path):
    ws = tree(tmp_path)
    for i in range(20):
        (ws / f"f{i}").write_text("x")
    with pytest.raises(OverBudget, match="max_tree_files"):
        snapshot_dir(ws, ObjectStore(tmp_path / "a.git", Budget(max_tree_files=10)))
    store = ObjectStore(tmp_path / "b.git", Budget(seconds=30))
    store.deadline = time.monotonic() - 1  # as if reading had taken all of it
    with pytest.raises(OverBudget, match=r"over 30 s \(seconds\)"):
        snapshot_dir(ws, store)
    store.restart_clock()
    assert snapshot_dir(ws, store).entries


def test_bad_budgets_are_refused_by_name():
    with pytest.raises(ValueError, match="max_patch_files must be positive"):
        Budget(max_patch_files=0)


def test_a_patch_over_budget_is_a_graded_zero_not_a_discard(tmp_path):
    """Through grade_episode: reward 0, no error (kept for training), the reason in the eval metadata."""
    repo = ROOT / "data" / "tasks" / "repos" / "fix_add"
    task = parse_task({"id": "add", "workspace": str(repo), "prompt": "fix calc.py",
                       "eval": f"{sys.executable} -m pytest -q -p no:cacheprovider"}, ROOT, "test")
    runtime = LocalRuntime(isolation="none", workdir=str(tmp_path))

    async def go():
        sb = await runtime.prepare(task, "add.s0", Path(sys.executable))
        for i in range(30):
            Path(sb.workspace, f"junk{i}.txt").write_text("junk\n")
        return await grade_episode(runtime, task, "add.s0", sb, Path(sys.executable), os.environ["PATH"],
                                   tmp_path / "out", workdir=str(tmp_path), budget=Budget(max_patch_files=20))
    g = asyncio.run(go())
    assert g.reward == 0.0 and g.error == "", g
    assert "max_patch_files" in g.eval["over_budget"] and g.eval["patch_applied"] is False
    assert (tmp_path / "out" / "model.patch").read_bytes() == b""


def test_the_eval_metadata_lists_stay_small_whatever_the_agent_creates(tmp_path):
    """Ten thousand fifos and conftests must not make the end record too big to post (a discard)."""
    pristine, ws = tree(tmp_path, "pristine"), tree(tmp_path)
    for i in range(300):
        os.mkfifo(ws / f"fifo-{i:04d}-{'x' * 200}")
        (ws / f"d{i}").mkdir()
        (ws / f"d{i}" / "conftest.py").write_text("x = 1\n")
    store = ObjectStore(tmp_path / "store.git")
    meta = model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store)).metadata()
    assert len(meta["dropped_paths"]) == 50 and meta["dropped_count"] == 300
    assert len(meta["stripped_paths"]) == 50 and meta["stripped_count"] == 300
    assert len(json.dumps(meta)) < 32 << 10


def test_the_grading_budget_option():
    import click

    from harness_recipes.cli import parse_budget
    assert parse_budget(None) == Budget()
    assert parse_budget("max_patch_files=5, seconds=1.5") == Budget(max_patch_files=5, seconds=1.5)
    for bad, why in (("max_patch=5", "not KEY=VALUE with KEY one of"), ("seconds=soon", "is not a number"),
                     ("max_tree_bytes=0", "must be positive")):
        with pytest.raises(click.UsageError, match=why):
            parse_budget(bad)
