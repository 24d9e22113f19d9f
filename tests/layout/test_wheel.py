"""The product installs: a wheel built from a copy of the checkout, installed (not editable) into a
fresh virtual environment, works from a directory outside the checkout.

The fresh environment gets the project's dependencies from the test environment through a .pth
line (installing torch, TRL and vLLM's neighbours again would take minutes and the network); the
project itself comes only from the wheel: the test checks that every package is imported from the
new environment, never from the checkout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("polar_contracts", "addon", "polar_recon", "polar_serve", "trainer", "harness_recipes", "polar_data")


def _run(cmd, cwd, env, timeout=300):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    # a copy of what git would clone (tracked and untracked-but-not-ignored files), so the build
    # never writes into the checkout and never sees its ignored files (.venv, .cache, build/)
    src = tmp / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"),
          str(src)], tmp, env)
    wheel = next((tmp / "dist").glob("polar-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env)
    vpy = venv / "bin" / "python"
    site = Path(_run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp, env).strip())
    (site / "polar_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-deps", str(wheel)], tmp, env)
    work = tmp / "elsewhere"
    work.mkdir()
    return venv, work, env


def test_packages_come_from_the_wheel(installed):
    venv, work, env = installed
    code = f"import json, importlib; print(json.dumps({{p: importlib.import_module(p).__file__ for p in {PACKAGES!r}}}))"
    where = json.loads(_run([str(venv / "bin" / "python"), "-c", code], work, env))
    for pkg, path in where.items():
        assert Path(path).resolve().is_relative_to(venv.resolve()), f"{pkg} imported from {path}, not the wheel"


@pytest.mark.parametrize("script", ["polar-recon", "polar-rollout", "polar-serve", "polar-train"])
def test_console_scripts_run(installed, script):
    venv, work, env = installed
    out = _run([str(venv / "bin" / script), "--help"], work, env)
    assert "usage" in out.lower()


def test_bundled_recipes_are_listed_and_load(installed):
    venv, work, env = installed
    names = _run([str(venv / "bin" / "polar-rollout"), "recipes"], work, env).split()
    assert {"pi", "qwen-code", "codex", "claude-code"} <= set(names)
    code = "from harness_recipes.recipes.recipe import load_recipe; r = load_recipe('pi'); print(r.name)"
    assert _run([str(venv / "bin" / "python"), "-c", code], work, env).strip() == "pi"


def test_make_tiny_finds_the_packaged_tokenizer(installed):
    venv, work, env = installed
    _run([str(venv / "bin" / "polar-serve"), "--make-tiny", str(work / "tiny")], work, env)
    assert (work / "tiny" / "tokenizer.json").is_file() and (work / "tiny" / "model.safetensors").is_file()


def test_python_m_addon_prints_the_script_path(installed):
    venv, work, env = installed
    path = Path(_run([str(venv / "bin" / "python"), "-m", "addon"], work, env).strip())
    assert path.name == "polar_addon.py" and path.is_file() and path.resolve().is_relative_to(venv.resolve())
    # the script mitmdump loads by path imports from the installed packages
    out = _run([str(venv / "bin" / "python"), "-c", f"import runpy; m = runpy.run_path({str(path)!r}); print(sorted(m))"],
               work, env)
    assert "addons" in out
