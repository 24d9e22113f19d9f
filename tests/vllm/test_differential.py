"""Differential test: the same requests to the real vLLM 0.32 and to polar-serve (`--dialect vllm`),
compared field by field (key order included), chunk by chunk, ids exactly and logprobs to 1e-5.

Both servers load the same tiny random Qwen3 in float32 and decode greedily (`temperature: 0`), so
the sampled ids must be identical. Only per-call values are normalized (PER_CALL below); every
other byte of the JSON (field names, order, nulls, chunk boundaries, HTTP status, content type,
compact or spaced JSON) must agree. A failure lists every difference by JSON path.

Run as a script against two running servers while iterating (polar-serve started with the script
`python -m tests.vllm.test_differential --script FILE` writes):
    VLLM_URL=http://127.0.0.1:P1 POLAR_URL=http://127.0.0.1:P2 python -m tests.vllm.test_differential [case ...]
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import VLLM_MODEL_NAME

M = VLLM_MODEL_NAME
TOL = 1e-5  # logprobs: same weights, same float32 math, different kernels
RANK_TOL = 2  # prompt_logprobs ranks (see diff)

# The values that differ from call to call (or from server start to server start) on the real
# server itself: replaced by a placeholder that keeps their shape, so the format is still compared.
PER_CALL = {
    "id": r"(chatcmpl|cmpl|modelperm)-[0-9a-f]{16}",  # vllm.utils.random_uuid: 16 hex digits
    "tool_call_id": r"chatcmpl-tool-[0-9a-f]{16}",
    "created": int,                                  # unix seconds of the answer (and of /v1/models cards)
    "system_fingerprint": r"vllm-0\.32\.0-[0-9a-f]{8}",  # vllm_config.compute_hash()[:8]
}


def _norm(obj, key: str | None = None):
    """`obj` with PER_CALL values replaced by "<key>" when they have the server's format, kept (and
    so reported) when they do not."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k == "id" and isinstance(v, str) and isinstance(obj.get("function"), dict):
                out[k] = _placeholder("tool_call_id", v)
            elif k in ("id", "system_fingerprint") and isinstance(v, str):
                out[k] = _placeholder(k, v)
            elif k == "created" and isinstance(v, int):
                out[k] = "<created>"
            else:
                out[k] = _norm(v, k)
        return out
    if isinstance(obj, list):
        return [_norm(x, key) for x in obj]
    return obj


def _placeholder(kind: str, v: str) -> str:
    return f"<{kind}>" if re.fullmatch(PER_CALL[kind], v) else v


@dataclass
class Case:
    name: str
    body: dict | None                # None: GET
    path: str = "/v1/chat/completions"
    stream: bool = False
    headers: dict = field(default_factory=dict)
    # n > 1 can only run near-greedy, and there the real server's choices do not follow the argmax:
    # compare the layout (keys, types, chunk counts per choice), not the sampled values.
    layout_only: bool = False


def _chat(**kw) -> dict:
    b = {"model": M, "messages": [{"role": "user", "content": "Write a poem about the sea."}], "max_tokens": 8,
         "temperature": 0}
    b.update(kw)
    return b


