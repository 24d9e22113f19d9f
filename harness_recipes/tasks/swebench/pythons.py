"""Which Python an instance image built here gets: a Debian suite's python3, or one the user gives.

SWE-bench's specs name a Python per repo and version (3.5 to 3.11); the official images get it from
conda. Polar builds from the Debian archive and PyPI only, and there (measured on this kind of
machine, see docs/swebench.md):
- Debian bullseye's python3 is 3.9 (3.9.2 with bullseye-security's fixes), bookworm's is 3.11;
  buster (3.7) and stretch (3.5) are gone from the archive, no suite has 3.6, 3.8 or 3.10;
- no package registry reachable here ships a CPython 3.5-3.8 or 3.10 build.
So 3.9 and 3.11 come from Debian (DEBIAN); any other version only from a CPython build the user
gives (`--python 3.6=DIR`: DIR/bin/python3.6, e.g. an unpacked python-build-standalone archive or a
pyenv version), copied into the image on the bookworm base at DIR itself: the same path, so a build
that is not relocatable (pyenv's libpython found through an absolute rpath) runs there too. The
libraries it links (libc, libssl, libffi, ...) must be in the base: a build made on a Debian
bookworm host, or a static one, fits. A version neither covers is refused up front with that
reason (`missing`).
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Debian suite whose python3 is that version; the suite is also the image's base.
DEBIAN = {"3.9": "bullseye", "3.11": "bookworm"}
USER_BASE_SUITE = "bookworm"  # a user interpreter is copied onto this base
_VERSION = re.compile(r"^3\.\d{1,2}$")


class PythonError(ValueError):
    """A `--python` value is unusable; the message names it and why."""


@dataclass(frozen=True)
class Interpreter:
    version: str  # "3.9"
    suite: str  # the Debian base of the image
    executable: str  # in the image: "python3" (Debian's) or DIR/bin/pythonX.Y
    source: Path | None = None  # a user's build (DIR), copied into the image at DIR; None for Debian's

    def describe(self) -> str:
        if self.source is None:
            return f"Debian {self.suite} Python {self.version}"
        return f"Python {self.version} from {self.source} on Debian {self.suite}"


def parse_pythons(values) -> dict[str, str]:
    """`--python X.Y=DIR` values (repeatable) -> {"X.Y": "DIR"}, each checked (check_user_python)."""
    out: dict[str, str] = {}
    for value in values or ():
        version, sep, where = str(value).partition("=")
        if not sep or not _VERSION.match(version.strip()) or not where.strip():
            raise PythonError(f"--python {value!r}: expected X.Y=DIR (e.g. 3.6=/opt/cpython-3.6), DIR holding "
                              "bin/pythonX.Y of a relocatable CPython build")
        version = version.strip()
        if version in DEBIAN:
            raise PythonError(f"--python {value!r}: Python {version} comes from Debian {DEBIAN[version]} here; "
                              "a user interpreter is for the versions Debian does not ship")
        out[version] = str(check_user_python(version, Path(where.strip())))
    return out


def check_user_python(version: str, prefix: Path) -> Path:
    """prefix/bin/pythonX.Y exists, runs here and is that version; else PythonError saying which."""
    exe = prefix / "bin" / f"python{version}"
    if not exe.is_file():
        raise PythonError(f"--python {version}={prefix}: no {exe} (give the prefix of a relocatable CPython "
                          f"{version} build, the directory holding bin/python{version})")
    try:
        proc = subprocess.run([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise PythonError(f"--python {version}={prefix}: {exe} does not run here: {e}") from None
    if proc.returncode != 0 or proc.stdout.strip() != version:
        raise PythonError(f"--python {version}={prefix}: {exe} says it is Python {proc.stdout.strip() or '?'} "
                          f"(exit {proc.returncode}{': ' + proc.stderr.strip()[-200:] if proc.stderr.strip() else ''})")
    return prefix.resolve()


def missing(version: str) -> str:
    """Why a spec's Python cannot be had here (the refusal)."""
    have = ", ".join(f"{v} ({s})" for v, s in DEBIAN.items())
    return (f"needs Python {version}; the Debian bases ship Python {have} and no registry reachable here has "
            f"{version}: give --python {version}=DIR (a relocatable CPython {version} build) or use the official image")


def interpreter(version: str, given: dict[str, str] | None = None) -> Interpreter | None:
    """The interpreter for a spec's Python version, or None when there is none (see `missing`)."""
    if version in DEBIAN:
        return Interpreter(version, DEBIAN[version], "python3")
    where = (given or {}).get(version)
    if where:
        return Interpreter(version, USER_BASE_SUITE, f"{where}/bin/python{version}", Path(where))
    return None
