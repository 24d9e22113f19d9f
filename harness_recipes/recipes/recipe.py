"""Harness recipes: one declarative TOML file per harness, loaded and validated here.

A recipe says how to install the CLI, which config files and environment one episode needs
(templates filled per episode), the command line for one non-interactive task, the API it speaks,
how the episode id reaches the proxy, and which of its calls are auxiliary. Templates use
``${name}`` placeholders (``string.Template``) so JSON and TOML bodies need no escaping; an
unknown placeholder is an error naming the recipe and the field, never a silent blank.
"""
from __future__ import annotations

import re
import string
import tomllib
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from polar_contracts.auxiliary import AuxiliaryRuleError, parse_rule

from .limits import Limits

APIS = ("chat", "completions", "responses", "messages", "gemini")
INSTALL_KINDS = ("npm", "pip", "none")
EPISODE_VIA = ("header", "path")
# What every template may name. Filled by `episode_vars` for each episode.
TEMPLATE_VARS = (
    "bin", "prefix", "home", "workspace", "prompt", "model", "api_key", "episode",
    "proxy", "base_url", "episode_header", "task_id",
)


class RecipeError(ValueError):
    """A recipe file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Install:
    kind: str
    package: str = ""
    version: str = ""
    bin: str = ""  # executable name inside the install prefix
    postinstall: tuple[tuple[str, ...], ...] = ()  # argv lists run in the prefix, templated with ${prefix}
    extra: tuple[str, ...] = ()  # extra pip requirements installed with the package


@dataclass(frozen=True)
class ConfigFile:
    path: str  # template, usually under ${home}
    content: str  # template


@dataclass(frozen=True)
class Auxiliary:
    """A kind of call that is recorded but is not part of the agent's trajectory."""

    name: str
    why: str
    match: dict[str, Any]


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    api: str
    install: Install
    episode_via: str
    episode_header: str
    argv: tuple[str, ...]
    env: dict[str, str]
    files: tuple[ConfigFile, ...]
    stdin: str  # "null": stdin closed (Codex waits on an open stdin)
    quiet: tuple[str, ...]  # the switches (env or config keys) that stop telemetry/update checks
    auxiliary: tuple[Auxiliary, ...]
    source: Path = field(default=Path("."))
    # [run] model_callers: names (executable file name or comm) of the harness's direct children that
    # call the model themselves (a native binary behind a node launcher, a relaunched CLI). Everything
    # else the harness starts, its shell tool's commands included, is refused (inner_forwarder.py).
    model_callers: tuple[str, ...] = ()
    # [limits]: this harness's sandbox limits where the defaults do not suit it (limits.py: memory,
    # pids, cpus, disk), as written; the command line overrides them.
    limits: dict[str, Any] = field(default_factory=dict)

    def render(self, template: str, values: dict[str, str], where: str) -> str:
        return render(template, values, f"{self.source}: {where}")

    def render_argv(self, values: dict[str, str]) -> list[str]:
        return [self.render(a, values, f"run.argv[{i}]") for i, a in enumerate(self.argv)]

    def render_env(self, values: dict[str, str]) -> dict[str, str]:
        return {k: self.render(v, values, f"env.{k}") for k, v in self.env.items()}

    def render_files(self, values: dict[str, str]) -> list[tuple[str, str]]:
        return [
            (self.render(f.path, values, f"files[{i}].path"), self.render(f.content, values, f"files[{i}].content"))
            for i, f in enumerate(self.files)
        ]


def render(template: str, values: dict[str, str], where: str) -> str:
    try:
        return string.Template(template).substitute(values)
    except KeyError as e:
        raise RecipeError(f"{where}: unknown placeholder ${{{e.args[0]}}} (known: {', '.join(TEMPLATE_VARS)})") from None
    except ValueError as e:
        raise RecipeError(f"{where}: bad placeholder syntax ({e}); write $$ for a literal $") from None


