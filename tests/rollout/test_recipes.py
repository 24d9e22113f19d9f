import json
import tomllib

import pytest

from harness_recipes.recipes.recipe import TEMPLATE_VARS, RecipeError, bundled_names, load_recipe, parse_recipe

NPM = {"codex": "0.171.0", "claude-code": "2.1.197", "qwen-code": "0.15.10", "pi": "0.73.1", "gemini-cli": "0.61.0",
       "opencode": "1.18.33"}
VALUES = {k: f"v-{k}" for k in TEMPLATE_VARS} | {"base_url": "http://127.0.0.1:9", "episode": "ep.1",
                                                  "episode_header": "x-polar-episode"}


def test_all_eight_recipes_are_bundled_and_load():
    assert {"codex", "claude-code", "qwen-code", "pi", "mini-swe-agent", "aider", "gemini-cli",
            "opencode"} <= set(bundled_names())
    for name in bundled_names():
        r = load_recipe(name)
        assert r.name == name
        assert r.install.kind in ("npm", "pip")
        assert r.quiet, f"{name}: names no switches that stop telemetry/update checks"


@pytest.mark.parametrize("name,version", sorted(NPM.items()))
def test_npm_recipes_pin_the_observed_versions(name, version):
    r = load_recipe(name)
    assert r.install.kind == "npm" and r.install.version == version


def test_episode_id_reaches_every_harness_config():
    # Whatever the mechanism (header in a config file, env var, URL path), the episode id must be in it.
    for name in bundled_names():
        r = load_recipe(name)
        rendered = json.dumps([r.render_argv(VALUES), r.render_env(VALUES), r.render_files(VALUES)])
        if r.episode_via == "path":
            assert "/polar/" in r.render("${base_url}", VALUES | {"base_url": "http://h/polar/ep.1"}, "t")
        assert "ep.1" in rendered or r.episode_via == "path", name


def test_rendered_config_files_parse():
    for name in ("pi", "qwen-code"):
        (path, content), = load_recipe(name).render_files(VALUES)
        data = json.loads(content)
        assert "ep.1" in json.dumps(data)
    (path, content), = load_recipe("codex").render_files(VALUES)
    cfg = tomllib.loads(content)
    assert cfg["model_providers"]["polar"]["wire_api"] == "responses"
    assert cfg["model_providers"]["polar"]["env_http_headers"] == {"x-polar-episode": "POLAR_EPISODE"}
    assert cfg["analytics"]["enabled"] is False and cfg["otel"]["exporter"] == "none"
    env = load_recipe("claude-code").render_env(VALUES)
    assert env["ANTHROPIC_CUSTOM_HEADERS"] == "x-polar-episode: ep.1"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"



def test_gemini_cli_and_opencode_configs():
    r = load_recipe("gemini-cli")
    assert r.api == "gemini" and r.episode_via == "path"
    env = r.render_env(VALUES | {"base_url": "http://127.0.0.1:9/polar/ep.1"})
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:9/polar/ep.1"  # the SDK appends /v1beta/...
    assert env["GEMINI_API_KEY"] == VALUES["api_key"] and env["GEMINI_TELEMETRY_ENABLED"] == "false"
    (path, content), = r.render_files(VALUES)
    settings = json.loads(content)
    assert settings["telemetry"]["enabled"] is False and settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["general"]["enableAutoUpdate"] is False
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    argv = r.render_argv(VALUES)
    assert "--yolo" in argv and argv[argv.index("--prompt") + 1] == VALUES["prompt"]

    r = load_recipe("opencode")
    (path, content), = r.render_files(VALUES)
    cfg = json.loads(content)
    provider = cfg["provider"]["polar"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"  # bundled in the binary: nothing fetched
    assert provider["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    assert provider["options"]["headers"] == {"x-polar-episode": "ep.1"}
    assert cfg["autoupdate"] is False and cfg["share"] == "disabled" and cfg["enabled_providers"] == ["polar"]
    env = r.render_env(VALUES)
    assert env["OPENCODE_DISABLE_AUTOUPDATE"] == env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    assert env["npm_config_registry"].startswith("http://127.0.0.1:")  # its background npm install: loopback


def _base():
    return {"name": "x", "api": "chat", "install": {"kind": "npm", "package": "p", "version": "1.0.0", "bin": "x"},
            "episode": {"via": "header"}, "run": {"argv": ["${bin}", "${prompt}"]}}


def test_unknown_placeholder_is_named(tmp_path):
    d = _base()
    d["run"]["argv"] = ["${bin}", "${promt}"]
    with pytest.raises(RecipeError, match=r"run.argv\[1\].*\$\{promt\}"):
        parse_recipe(d, tmp_path / "x.toml")


def test_misplaced_key_is_refused(tmp_path):
    d = _base()
    d["run"]["quiet"] = ["A=1"]  # what TOML does with a key written after [run]
    with pytest.raises(RecipeError, match="unknown key.*quiet"):
        parse_recipe(d, tmp_path / "x.toml")


@pytest.mark.parametrize("version", ["^1.0.0", "latest", "", ">=1"])
def test_unpinned_version_is_refused(tmp_path, version):
    d = _base()
    d["install"]["version"] = version
    with pytest.raises(RecipeError, match="pin an exact version"):
        parse_recipe(d, tmp_path / "x.toml")


def test_bad_api_and_missing_file(tmp_path):
    d = _base()
    d["api"] = "grpc"
    with pytest.raises(RecipeError, match="'grpc' is not one of"):
        parse_recipe(d, tmp_path / "x.toml")
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)
