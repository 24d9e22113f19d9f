"""Every command block in the docs is either run by a test or says why not (tests/docs/fenced.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from .fenced import REPO, blocks, command_blocks, doc_files


def problems(bs, repo: Path = REPO) -> list[str]:
    out = []
    for b in bs:
        if b.marker is None:
            out.append(f"{b.where()}: a {b.lang} block with no marker: put <!-- run: tests/docs/TEST.py --> (a "
                       f"test runs it) or <!-- not-run: REASON --> on the line before it")
            continue
        kind, arg = b.marker
        if kind == "not-run" and not arg:
            out.append(f"{b.where()}: <!-- not-run: --> without a reason")
        if kind == "run":
            test = repo / arg
            if not (arg.startswith("tests/") and test.is_file()):
                out.append(f"{b.where()}: <!-- run: {arg} --> names no test file of the repository")
            elif b.path not in test.read_text(encoding="utf-8"):
                out.append(f"{b.where()}: <!-- run: {arg} --> but that test never names {b.path}")
    return out


def test_every_command_block_is_run_or_says_why_not():
    bad = [p for f in doc_files() for p in problems(command_blocks(f))]
    assert not bad, "\n".join(bad)


def test_the_docs_have_blocks_run_by_tests():
    runs = {b.path for f in doc_files() for b in command_blocks(f) if b.marker and b.marker[0] == "run"}
    assert {"README.md", "docs/rollout.md"} <= runs


PLANTED = """# Page
## Start
<!-- run: tests/docs/test_quickstarts.py -->
```bash
echo ok
```
<!-- not-run: needs a GPU -->

```bash
nvidia-smi
```
```bash
echo unmarked
```
<!-- not-run: -->
```sh
echo no reason
```
<!-- run: tests/docs/no_such_test.py -->
```console
echo nowhere
```
```toml
not = "a command"
```
"""


def test_each_check_on_planted_text():
    bs = blocks(PLANTED, "planted-page")
    assert [(b.lang, b.section, b.marker) for b in bs] == [
        ("bash", "Start", ("run", "tests/docs/test_quickstarts.py")), ("bash", "Start", ("not-run", "needs a GPU")),
        ("bash", "Start", None), ("sh", "Start", ("not-run", "")),
        ("console", "Start", ("run", "tests/docs/no_such_test.py")), ("toml", "Start", None)]
    assert bs[1].text == "nvidia-smi\n" and bs[0].line == 4
    got = problems([b for b in bs if b.lang != "toml"])
    assert len(got) == 4, got
    assert "never names planted-page" in got[0]  # the quickstart test does not run this page
    assert "planted-page:12: a bash block with no marker" in got[1]
    assert "without a reason" in got[2] and "names no test file" in got[3]


@pytest.mark.parametrize("fence", ["```", "~~~~"])
def test_indented_and_tilde_fences(fence):
    text = f"- item\n\n  <!-- not-run: an example -->\n  {fence}bash\n  ls -l\n  {fence}\n"
    (b,) = blocks(text)
    assert b.marker == ("not-run", "an example") and b.text == "ls -l\n"


def test_the_readme_installs_as_the_reference_and_the_makefile_do():
    """torch first, at the one version setup.cfg pins (a plain `pip install .` may pull a CUDA build)."""
    pin = re.search(r"^\s*torch==([\d.]+)\s*$", (REPO / "setup.cfg").read_text(), re.M).group(1)
    (install,) = [b for b in command_blocks(REPO / "README.md") if "pip install ." in b.text]
    assert f"pip install torch=={pin} && pip install ." in install.text
    assert f"pip install torch=={pin}" in (REPO / "docs" / "reference.md").read_text()
    assert f"pip install -q torch=={pin}" in (REPO / "Makefile").read_text()


def test_a_documented_proxy_holds_the_secret_its_rollout_passes():
    """A block that starts a capture proxy and passes --control-secret-file X starts that proxy with
    polar_control_secret_file=X (run or not: docs/swebench.md's quick start once did not)."""
    bad = []
    for f in doc_files():
        for b in command_blocks(f):
            text = b.text.replace("\\\n", " ")
            passed = set(re.findall(r"--control-secret-file\s+(\S+)", text))
            if "mitmdump" in text and passed:
                given = set(re.findall(r"polar_control_secret_file=(\S+)", text))
                if passed - given:
                    bad.append(f"{b.where()}: passes --control-secret-file {sorted(passed - given)} to a proxy "
                               f"started with {sorted(given) or 'no secret'}")
    assert not bad, "\n".join(bad)