def _need(table: dict, key: str, kind: type, where: str) -> Any:
    if key not in table:
        raise RecipeError(f"{where}: missing required key {key!r}")
    value = table[key]
    if not isinstance(value, kind):
        raise RecipeError(f"{where}: {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _choice(value: str, options: tuple[str, ...], where: str) -> str:
    if value not in options:
        raise RecipeError(f"{where}: {value!r} is not one of {', '.join(options)}")
    return value


def _check_templates(recipe: Recipe) -> None:
    """Render every template with dummy values now, so a typo fails at load time, not mid-run."""
    dummy = {k: f"<{k}>" for k in TEMPLATE_VARS}
    recipe.render_argv(dummy)
    recipe.render_env(dummy)
    recipe.render_files(dummy)


def _install(table: dict, where: str) -> Install:
    kind = _choice(_need(table, "kind", str, where), INSTALL_KINDS, f"{where}.kind")
    if kind == "none":
        return Install(kind="none", bin=table.get("bin", ""))
    post = table.get("postinstall", [])
    if not all(isinstance(p, list) and all(isinstance(a, str) for a in p) for p in post):
        raise RecipeError(f"{where}.postinstall: must be a list of argv lists of strings")
    version = _need(table, "version", str, where)
    if not re.fullmatch(r"\d+(\.\d+)*([.+-][A-Za-z0-9.+-]+)?", version):
        raise RecipeError(f"{where}.version: pin an exact version (got {version!r})")
    return Install(
        kind=kind,
        package=_need(table, "package", str, where),
        version=version,
        bin=_need(table, "bin", str, where),
        postinstall=tuple(tuple(p) for p in post),
        extra=tuple(table.get("extra", [])),
    )


TOP_KEYS = {"name", "description", "api", "quiet", "install", "episode", "env", "files", "run", "auxiliary", "limits"}
RUN_KEYS = {"argv", "stdin", "model_callers"}


def _no_unknown(table: dict, known: set[str], where: str) -> None:
    # A misplaced key (e.g. one written after a [table] header in TOML) must not vanish silently.
    extra = sorted(set(table) - known)
    if extra:
        raise RecipeError(f"{where}: unknown key(s) {', '.join(extra)} (allowed: {', '.join(sorted(known))})")


def parse_recipe(data: dict, source: Path) -> Recipe:
    where = str(source)
    _no_unknown(data, TOP_KEYS, where)
    episode = _need(data, "episode", dict, where)
    run = _need(data, "run", dict, where)
    _no_unknown(run, RUN_KEYS, f"{where} [run]")
    env = data.get("env", {})
    if not all(isinstance(v, str) for v in env.values()):
        raise RecipeError(f"{where}: every [env] value must be a string")
    files = tuple(
        ConfigFile(path=_need(f, "path", str, f"{where} files[{i}]"), content=_need(f, "content", str, f"{where} files[{i}]"))
        for i, f in enumerate(data.get("files", []))
    )
    aux = tuple(
        Auxiliary(name=_need(a, "name", str, f"{where} auxiliary[{i}]"), why=a.get("why", ""), match=a.get("match", {}))
        for i, a in enumerate(data.get("auxiliary", []))
    )
    for i, a in enumerate(aux):  # the rule's own checks (unknown match keys are errors, not ignored)
        try:
            parse_rule({"name": a.name, "match": a.match}, f"{where} auxiliary[{i}]")
        except AuxiliaryRuleError as exc:
            raise RecipeError(str(exc)) from exc
    via = _choice(_need(episode, "via", str, f"{where} [episode]"), EPISODE_VIA, f"{where} [episode].via")
    callers = run.get("model_callers", [])
    if not isinstance(callers, list) or not all(isinstance(c, str) and re.fullmatch(r"[A-Za-z0-9._+-]{1,64}", c)
                                                for c in callers):
        raise RecipeError(f"{where} [run].model_callers: a list of executable names (letters, digits, . _ + -), "
                          f"got {callers!r}")
    limits = data.get("limits", {})
    try:
        Limits().merged(_need(data, "limits", dict, where) if "limits" in data else {})
    except ValueError as exc:
        raise RecipeError(f"{where} [limits]: {exc}") from None
    recipe = Recipe(
        name=_need(data, "name", str, where),
        description=data.get("description", ""),
        api=_choice(_need(data, "api", str, where), APIS, f"{where} api"),
        install=_install(_need(data, "install", dict, where), f"{where} [install]"),
        episode_via=via,
        episode_header=episode.get("header", "x-polar-episode"),
        argv=tuple(_need(run, "argv", list, f"{where} [run]")),
        env=dict(env),
        files=files,
        stdin=_choice(run.get("stdin", "null"), ("null",), f"{where} [run].stdin"),
        quiet=tuple(data.get("quiet", [])),
        auxiliary=aux,
        source=source,
        model_callers=tuple(callers),
        limits=dict(limits),
    )
    if not recipe.argv:
        raise RecipeError(f"{where} [run].argv: empty command line")
    _check_templates(recipe)
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    """Load a recipe by path, or by bare name (``pi``: the bundled ``pi.toml`` of this package)."""
    p = Path(path)
    if not p.suffix and not p.exists():
        p = bundled_path(str(path))
    if not p.is_file():
        raise RecipeError(f"recipe not found: {path} (bundled: {', '.join(bundled_names())})")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{p}: not valid TOML: {e}") from None
    return parse_recipe(data, p)


def bundled_path(name: str) -> Path:
    """Where the bundled recipe `name` is (package data of harness_recipes, checkout or wheel)."""
    return Path(str(files(__package__).joinpath(f"{name}.toml")))


def bundled_names() -> list[str]:
    """The bundled recipes' names (``polar-rollout recipes`` lists them)."""
    return sorted(f.name.removesuffix(".toml") for f in files(__package__).iterdir() if f.name.endswith(".toml"))
