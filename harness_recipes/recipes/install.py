"""Install a recipe's harness CLI into its own prefix: <harness cache>/<name>/ (cache.py: in a
checkout `make` puts it in .cache/harnesses/, an installed wheel in ~/.cache/polar/harnesses/).

npm CLIs go in with `npm ci --prefix` from the lockfile next to the recipe (<name>.package-lock.json);
PyPI harnesses (mini-swe-agent, aider) get their own virtual environment there, because their pins
conflict with ours and must not break the main venv's `pip check`, installed under the constraints
file next to the recipe (<name>.constraints.txt). Pinning the CLI alone is not enough: its
dependencies float, and one new release (or a registry that lacks it) breaks every fresh install, so
the whole tree is pinned. A recipe without a lock file installs the way npm/pip resolve it today,
and says so. A stamp file records what was installed so a second call is instant.
"""
from __future__ import annotations

import hashlib
import json
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


def lock_file(recipe: Recipe) -> Path | None:
    """The file that pins the recipe's whole dependency tree, if the recipe ships one."""
    suffix = ".package-lock.json" if recipe.install.kind == "npm" else ".constraints.txt"
    path = Path(recipe.source).with_name(recipe.name + suffix)
    return path if path.is_file() else None


def _run(argv: list[str], cwd: Path, log) -> None:
    log(f"[install] {' '.join(argv)}")
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise InstallError(f"command failed ({proc.returncode}): {' '.join(argv)}\n{tail}")


def _install_npm(recipe: Recipe, prefix: Path, log) -> None:
    if not shutil.which("npm"):
        raise InstallError(f"{recipe.name}: npm is not installed (apt-get install -y nodejs npm)")
    lock = lock_file(recipe)
    if lock is None:
        log(f"[install] {recipe.name}: no {recipe.name}.package-lock.json beside {recipe.source}: "
            "dependencies resolve to whatever the registry has today")
        _run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", spec_of(recipe)], prefix, log)
        return
    locked = json.loads(lock.read_text())
    root = locked.get("packages", {}).get("", {}).get("dependencies", {})
    if root != {recipe.install.package: recipe.install.version}:
        raise InstallError(f"{lock}: locks {root}, but the recipe asks for {spec_of(recipe)}; "
                           "regenerate the lock file (npm install --package-lock-only) or fix the version")
    (prefix / "package.json").write_text(json.dumps({"dependencies": root}, indent=2) + "\n")
    shutil.copyfile(lock, prefix / "package-lock.json")
    # `npm install` with the lock in place, not `npm ci`: ci refuses locks in which npm itself left
    # out other platforms' optional packages (qwen-code's clipboard binaries). Install keeps every
    # locked version; the check below proves it did.
    _run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund"], prefix, log)
    drift = _lock_drift(locked, json.loads((prefix / "package-lock.json").read_text()))
    if drift:
        raise InstallError(f"{recipe.name}: npm installed other versions than {lock} pins: "
                           + ", ".join(f"{k} {a} -> {b}" for k, a, b in drift[:10]))


def _lock_drift(want: dict, got: dict) -> list[tuple[str, str | None, str | None]]:
    a, b = want.get("packages", {}), got.get("packages", {})
    return [(k, a.get(k, {}).get("version"), b.get(k, {}).get("version")) for k in sorted(set(a) | set(b))
            if k and a.get(k, {}).get("version") != b.get(k, {}).get("version")]


def _install_pip(recipe: Recipe, prefix: Path, log) -> None:
    venv = prefix / "venv"
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], prefix, log)
    lock = lock_file(recipe)
    pinned = ["-c", str(lock)] if lock else []
    if lock is None:
        log(f"[install] {recipe.name}: no {recipe.name}.constraints.txt beside {recipe.source}: "
            "dependencies resolve to whatever the index has today")
    _run([str(venv / "bin" / "pip"), "install", "-q", *pinned, spec_of(recipe), *recipe.install.extra], prefix, log)


def ensure_installed(recipe: Recipe, log=print) -> Path:
    """Install the harness if its pinned version is not there yet; return the executable's path."""
    if recipe.install.kind == "none":
        return bin_path(recipe)
    prefix = prefix_for(recipe)
    stamp = prefix / STAMP
    lock = lock_file(recipe)
    lock_hash = hashlib.sha256(lock.read_bytes()).hexdigest() if lock else "unlocked"
    want = spec_of(recipe) + "\n" + repr(recipe.install.postinstall) + "\n" + lock_hash
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
