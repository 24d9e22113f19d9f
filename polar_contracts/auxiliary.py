"""Which recorded calls are auxiliary (not the agent's trajectory), by the rules a recipe declares.

A harness makes calls that are not part of the agent's work: a session title (Claude Code,
OpenCode), a next-speaker check. They are sampled by the policy and recorded, but the episode's
reward says nothing about them, so they must not be trained with it. The API translators flag the
ones they can recognise from the request alone (a JSON output schema and no tools); a chat-API call
passes through untranslated, so nothing flags OpenCode's title call there.

The recipe knows its harness: its `[[auxiliary]]` tables say what such a call looks like. The
rollout node puts those rules in the episode's end metadata (`auxiliary_rules`; only the node can
write an end record, the control plane refuses a sandbox), and the log reader applies them to every
call row, so reconstruction, the trainer and the comparison report all see the same flag. A rule is
a conjunction of these keys (unknown keys are an error at recipe load, never ignored):

    api              the call's API ("chat", "completions", "responses", "messages", "gemini")
    tools            "none": the request declares no tools
    body_has         a top-level key the request body has
    system_contains  text in the system prompt (chat: the first system/developer message;
                     messages: `system`; responses: `instructions`; gemini: `systemInstruction`)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from polar_contracts.log.end_record import AUXILIARY_RULES as METADATA_KEY  # the end metadata key

MATCH_KEYS = frozenset({"api", "tools", "body_has", "system_contains"})


class AuxiliaryRuleError(ValueError):
    pass


@dataclass(frozen=True)
class AuxiliaryRule:
    name: str
    match: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "match": dict(self.match)}


def parse_rule(obj: object, where: str) -> AuxiliaryRule:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise AuxiliaryRuleError(f"{where}: an auxiliary rule is {{\"name\": str, \"match\": {{...}}}}, got {obj!r:.200}")
    match = obj.get("match")
    if not isinstance(match, dict) or not match:
        raise AuxiliaryRuleError(f"{where}: auxiliary rule {obj['name']!r} has no 'match' table; "
                                 f"a rule without conditions would flag every call")
    unknown = set(match) - MATCH_KEYS
    if unknown:
        raise AuxiliaryRuleError(f"{where}: auxiliary rule {obj['name']!r} has unknown match keys {sorted(unknown)}; "
                                 f"known: {sorted(MATCH_KEYS)}")
    bad = [k for k, v in match.items() if not isinstance(v, str) or not v]
    if bad:
        raise AuxiliaryRuleError(f"{where}: auxiliary rule {obj['name']!r}: {sorted(bad)} must be non-empty strings")
    if "tools" in match and match["tools"] != "none":
        raise AuxiliaryRuleError(f"{where}: auxiliary rule {obj['name']!r}: tools must be \"none\", got {match['tools']!r}")
    return AuxiliaryRule(obj["name"], dict(match))


def rules_from_metadata(metadata: dict[str, Any], where: str) -> tuple[AuxiliaryRule, ...]:
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise AuxiliaryRuleError(f"{where}: end metadata {METADATA_KEY!r} must be a list of rules")
    return tuple(parse_rule(r, f"{where}: {METADATA_KEY}[{i}]") for i, r in enumerate(raw))


def _text(value: Any) -> str:
    """The text of a system prompt in any of the APIs' shapes (string, content blocks, parts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text(v) for v in value)
    if isinstance(value, dict):
        for key in ("text", "content", "parts"):
            if key in value:
                return _text(value[key])
    return ""


def system_text(body: dict[str, Any]) -> str:
    for key in ("system", "instructions", "systemInstruction", "system_instruction"):
        if key in body:
            return _text(body[key])
    for msg in body.get("messages") or []:
        if isinstance(msg, dict) and msg.get("role") in ("system", "developer"):
            return _text(msg.get("content"))
    return ""


def matches(rule: AuxiliaryRule, api: str | None, body: dict[str, Any]) -> bool:
    m = rule.match
    if "api" in m and m["api"] != api:
        return False
    if "tools" in m and body.get("tools"):
        return False
    if "body_has" in m and m["body_has"] not in body:
        return False
    return not ("system_contains" in m and m["system_contains"] not in system_text(body))


def first_match(rules: tuple[AuxiliaryRule, ...], api: str | None, request_text: str | None) -> str | None:
    """The name of the first rule the recorded request matches, or None."""
    rules = tuple(r for r in rules if r.match.get("api", api) == api)  # (before parsing: bodies are large)
    if not rules or request_text is None:
        return None
    try:
        body = json.loads(request_text)
    except json.JSONDecodeError:
        return None  # not a JSON body: no rule speaks of it
    if not isinstance(body, dict):
        return None
    return next((r.name for r in rules if matches(r, api, body)), None)