def _cmpl(**kw) -> dict:
    b = {"model": M, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    b.update(kw)
    return b


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# n > 1 is refused under greedy decoding; a temperature just above vLLM's greedy threshold (1e-5) still
# picks the argmax (and raw logprobs do not see the temperature).
NEAR_GREEDY = {"temperature": 1e-5, "top_p": 1, "top_k": -1}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
IDS_LP = {"return_token_ids": True, "logprobs": True, "top_logprobs": 3}
USAGE = {"stream_options": {"include_usage": True}}

# -- forced outputs: tool calls -------------------------------------------------------------------
# The random model never emits a tool call by itself. The real server is made to, by a regular
# expression (vLLM structured outputs, greedy within it); the `polar` fixture first asks it for those
# outputs and gives polar-serve a script that replays the very same token ids (script `token_ids`),
# so both parse and stream identical tokens. A marker in the user message selects the script rule.
# No logprobs here: under structured outputs the real server's logprobs are those of the
# grammar-masked distribution, which a replay cannot (and need not) reproduce.
def _tool_call_re(args: str) -> str:
    return r'<tool_call>\n\{"name": "get_weather", "arguments": \{' + args + r'\}\}\n</tool_call>'


FORCED = {
    "FORCE-TOOL": r"\n\n" + _tool_call_re(r'"city": "Paris Ville"'),
    "FORCE-TEXT-TOOL": r"Let me check\.\n" + _tool_call_re(r'"city": "Rome", "unit": "c"'),
    "FORCE-TWO-TOOLS": _tool_call_re(r'"city": "Oslo"') + r"\n" + _tool_call_re(r'"city": "Lima"'),
    "FORCE-PLAIN": r"Plain answer, no tools\.",
    # compact JSON: streamed as written, answered re-serialized ({"city": "Oslo", "n": [1, 2]})
    "FORCE-COMPACT": _tool_call_re(r'"city":"Oslo","n":\[1,2\]').replace('"arguments": ', '"arguments":'),
}


def _forced(marker: str, **kw) -> dict:
    b = _chat(messages=[{"role": "user", "content": f"{marker}: what is the weather in Paris?"}], tools=TOOLS,
              max_tokens=200, structured_outputs={"regex": FORCED[marker]}, **NO_THINK)
    b.update(kw)
    return b


CASES = [
    # -- chat ------------------------------------------------------------------------------------
    Case("chat", _chat()),
    Case("chat_ids_logprobs", _chat(**IDS_LP)),
    Case("chat_no_think", _chat(**NO_THINK, **IDS_LP)),
    Case("chat_stream", _chat(stream=True), stream=True),
    Case("chat_stream_usage", _chat(stream=True, **USAGE), stream=True),
    Case("chat_stream_ids_logprobs", _chat(stream=True, **IDS_LP, **USAGE), stream=True),
    Case("chat_stream_no_think", _chat(stream=True, **NO_THINK, **IDS_LP), stream=True),
    Case("chat_n2", _chat(n=2, **NEAR_GREEDY, **IDS_LP), layout_only=True),
    Case("chat_stream_n2", _chat(n=2, stream=True, **NEAR_GREEDY, **IDS_LP, **USAGE), stream=True, layout_only=True),
    Case("chat_stream_n2_plain", _chat(n=2, stream=True, max_tokens=4, **NEAR_GREEDY, **NO_THINK), stream=True,
         layout_only=True),
    Case("err_chat_n2_greedy", _chat(n=2)),
    Case("chat_tools", _chat(tools=TOOLS, **IDS_LP)),
    Case("chat_stream_tools", _chat(tools=TOOLS, stream=True, **IDS_LP), stream=True),
    Case("chat_tool_choice_none", _chat(tools=TOOLS, tool_choice="none", **NO_THINK)),
    Case("chat_developer_systems", _chat(messages=[
        {"role": "system", "content": "You are terse."}, {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "hi"}, {"role": "system", "content": "Late system note."}],
        return_token_ids=True, max_tokens=2)),
    Case("chat_content_parts", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}], return_token_ids=True, max_tokens=2)),
    Case("chat_history_tool_calls", _chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need a tool", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=TOOLS, return_token_ids=True,
        max_tokens=2)),
    Case("chat_include_reasoning_false", _chat(include_reasoning=False, **IDS_LP)),
    Case("chat_stream_include_reasoning_false", _chat(include_reasoning=False, stream=True, **IDS_LP),
         stream=True),
    Case("chat_tokens_as_ids", _chat(return_tokens_as_token_ids=True, **IDS_LP)),
    Case("chat_prompt_logprobs", _chat(prompt_logprobs=2, max_tokens=2)),
    Case("chat_stream_prompt_logprobs", _chat(prompt_logprobs=2, stream=True), stream=True),
    Case("chat_stop_string", _chat(stop=["\u57fa"], max_tokens=12, **NO_THINK)),
    Case("chat_return_prompt_text", _chat(return_prompt_text=True, max_tokens=2)),
    Case("chat_stream_stop_string", _chat(stop=["\u57fa"], max_tokens=12, stream=True, **NO_THINK), stream=True),
    Case("chat_stop_token_ids", _chat(stop_token_ids=[50150, 112951], return_token_ids=True, **NO_THINK)),
    Case("chat_include_stop_str", _chat(stop=["\u57fa"], include_stop_str_in_output=True, max_tokens=12,
                                        **NO_THINK)),
    Case("chat_top_logprobs_0", _chat(logprobs=True, top_logprobs=0, max_tokens=3)),
    Case("chat_continue_final_message", _chat(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, here"}],
        continue_final_message=True, add_generation_prompt=False, return_token_ids=True, max_tokens=3)),
    Case("chat_stream_tokens_as_ids", _chat(return_tokens_as_token_ids=True, stream=True, max_tokens=3, **IDS_LP),
         stream=True),
    Case("chat_max_completion_tokens", _chat(max_completion_tokens=3, max_tokens=None)),
    # -- tool calls (forced, see FORCED) --
    Case("tool_call", _forced("FORCE-TOOL", return_token_ids=True)),
    Case("tool_call_stream", _forced("FORCE-TOOL", stream=True, return_token_ids=True, **USAGE), stream=True),
    Case("tool_call_stream_plain", _forced("FORCE-TOOL", stream=True), stream=True),
    Case("tool_call_after_text", _forced("FORCE-TEXT-TOOL", return_token_ids=True)),
    Case("tool_call_after_text_stream", _forced("FORCE-TEXT-TOOL", stream=True), stream=True),
    Case("two_tool_calls", _forced("FORCE-TWO-TOOLS")),
    Case("two_tool_calls_stream", _forced("FORCE-TWO-TOOLS", stream=True), stream=True),
    Case("compact_arguments", _forced("FORCE-COMPACT")),
    Case("compact_arguments_stream", _forced("FORCE-COMPACT", stream=True), stream=True),
    Case("forced_text_with_tools", _forced("FORCE-PLAIN")),
    Case("forced_text_with_tools_stream", _forced("FORCE-PLAIN", stream=True), stream=True),
    # -- completions -----------------------------------------------------------------------------
    Case("cmpl", _cmpl(), "/v1/completions"),
    Case("cmpl_ids_logprobs", _cmpl(return_token_ids=True, logprobs=3), "/v1/completions"),
    Case("cmpl_token_prompt", _cmpl(prompt=[785, 6722, 315, 9625, 374], return_token_ids=True),
         "/v1/completions"),
    Case("cmpl_echo", _cmpl(echo=True, return_token_ids=True), "/v1/completions"),
    Case("cmpl_echo_logprobs", _cmpl(echo=True, logprobs=2), "/v1/completions"),
    Case("cmpl_stream", _cmpl(stream=True), "/v1/completions", stream=True),
    Case("cmpl_stream_ids_logprobs", _cmpl(stream=True, return_token_ids=True, logprobs=2, **USAGE),
         "/v1/completions", stream=True),
    Case("cmpl_stream_echo", _cmpl(stream=True, echo=True, return_token_ids=True), "/v1/completions",
         stream=True),
    Case("cmpl_n2", _cmpl(n=2, return_token_ids=True, logprobs=1, **NEAR_GREEDY), "/v1/completions",
         layout_only=True),
    Case("cmpl_stream_n2", _cmpl(n=2, stream=True, max_tokens=3, **NEAR_GREEDY, **USAGE), "/v1/completions",
         stream=True, layout_only=True),
    Case("cmpl_prompt_logprobs", _cmpl(prompt_logprobs=1, max_tokens=2), "/v1/completions"),
    Case("cmpl_tokens_as_ids", _cmpl(logprobs=2, return_tokens_as_token_ids=True, max_tokens=3), "/v1/completions"),
    Case("cmpl_stop_string", _cmpl(stop=["\u0433\u0440"], max_tokens=6), "/v1/completions"),
    Case("cmpl_stream_stop_string", _cmpl(stop=["\u0433\u0440"], max_tokens=6, stream=True), "/v1/completions",
         stream=True),
    # -- errors ----------------------------------------------------------------------------------
    Case("err_bad_model_chat", _chat(model="nope")),
    Case("err_bad_model_cmpl", _cmpl(model="nope"), "/v1/completions"),
    Case("err_bad_temperature", _chat(temperature=-1)),
    Case("err_bad_max_tokens", _chat(max_tokens=0)),
    Case("err_top_logprobs_without_logprobs", _chat(top_logprobs=2)),
    Case("err_no_messages", {"model": M}),
    Case("err_bad_json_role", _chat(messages=[{"role": "robot", "content": "x"}])),
    Case("err_long_prompt", _cmpl(prompt=[785] * 40000), "/v1/completions"),
    # -- other endpoints -------------------------------------------------------------------------
    Case("models", None, "/v1/models"),
    Case("health", None, "/health"),
    Case("version", None, "/version"),
    Case("unknown_route", None, "/v1/nothing"),
    Case("wrong_method", None, "/v1/chat/completions"),
    Case("tokenize_prompt", {"model": M, "prompt": "hello world"}, "/tokenize"),
    Case("tokenize_messages", {"model": M, "messages": [{"role": "user", "content": "hi"}]}, "/tokenize"),
    Case("tokenize_strs", {"model": M, "prompt": "hello", "return_token_strs": True}, "/tokenize"),
    Case("detokenize", {"model": M, "tokens": [14990, 1879]}, "/detokenize"),
]


