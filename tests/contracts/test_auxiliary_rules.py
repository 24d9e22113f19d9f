"""Recipe-declared auxiliary rules (polar_contracts/auxiliary.py): what they match, what they refuse,
and that the log reader applies the ones in an episode's end metadata."""
import json

import pytest

from harness_recipes.recipes.recipe import load_recipe
from polar_contracts.auxiliary import AuxiliaryRuleError, first_match, parse_rule, rules_from_metadata

TITLE = {"model": "m", "messages": [{"role": "system", "content": "You are a title generator. ..."},
                                    {"role": "user", "content": "fix calc.py"}]}
AGENT = {"model": "m", "tools": [{"type": "function", "function": {"name": "bash"}}],
         "messages": [{"role": "system", "content": "You are a title generator of code"}]}


def _rules(name):
    return tuple(parse_rule({"name": a.name, "match": a.match}, name) for a in load_recipe(name).auxiliary)


def test_opencode_rule_flags_its_title_call_and_nothing_with_tools():
    rules = _rules("opencode")
    assert first_match(rules, "chat", json.dumps(TITLE)) == "session-title"
    assert first_match(rules, "chat", json.dumps(AGENT)) is None  # declares tools
    assert first_match(rules, "messages", json.dumps(TITLE)) is None  # other API
    assert first_match(rules, "chat", "not json") is None


def test_opencode_rule_flags_its_compaction_summary_call_and_not_the_call_after_it():
    rules = _rules("opencode")
    summary = {"model": "m", "messages": [
        {"role": "system", "content": "You are a context summarization agent. You are given a conversation ..."},
        {"role": "user", "content": "<conversation>...</conversation> Create a new anchored summary ..."}]}
    assert first_match(rules, "chat", json.dumps(summary)) == "session-compaction"
    # the next agent call resends the summary, with the agent's system prompt and tools: trained
    after = {"model": "m", "tools": [{"type": "function", "function": {"name": "bash"}}], "messages": [
        {"role": "system", "content": "You are OpenCode, ..."}, {"role": "user", "content": "What did we do so far?"},
        {"role": "assistant", "content": "## Objective ..."}]}
    assert first_match(rules, "chat", json.dumps(after)) is None


def test_claude_code_rule_matches_a_messages_body_with_output_format():
    rules = _rules("claude-code")
    body = {"model": "m", "system": [{"type": "text", "text": "x"}], "output_format": {"type": "json_schema"},
            "messages": []}
    assert first_match(rules, "messages", json.dumps(body)) == "session-title"
    assert first_match(rules, "messages", json.dumps({**body, "tools": [{"name": "Bash"}]})) is None


@pytest.mark.parametrize("bad,why", [
    ({"name": "x"}, "no 'match'"), ({"name": "x", "match": {"tool": "none"}}, "unknown match keys"),
    ({"name": "x", "match": {"tools": "some"}}, "tools must be"), ({"match": {"api": "chat"}}, "an auxiliary rule is"),
    ({"name": "x", "match": {"api": ""}}, "non-empty strings"),
])
def test_a_bad_rule_is_refused_naming_the_problem(bad, why):
    with pytest.raises(AuxiliaryRuleError, match=why):
        parse_rule(bad, "here")
    with pytest.raises(AuxiliaryRuleError, match=why):
        rules_from_metadata({"auxiliary_rules": [bad]}, "log.arrow")


def test_metadata_without_rules_flags_nothing():
    assert rules_from_metadata({}, "log.arrow") == ()
    with pytest.raises(AuxiliaryRuleError, match="must be a list"):
        rules_from_metadata({"auxiliary_rules": {"name": "x"}}, "log.arrow")
