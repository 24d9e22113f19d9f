"""``python -m addon``: the absolute path of the capture addon's script, for ``mitmdump -s``.

    mitmdump -s "$(python -m addon)" --mode reverse:http://127.0.0.1:8000 --set polar_logdir=logs

(Run it with the Python of mitmdump's environment, where the project is installed.)
"""
from __future__ import annotations

from importlib.resources import files


def script_path() -> str:
    return str(files("addon").joinpath("polar_addon.py"))


if __name__ == "__main__":
    print(script_path())
