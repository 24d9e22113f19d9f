"""The real Claude Code, Codex CLI and Gemini CLI binaries complete "create hello.txt containing hi" against a
scripted model that speaks to them only through the translators (no proxy, no server).

The binaries are the ones harness_recipes.recipes.install.ensure_installed puts in .cache/harnesses/<name>/
(@anthropic-ai/claude-code 2.1.197, @openai/codex 0.171.0, @google/gemini-cli 0.61.0); without them these tests skip and say
so. Each run takes a few seconds.
"""
from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from harness_recipes.cache import harness_cache
from tests.translate.scripted_model import ScriptedModel

CACHE = harness_cache()  # $POLAR_HARNESS_CACHE, else $POLAR_CACHE/harnesses, as the installer uses
PROMPT = "create hello.txt containing hi"


def _binary(name: str, exe: str) -> pathlib.Path:
    path = CACHE / name / "node_modules" / ".bin" / exe
    if not path.exists():
        pytest.skip(f"{name} is not installed at {path} "
                    "(harness_recipes.recipes.install.ensure_installed installs it)")
    return path


def _env(home: pathlib.Path, **extra: str) -> dict:
    # A clean environment: no proxy variables (both CLIs would send loopback traffic to a proxy).
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "NO_PROXY": "127.0.0.1,localhost"}
    env.update(extra)
    return env


def _run(argv, cwd, env, timeout=150) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def _check(model: ScriptedModel, proc, work: pathlib.Path, api: str) -> None:
    detail = f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert not model.errors, model.errors
    assert proc.returncode == 0, detail
    assert (work / "hello.txt").read_text().strip() == "hi", detail
    agent = [c for c in model.calls if not c["auxiliary"]]
    assert len(agent) >= 2, detail
    # The second call carries the first answer back: reasoning, the tool call and its result.
    second = agent[1]["chat"]["messages"]
    assistant = [m for m in second if m["role"] == "assistant"][-1]
    assert assistant["reasoning_content"] == "I will write the file with the shell."
    assert assistant["tool_calls"][0]["function"]["name"] in ("Bash", "exec_command", "run_shell_command")
    assert second[-1]["role"] == "tool"
    assert "Done: hello.txt contains hi." in proc.stdout, detail
    assert all(c["path"].split("?")[0].endswith(api) for c in model.calls)


def test_claude_code_completes_a_task_through_the_messages_translator(tmp_path):
    claude = _binary("claude-code", "claude")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(), home.mkdir()
    with ScriptedModel() as model:
        env = _env(home, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{model.port}",
                   ANTHROPIC_API_KEY="test-key", ANTHROPIC_MODEL="qwen3-test",
                   ANTHROPIC_SMALL_FAST_MODEL="qwen3-test",
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
                   DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", IS_SANDBOX="1")
        proc = _run([claude, "-p", "--dangerously-skip-permissions", "--output-format",
                     "stream-json", "--verbose", PROMPT], work, env)
    _check(model, proc, work, "/v1/messages")
    assert any("billing-header" in n for c in model.calls for n in c["notes"])


def test_codex_completes_a_task_through_the_responses_translator(tmp_path):
    codex = _binary("codex", "codex")
    work, home = tmp_path / "work", tmp_path / "home"
    (home / ".codex").mkdir(parents=True), work.mkdir()
    with ScriptedModel() as model:
        (home / ".codex" / "config.toml").write_text(f"""
model = "qwen3-test"
model_provider = "polar"
model_reasoning_effort = "low"

[model_providers.polar]
name = "polar"
base_url = "http://127.0.0.1:{model.port}/v1"
env_key = "POLAR_API_KEY"
wire_api = "responses"

[features]
plugins = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
""")
        env = _env(home, CODEX_HOME=str(home / ".codex"), POLAR_API_KEY="test-key")
        proc = _run([codex, "exec", "--dangerously-bypass-approvals-and-sandbox",
                     "--skip-git-repo-check", "--json", PROMPT], work, env)
    _check(model, proc, work, "/v1/responses")


def test_gemini_cli_completes_a_task_through_the_gemini_translator(tmp_path):
    gemini = _binary("gemini-cli", "gemini")
    work, home = tmp_path / "work", tmp_path / "home"
    (home / ".gemini").mkdir(parents=True), work.mkdir()
    (home / ".gemini" / "settings.json").write_text(
        '{"security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": false}},'
        ' "privacy": {"usageStatisticsEnabled": false}, "telemetry": {"enabled": false},'
        ' "general": {"enableAutoUpdate": false, "enableAutoUpdateNotification": false}}')
    with ScriptedModel() as model:
        env = _env(home, GEMINI_API_KEY="test-key", GOOGLE_GEMINI_BASE_URL=f"http://127.0.0.1:{model.port}",
                   GEMINI_TELEMETRY_ENABLED="false", GEMINI_CLI_NO_RELAUNCH="true")
        proc = _run([gemini, "--model", "qwen3-test", "--yolo", "--output-format", "json", "--prompt", PROMPT],
                    work, env)
    # (the reasoning comes back through thoughtSignature: Gemini CLI resends no thought parts)
    _check(model, proc, work, ":streamGenerateContent")
    assert not model.other, model.other  # nothing but model calls: no countTokens, no telemetry