# -- talking to a server ---------------------------------------------------------------------------
def call(base: str, case: Case) -> dict:
    """The answer as {status, content_type, compact, body}; body: the JSON (None for an empty body), or
    for a stream the list of SSE events (dicts, or the string "[DONE]")."""
    url = base + case.path
    with httpx.Client(timeout=600) as c:
        if case.body is None:
            r = c.get(url)
        else:
            r = c.post(url, json={k: v for k, v in case.body.items() if v is not None}, headers=case.headers)
    ctype = r.headers.get("content-type")
    text = r.text
    if ctype and ctype.startswith("text/event-stream"):
        events, compact = [], True
        assert text.endswith("\n\n"), text[-200:]
        for block in text[:-2].split("\n\n"):
            assert block.startswith("data: "), block
            data = block[6:]
            if data == "[DONE]":
                events.append(data)
                continue
            obj = json.loads(data)
            compact = compact and _is_compact(obj, data)
            events.append(obj)
        return {"status": r.status_code, "content_type": ctype, "compact": compact, "body": events}
    try:
        obj = json.loads(text) if text else None
    except json.JSONDecodeError:
        return {"status": r.status_code, "content_type": ctype, "compact": None, "body": text}
    return {"status": r.status_code, "content_type": ctype, "compact": _is_compact(obj, text) if text else None,
            "body": obj}


