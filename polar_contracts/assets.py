"""Where the bundled data lives: the `polar_data` package (the checkout's `data/` folder, installed
with the wheel), found through importlib.resources so it works from a checkout and from a wheel."""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def data_path(*parts: str) -> Path:
    """A path inside the bundled data, e.g. data_path("tokenizers", "qwen3")."""
    return Path(str(files("polar_data").joinpath(*parts)))


QWEN3_TOKENIZER = data_path("tokenizers", "qwen3")
