"""`polar-recon show --html`: the page, and what headless Chromium draws of it."""
import shutil
import subprocess
import tempfile

import pytest
from click.testing import CliRunner

from polar_recon.cli import main

from . import logs as L
from . import png


def _episode(d):
    def run(c):
        L.auxiliary_call(c.w)
        c.call(L.Sample("", "", [L.write_tool()]), results=["ok"])
        c.call(L.Sample("", "Done.", []))
    return L.episode(d, "view", run, harness="qwen-code", tools=None, system="Be brief.")


def test_show_writes_a_page_with_spans_turns_and_links(tmp_path):
    conv = _episode(tmp_path)
    r = CliRunner().invoke(main, ["show", "view", "--logdir", str(tmp_path), "--html", str(tmp_path / "v.html")])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "v.html").read_text()
    n_trainable = sum(len(x.completion_ids) for x in conv.recorded)
    assert page.count("class='t1'") == n_trainable  # one highlighted span per sampled token
    assert "call 1 &middot; FORK" in page and "call 2 &middot; REALIGN (1 turn)" in page
    assert "assistant turn @" in page and "<tr class='row-AUX'>" in page
    assert "logprob" in page and "hsl(" in page


def test_screenshot_in_headless_chromium(tmp_path):
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        msg = "chromium not installed (apt-get install -y chromium chromium-driver); screenshot test skipped"
        print(msg)
        pytest.skip(msg)
    _episode(tmp_path)
    page, shot = tmp_path / "v.html", tmp_path / "v.png"
    assert CliRunner().invoke(main, ["show", str(tmp_path / "view.arrow"), "--html", str(page)]).exit_code == 0
    profile = tempfile.mkdtemp(dir=tmp_path)
    r = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1200,800", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert shot.exists(), r.stderr[-2000:]
    img = png.decode(shot.read_bytes())[..., :3].astype(int)
    assert img.shape[:2] == (800, 1200)
    r_, g, b = img[..., 0], img[..., 1], img[..., 2]
    green = (g > r_ + 40) & (g > b + 40)  # sampled tokens the model found likely, CLEAN badges
    orange = (r_ > 200) & (g > 110) & (g < 160) & (b < 40)  # the REALIGN badge / link cell
    blue = (b > 180) & (r_ < 80) & (g > 100) & (g < 140)  # the FORK badge
    assert green.sum() > 500, "no highlighted trainable tokens in the screenshot"
    assert orange.sum() > 50 and blue.sum() > 50, "link kinds not drawn"
    assert (img.std(axis=(0, 1)) > 5).all()  # not a blank page
