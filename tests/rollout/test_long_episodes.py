"""The long-episode script (harness_recipes/long_episode.py) and one long episode through a real CLI.

The script's replies are checked on requests shaped as the proxy forwards them (chat completions
after translation): the step a request gets is the number of tool results it holds, whatever user
messages a harness slips in between. The run test drives Pi (the fastest bundled CLI) through a
30-call episode through the proxy against polar-serve and checks every scripted call was captured,
the task was fixed, and the rows are token-faithful with the ledger closed. The 100-call numbers per
harness are bench/bench_long_episodes.py's (docs/benchmarks/long-episodes.md); the compatibility
matrix's 100-call column comes from tests/rollout/test_compat_matrix.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness_recipes.long_episode import SUBMIT, long_script
from polar_serve.script import choose_reply, validate_script

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "tests" / "fixtures" / "scripts" / "long_episode.json"
BASH = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]


def body(tool_results: int, *, system="You are a coding agent.", extra_user_every=0, tools=BASH) -> dict:
    """A chat request after `tool_results` tool rounds; a user reminder after every
    `extra_user_every` rounds (0: none), as some harnesses slip in."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Fix calc.py"}]
    for k in range(tool_results):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{k}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"out {k}"})
        if extra_user_every and (k + 1) % extra_user_every == 0:
            msgs.append({"role": "user", "content": "<system-reminder>keep going</system-reminder>"})
    return {"messages": msgs, **({"tools": tools} if tools else {})}


def command_of(text: str) -> str | None:
    if "<tool_call>" not in text:
        return None
    call = json.loads(text.split("<tool_call>\n", 1)[1].split("\n</tool_call>", 1)[0])
    return call["arguments"]["command"]


def test_the_committed_script_is_long_script_100():
    assert json.loads(COMMITTED.read_text()) == long_script(100)
    validate_script(long_script(100))


@pytest.mark.parametrize("reminders", [0, 7])
def test_each_step_is_picked_by_tool_results_and_no_two_commands_are_alike(reminders):
    s = validate_script(long_script(12))
    cmds = [command_of(choose_reply(s, body(k, extra_user_every=reminders), True).text) for k in range(12)]
    assert cmds[0] == "sed -i 's/return a - b/return a + b/' calc.py"
    assert all(c and c.startswith(f"echo 'step {k} of 9'; ") for k, c in enumerate(cmds[1:10], 1)), cmds
    assert cmds[10] == "python3 -m unittest -q test_calc"
    assert cmds[11] is None  # the answer: no tool call
    assert "Done: the bug is fixed" in choose_reply(s, body(11), True).text
    assert len(set(cmds[:11])) == 11


def test_mini_swe_agent_submits_aider_gets_its_edit_and_bare_calls_a_short_text():
    s = validate_script(long_script(5))
    mini = choose_reply(s, body(4, system=f"Finish with echo {SUBMIT}"), True).text
    assert command_of(mini) == f"echo {SUBMIT}"
    assert command_of(choose_reply(s, body(3, system=f"Finish with echo {SUBMIT}"), True).text) == \
        "python3 -m unittest -q test_calc"
    aider = choose_reply(s, {"messages": [{"role": "system", "content": "Reply with SEARCH/REPLACE blocks"},
                                          {"role": "user", "content": "fix calc.py"}]}, True).text
    assert "<<<<<<< SEARCH\n    return a - b\n=======\n    return a + b\n>>>>>>> REPLACE" in aider
    assert choose_reply(s, body(2, tools=None), True).text.endswith("Fix the failing test")
    with pytest.raises(ValueError, match="at least 3 calls"):
        long_script(2)


def test_a_long_episode_through_the_real_pi_cli(tmp_path):
    from harness_recipes.cache import tiny_model
    from harness_recipes.long_episode import run_long, write_script
    from harness_recipes.node.local_stack import capture_proxy, serve

    calls = 30
    script = write_script(tmp_path / "long.json", calls)
    with serve(tiny_model(), script=script) as srv, capture_proxy(srv.url, tmp_path / "logs") as proxy:
        run = run_long("pi", proxy, tmp_path / "logs", tmp_path, calls, split_len=4096)
    assert (run.status, run.reward) == ("done", 1.0), run
    assert (run.calls, run.auxiliary) == (calls, 0), run
    # Pi resends its whole history every call: one segment, every sampled token trained
    assert run.closes and run.segments == run.rows == 1 and run.trained == run.sampled > 0, run
    # --max-len 4096 is shorter than the episode's row: split at call boundaries, the calls whose
    # prompt alone is longer left out, so fewer tokens trained (still accounted for: build --check)
    assert run.longest_row > 4096 and run.split_rows >= 1 and run.split_trained < run.trained, run
