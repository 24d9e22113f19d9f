"""ensure_installed for every bundled recipe: the pinned CLI is installed and starts.

The first run needs the npm registry / PyPI (CI installs them in .ci/run first); later runs use
.cache/harnesses/ and take seconds.
"""
import pytest

from harness_recipes.recipes.install import bin_path, ensure_installed, installed_version
from harness_recipes.recipes.recipe import bundled_names, load_recipe

EXPECT = {"codex": "0.171.0", "claude-code": "2.1.197", "qwen-code": "0.15.10", "pi": "0.73.1",
          "mini-swe-agent": "2.4.6", "aider": "0.86.2", "gemini-cli": "0.61.0", "opencode": "1.18.33"}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_installed_cli_reports_the_pinned_version(name):
    recipe = load_recipe(name)
    exe = ensure_installed(recipe, log=print)
    assert exe == bin_path(recipe) and exe.exists()
    assert EXPECT[name] in installed_version(recipe)


def test_every_bundled_recipe_is_covered():
    assert set(bundled_names()) == set(EXPECT)


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_every_bundled_recipe_pins_its_whole_dependency_tree(name):
    """A pinned CLI with floating dependencies broke a fresh install once (a transitive npm package
    asked for a version the registry did not have): every bundled recipe ships the lock of its tree."""
    import json

    from harness_recipes.recipes.install import lock_file
    recipe = load_recipe(name)
    lock = lock_file(recipe)
    assert lock is not None, f"{name}: no lock file beside {recipe.source}"
    if recipe.install.kind == "npm":
        locked = json.loads(lock.read_text())["packages"]
        assert locked[""]["dependencies"] == {recipe.install.package: recipe.install.version}
        assert locked[f"node_modules/{recipe.install.package}"]["version"] == recipe.install.version
    else:
        pins = [ln for ln in lock.read_text().splitlines() if ln and not ln.startswith("#")]
        assert pins and all("==" in ln for ln in pins), f"{lock}: every line must pin one version"


def test_an_npm_lock_that_disagrees_with_the_recipe_is_refused(tmp_path, monkeypatch):
    import dataclasses
    import shutil

    from harness_recipes.recipes.install import InstallError, _install_npm, lock_file
    recipe = load_recipe("codex")
    src = tmp_path / "codex.toml"
    shutil.copyfile(recipe.source, src)
    shutil.copyfile(lock_file(recipe), tmp_path / "codex.package-lock.json")
    other = dataclasses.replace(recipe, source=src,
                                install=dataclasses.replace(recipe.install, version="0.170.0"))
    with pytest.raises(InstallError, match="locks .* but the recipe asks for @openai/codex@0.170.0"):
        _install_npm(other, tmp_path / "prefix", log=print)
