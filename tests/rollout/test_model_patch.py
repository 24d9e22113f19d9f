"""The model patch computed by the node from file trees (file_tree.py, model_patch.py), and the
base-only repositories instance images are built from (images.base_only_repo). No docker: seconds."""
from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from harness_recipes.node.model_patch import model_patch, patch_paths, protected
from harness_recipes.runtimes.file_tree import ObjectStore, snapshot_dir, snapshot_tar
from harness_recipes.tasks.swebench.images import base_only_repo, history_after

GIT_ENV = {"PATH": os.environ["PATH"], "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=GIT_ENV, check=True, capture_output=True, text=True).stdout


def make_repo(path: Path) -> Path:
    path.mkdir()
    (path / "pkg").mkdir()
    (path / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (path / "pkg" / "gone.py").write_text("x = 1\n")
    (path / "run.sh").write_text("#!/bin/sh\n")
    (path / "tests").mkdir()
    (path / "tests" / "test_mod.py").write_text("def test_f():\n    from pkg.mod import f\n    assert f() == 2\n")
    git(path, "init", "-q")
    git(path, "add", "-A")
    git(path, "commit", "-qm", "base")
    return path


def agent_edits(ws: Path) -> None:
    (ws / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    (ws / "pkg" / "gone.py").unlink()
    (ws / "pkg" / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (ws / "run.sh").chmod(0o755)
    (ws / "pkg" / "inside").symlink_to("mod.py")
    (ws / "pkg" / "outside").symlink_to("/etc/passwd")
    (ws / "pkg" / "climb").symlink_to("../../secret")


def test_the_patch_is_the_file_tree_diff_and_applies_back(tmp_path):
    pristine = make_repo(tmp_path / "pristine")
    ws = tmp_path / "ws"
    subprocess.run(["cp", "-a", str(pristine), str(ws)], check=True)
    agent_edits(ws)
    store = ObjectStore(tmp_path / "store.git")
    mp = model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store))
    text = mp.patch.decode()
    assert "+    return 2" in text and "deleted file mode 100644" in text and "GIT binary patch" in text
    assert "old mode 100644\nnew mode 100755" in text and "new file mode 120000" in text
    assert ".git/" not in text
    # links out of the repository are dropped, and said so
    assert sorted(p for p, _ in mp.dropped) == ["pkg/climb", "pkg/outside"]
    assert all("outside the repository" in why for _, why in mp.dropped)
    assert mp.metadata()["patch_bytes"] == len(mp.patch) and len(mp.metadata()["patch_sha256"]) == 64
    # applied to a fresh copy of the pristine tree, the patch gives the agent's tree back (less the drops)
    fresh = tmp_path / "fresh"
    subprocess.run(["cp", "-a", str(pristine), str(fresh)], check=True)
    (tmp_path / "m.patch").write_bytes(mp.patch)
    git(fresh, "apply", "--binary", str(tmp_path / "m.patch"))
    for p in ("pkg/climb", "pkg/outside"):
        (ws / p).unlink()
    assert snapshot_dir(fresh, store).entries == snapshot_dir(ws, store).entries


def test_the_agents_git_is_never_asked(tmp_path):
    """Hooks, fsmonitor, an external diff, attributes, exclude and gitignore in the agent's
    repository: none of them runs, none of them hides or forges a change."""
    ws = make_repo(tmp_path / "ws")
    pristine = make_repo(tmp_path / "pristine")
    marker = tmp_path / "ran"
    spy = tmp_path / "spy.sh"
    spy.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {marker}\necho FORGED\n")
    spy.chmod(0o755)
    git(ws, "config", "core.fsmonitor", str(spy))
    git(ws, "config", "diff.external", str(spy))
    git(ws, "config", "core.hooksPath", str(tmp_path))
    (ws / ".gitattributes").write_text("*.py diff=spy filter=spy -diff\n")
    git(ws, "config", "diff.spy.textconv", str(spy))
    (ws / ".git" / "info" / "exclude").write_text("hidden.py\n")
    (ws / ".gitignore").write_text("also_hidden.py\n")
    (ws / "hidden.py").write_text("SECRET = 1\n")
    (ws / "also_hidden.py").write_text("SECRET = 2\n")
    (ws / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    store = ObjectStore(tmp_path / "store.git")
    text = model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store)).patch.decode()
    assert "FORGED" not in text and "+    return 2" in text
    assert "b/hidden.py" in text and "b/also_hidden.py" in text and "b/.gitattributes" in text
    assert not marker.exists(), marker.read_text()
    # control: the agent's own git would have run the spy
    subprocess.run(["git", "diff"], cwd=ws, env=GIT_ENV, capture_output=True)
    assert marker.exists()


@pytest.mark.parametrize("path, why", [
    ("conftest.py", "test runner configuration"), ("a/b/conftest.py", "test runner configuration"),
    ("pytest.ini", "test runner configuration"), ("setup.cfg", "test runner configuration"),
    ("pyproject.toml", "test runner configuration"), ("tox.ini", "test runner configuration"),
    ("sitecustomize.py", "Python start-up hook"), ("lib/usercustomize.py", "Python start-up hook"),
    ("x/evil.pth", "Python start-up hook"), ("pkg/__pycache__/mod.cpython-311.pyc", "compiled bytecode"),
    ("mod.pyc", "compiled bytecode"), ("pytest.py", "shadows the test runner"),
    ("_pytest/runner.py", "shadows the test runner"), ("pluggy/__init__.py", "shadows the test runner"),
    ("unittest/__init__.py", "shadows a standard-library module"), ("json.py", "shadows a standard-library module"),
    ("tests/test_mod.py", "a file of the task's test patch"),
])
def test_test_infrastructure_is_protected(path, why):
    assert protected(path, {"tests/test_mod.py"}) == why


@pytest.mark.parametrize("path", ["pkg/mod.py", "pkg/pytest.py", "pkg/unittest/x.py",
                                  "tests/test_other.py", "conftest.py.txt", "README"])
def test_code_is_not_protected(path):
    assert protected(path, {"tests/test_mod.py"}) == ""


def test_protected_changes_are_stripped_and_recorded(tmp_path):
    pristine = make_repo(tmp_path / "pristine")
    ws = tmp_path / "ws"
    subprocess.run(["cp", "-a", str(pristine), str(ws)], check=True)
    (ws / "conftest.py").write_text("def pytest_runtest_call(item): pass\n")
    (ws / "tests" / "test_mod.py").write_text("def test_f():\n    pass\n")
    (ws / "pkg" / "__pycache__").mkdir()
    (ws / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\x00" * 20)
    (ws / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    store = ObjectStore(tmp_path / "store.git")
    mp = model_patch(store, snapshot_dir(pristine, store), snapshot_dir(ws, store), {"tests/test_mod.py"})
    assert mp.stripped == ["conftest.py", "pkg/__pycache__/mod.cpython-311.pyc", "tests/test_mod.py"]
    assert patch_paths(mp.patch.decode()) == {"pkg/mod.py"}
    assert set(mp.changed) == {*mp.stripped, "pkg/mod.py"}


def test_a_tar_stream_reads_as_the_directory_does(tmp_path):
    ws = make_repo(tmp_path / "ws")
    agent_edits(ws)
    store = ObjectStore(tmp_path / "store.git")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(ws, arcname="testbed")  # as docker's get_archive names it: the directory's base name
        hostile = tarfile.TarInfo("testbed/../../escape.py")
        hostile.size = 1
        tar.addfile(hostile, io.BytesIO(b"x"))
        link = tarfile.TarInfo("testbed/pkg/hard.py")
        link.type, link.linkname = tarfile.LNKTYPE, "testbed/pkg/mod.py"
        tar.addfile(link)
    data = buf.getvalue()
    from_tar = snapshot_tar((data[i:i + 7000] for i in range(0, len(data), 7000)), store)
    from_dir = snapshot_dir(ws, store)
    assert from_tar.entries.pop("pkg/hard.py") == from_dir.entries["pkg/mod.py"]
    assert from_tar.entries == from_dir.entries and sorted(from_tar.dropped) == sorted(from_dir.dropped)
    assert not any(".git/" in p or p.startswith("..") for p in from_tar.entries)


def test_an_image_repository_has_no_commit_after_base(tmp_path):
    """The gold fix, committed after base_commit (and tagged, and on a branch), is not in the repository
    an instance image is built from: not on any ref, not in the reflog, not as a stored object."""
    repo = make_repo(tmp_path / "upstream")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 2  # the gold fix\n")
    git(repo, "commit", "-qam", "gold fix")
    git(repo, "tag", "v-fixed")
    git(repo, "branch", "fix-branch")
    gold_commit = git(repo, "rev-parse", "HEAD").strip()
    gold_blob = git(repo, "rev-parse", "HEAD:pkg/mod.py").strip()
    assert history_after(repo, base) == [gold_commit]  # the check sees it where it is

    dest = tmp_path / "testbed"
    base_only_repo(repo, base, dest)
    assert git(dest, "rev-list", "--all").split() == [base]
    assert git(dest, "log", "--all", "--format=%H").split() == [base]
    assert history_after(dest, base) == []
    assert subprocess.run(["git", "cat-file", "-e", gold_blob], cwd=dest, env=GIT_ENV).returncode != 0
    assert git(dest, "tag") == "" and git(dest, "remote") == ""
    assert git(dest, "status", "--porcelain") == "" and (dest / "pkg" / "mod.py").read_text() == "def f():\n    return 1\n"
