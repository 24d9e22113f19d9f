"""ensure_installed for every bundled recipe: the pinned CLI is installed and starts.

The first run needs the npm registry / PyPI (CI installs them in .ci/run first); later runs use
.cache/harnesses/ and take seconds.
"""
import pytest

from harness_recipes.recipes.install import bin_path, ensure_installed, installed_version
from harness_recipes.recipes.recipe import bundled_names, load_recipe

EXPECT = {"codex": "0.171.0", "claude-code": "2.1.197", "qwen-code": "0.15.10", "pi": "0.73.1",
          "mini-swe-agent": "2.4.6", "aider": "0.86.2"}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_installed_cli_reports_the_pinned_version(name):
    recipe = load_recipe(name)
    exe = ensure_installed(recipe, log=print)
    assert exe == bin_path(recipe) and exe.exists()
    assert EXPECT[name] in installed_version(recipe)


def test_every_bundled_recipe_is_covered():
    assert set(bundled_names()) == set(EXPECT)
