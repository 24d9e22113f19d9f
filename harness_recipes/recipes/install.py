"""Install a recipe's harness CLI into its own prefix: <harness cache>/<name>/ (cache.py: in a
checkout `make` puts it in .cache/harnesses/, an installed wheel in ~/.cache/polar/harnesses/).

npm CLIs go in with `npm install --prefix`; PyPI harnesses (mini-swe-agent, aider) get their own
virtual environment there, because their pins conflict with ours and must not break the main
venv's `pip check`. A stamp file records the installed spec so a second call is instant.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from harness_recipes.cache import harness_cache
from harness_recipes.recipes.recipe import Recipe, render

STAMP = ".polar-installed"


class InstallError(RuntimeError):
    pass


def prefix_for(recipe: Recipe) -> Path:
    return harness_cache() / recipe.name


def spec_of(recipe: Recipe) -> str:
    i = recipe.install
    sep = "@" if i.kind == "npm" else "=="
    return f"{i.package}{sep}{i.version}"


def bin_path(recipe: Recipe) -> Path:
    prefix = prefix_for(recipe)
    if recipe.install.kind == "npm":
        return prefix / "node_modules" / ".bin" / recipe.install.bin
    if recipe.install.kind == "pip":
        return prefix / "venv" / "bin" / recipe.install.bin
    found = shutil.which(recipe.install.bin)
    if not found:
        raise InstallError(f"{recipe.name}: install.kind = 'none' but {recipe.install.bin!r} is not on PATH")
    return Path(found)


def _run(argv: list[str], cwd: Path, log) -> None:
    log(f"[install] {' '.join(argv)}")
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise InstallError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{tail}")


def _install_npm(recipe: Recipe, prefix: Path, log) -> None:
    if not shutil.which("npm"):
        raise InstallError(f"{recipe.name}: npm is not installed (apt-get install -y nodejs npm)")
    _run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", spec_of(recipe)], prefix, log)


def _install_pip(recipe: Recipe, prefix: Path, log) -> None:
    venv = prefix / "venv"
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], prefix, log)
    _run([str(venv / "bin" / "pip"), "install", "-q", spec_of(recipe), *recipe.install.extra], prefix, log)


def ensure_installed(recipe: Recipe, log=print) -> Path:
    """Install the harness if its pinned version is not there yet; return the executable's path."""
    if recipe.install.kind == "none":
        return bin_path(recipe)
    prefix = prefix_for(recipe)
    stamp = prefix / STAMP
    want = spec_of(recipe) + "\n" + repr(recipe.install.postinstall)
    exe = bin_path(recipe)
    if stamp.exists() and stamp.read_text() == want and exe.exists():
        return exe
    prefix.mkdir(parents=True, exist_ok=True)
    (_install_npm if recipe.install.kind == "npm" else _install_pip)(recipe, prefix, log)
    for i, argv in enumerate(recipe.install.postinstall):
        _run([render(a, {"prefix": str(prefix)}, f"{recipe.source}: install.postinstall[{i}]") for a in argv], prefix, log)
    if not exe.exists():
        raise InstallError(f"{recipe.name}: installed {spec_of(recipe)} but {exe} does not exist")
    stamp.write_text(want)
    return exe


def installed_version(recipe: Recipe, timeout: float = 60) -> str:
    """`<bin> --version` output: proof the installed CLI starts."""
    exe = ensure_installed(recipe)
    if recipe.install.kind == "pip":
        # Not every PyPI CLI has --version (mini has none): ask the venv's package metadata.
        py = prefix_for(recipe) / "venv" / "bin" / "python"
        code = f"import importlib.metadata as m; print(m.version({recipe.install.package!r}))"
        return subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise InstallError(f"{exe} --version failed ({proc.returncode}): {proc.stderr[-500:]}")
    text = (proc.stdout.strip() or proc.stderr.strip())  # pi prints its version on stderr
    return text.splitlines()[-1] if text else ""