def _is_compact(obj, raw: str) -> bool:
    """Written as pydantic writes JSON: no spaces after separators, non-ASCII as is."""
    return raw == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def diff(a, b, path: str = "$") -> list[str]:
    """Every difference between a (vLLM) and b (polar-serve): types, key order, values, floats to TOL."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            out = [f"{path}: keys vllm={list(a)} polar={list(b)}"]
        else:
            out = []
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [] if len(a) == len(b) else [f"{path}: length vllm={len(a)} polar={len(b)}"]
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out += diff(x, y, f"{path}[{i}]")
        return out
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= TOL else [f"{path}: vllm={a!r} polar={b!r}"]
    if path.endswith(".rank") and isinstance(a, int) and isinstance(b, int):
        # a prompt token's rank among ~150k near-equal logprobs moves with float noise below TOL
        return [] if abs(a - b) <= RANK_TOL else [f"{path}: vllm={a} polar={b}"]
    if type(a) is not type(b) or a != b:
        return [f"{path}: vllm={_short(a)} polar={_short(b)}"]
    return []


def _short(v) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) < 300 else s[:300] + "..."


def _by_choice(events: list) -> list:
    """A stream's events with the token chunks of n > 1 choices grouped by choice index (stable): the
    real server interleaves its choices in an order that depends on its timing."""
    head = [e for e in events if isinstance(e, dict) and e.get("choices") and "role" in e["choices"][0].get("delta", {})]
    rest = [e for e in events if not any(e is h for h in head)]
    body = sorted((e for e in rest if isinstance(e, dict) and e.get("choices")), key=lambda e: e["choices"][0]["index"])
    tail = [e for e in rest if not (isinstance(e, dict) and e.get("choices"))]
    return head + body + tail


def _shape(obj):
    """Values replaced by their type name (layout_only cases)."""
    if isinstance(obj, dict):
        return {k: (v if k in ("index", "finish_reason", "object", "role") else "bytes" if k == "bytes" else _shape(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return "list[int]" if obj and all(type(x) is int for x in obj) else [_shape(x) for x in obj]
    return obj if obj is None else type(obj).__name__


def _canonical(answer: dict, case: Case) -> dict:
    out = _norm(answer)
    if case.stream and isinstance(out["body"], list):
        out["body"] = _by_choice(out["body"])
    if case.layout_only:
        out["body"] = _shape(out["body"])
    return out


def compare(vllm_url: str, polar_url: str, case: Case, tries: int = 6) -> list[str]:
    """The differences; a stream is asked for again (up to `tries` times) while it differs: under load
    the real server sometimes sends several tokens in one chunk (its output loop fell behind)."""
    b = _canonical(call(polar_url, case), case)
    best = None
    for _ in range(tries if case.stream else 1):
        problems = diff(_canonical(call(vllm_url, case), case), b)
        if best is None or len(problems) < len(best):
            best = problems
        if not problems:
            break
    return best


# -- the tests -------------------------------------------------------------------------------------
def forced_script(vllm_url: str) -> dict:
    """A polar-serve script replaying, per FORCED marker, the ids the real server produced."""
    rules = []
    for marker in FORCED:
        body = _forced(marker, return_token_ids=True)
        out = httpx.post(vllm_url + "/v1/chat/completions", json=body, timeout=600).json()
        rules.append({"when": {"any_contains": marker}, "reply": {"token_ids": out["choices"][0]["token_ids"]}})
    return {"description": "replays the real vLLM's forced outputs", "rules": rules, "fallback": {"sample": True}}


@pytest.fixture(scope="module")
def polar(real_vllm, tiny_model, tmp_path_factory):
    from harness_recipes.node.local_stack import serve

    d = tmp_path_factory.mktemp("polar")
    script = d / "forced.json"
    script.write_text(json.dumps(forced_script(real_vllm.url)))
    with serve(tiny_model, script=script, dialect="vllm", model_name=M, log=d / "serve.log",
               extra_args=["--max-model-len", "32768"]) as p:
        yield p


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_answer_as_real_vllm(real_vllm, polar, case):
    problems = compare(real_vllm.url, polar.url, case)
    assert not problems, f"{case.name}: polar-serve differs from vLLM 0.32:\n" + "\n".join(problems)


def main(argv: list[str]) -> int:
    v = os.environ["VLLM_URL"]
    if argv[:1] == ["--script"]:
        with open(argv[1], "w") as f:
            json.dump(forced_script(v), f)
        return 0
    p = os.environ["POLAR_URL"]
    bad = 0
    for case in CASES:
        if argv and case.name not in argv:
            continue
        problems = compare(v, p, case)
        bad += bool(problems)
        print(("DIFF " if problems else "same ") + case.name)
        for line in problems[:40]:
            print("    " + line)
        if len(problems) > 40:
            print(f"    ... {len(problems) - 40} more")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
