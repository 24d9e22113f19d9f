"""The Gemini API translator (polar_contracts/translate/gemini_api.py): requests recorded from the
real Gemini CLI (tests/fixtures/harness-requests/gemini-cli.jsonl), hand-built requests, answers
and streams in the dialect the CLI reads, the reasoning round trip through thoughtSignature, the
routes, and bad input (a TranslationError naming the problem, answered 400 INVALID_ARGUMENT)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_contracts.translate import GeminiTranslator, TranslationError, gemini_to_chat, translator_for
from polar_contracts.translate.common import decode_reasoning
from tests.translate.chat_chunks import full_response, stream

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness-requests"
STREAM_PATH = "/v1beta/models/polar-model:streamGenerateContent?alt=sse"
USER = {"role": "user", "parts": [{"text": "hi"}]}
SHELL = {"functionDeclarations": [{"name": "run_shell_command", "description": "run a command",
                                   "parametersJsonSchema": {"type": "object",
                                                            "properties": {"command": {"type": "string"}}}}]}


def recorded(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]


def to_chat(body: dict, path: str = STREAM_PATH) -> dict:
    return translator_for("POST", path).request_to_chat(body, {})


def sse_chunks(data: bytes) -> list[dict]:
    """The `data: {...}` chunks of a Gemini SSE stream (CRLF framed, as the Gemini API sends them)."""
    text = data.decode()
    assert text.endswith("\r\n\r\n"), text[-50:]
    out = []
    for block in text.split("\r\n\r\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block[:200]
        out.append(json.loads(block[6:]))
    return out


# ---- routes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,model,stream", [
    ("/v1beta/models/polar-model:generateContent", "polar-model", False),
    ("/v1beta/models/polar-model:streamGenerateContent?alt=sse", "polar-model", True),
    ("/v1/models/Qwen%2FQwen3-0.6B:generateContent?key=abc", "Qwen/Qwen3-0.6B", False),
])
def test_gemini_routes_name_the_model_and_the_stream(path, model, stream):
    t = translator_for("POST", path)
    assert isinstance(t, GeminiTranslator) and t.api == "gemini"
    chat = t.request_to_chat({"contents": [USER]}, {})
    assert chat["model"] == model and chat["stream"] is stream
    assert ("stream_options" in chat) is stream


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1beta/models/m:generateContent"), ("POST", "/v1beta/models/m:countTokens"),
    ("POST", "/v1beta/models/m:embedContent"), ("POST", "/v1beta/models/..:generateContent"),
    ("POST", "/v1beta/models/a/b:generateContent"), ("POST", "/v1beta/cachedContents"),
])
def test_other_gemini_paths_are_not_translated(method, path):
    assert translator_for(method, path) is None


def test_the_proxy_forwards_gemini_calls_and_refuses_the_rest_of_that_api():
    from addon.routing import RouteError, route
    r = route("POST", "/polar/ep-1/v1beta/models/m:streamGenerateContent?alt=sse", {}, "default")
    assert r.episode_id == "ep-1" and r.path == "/v1beta/models/m:streamGenerateContent?alt=sse"
    with pytest.raises(RouteError, match="not a model API route") as e:
        route("POST", "/v1beta/models/m:countTokens", {}, "default")
    assert e.value.status == 403


# ---- the recorded requests of the real Gemini CLI ------------------------------------------------

def test_recorded_gemini_cli_requests_translate():
    reqs = recorded("gemini-cli.jsonl")
    assert len(reqs) >= 3
    chats = []
    for r in reqs:
        t = translator_for(r["method"], r["path"])
        assert t is not None, r["path"]
        chats.append(t.request_to_chat(r["body"], r["headers"]))
        assert not [n for n in t.notes if "unknown" in n], t.notes
    first = chats[0]
    assert first["stream"] is True and first["messages"][0]["role"] == "system"
    assert first["messages"][0]["content"].startswith("You are Gemini CLI")
    assert first["messages"][-1]["role"] == "user" and "calc.py" in first["messages"][-1]["content"]
    names = [t["function"]["name"] for t in first["tools"]]
    assert "run_shell_command" in names and all(t["function"]["parameters"]["type"] == "object"
                                                for t in first["tools"])
    assert first["chat_template_kwargs"] == {"enable_thinking": True}
    # the second call resends the first answer: the scripted reasoning (from the signature, the CLI
    # keeps no thought parts), the text, the shell call, then its result as a tool message
    second = chats[1]["messages"]
    asst = [m for m in second if m["role"] == "assistant"][-1]
    # (exactly as the server parsed it out of <think>...</think>, newlines included)
    assert asst["reasoning_content"].strip() == "The add function subtracts. I will fix it with sed."
    (call,) = asst["tool_calls"]
    assert call["function"]["name"] == "run_shell_command"
    assert json.loads(call["function"]["arguments"])["command"] == "sed -i 's/return a - b/return a + b/' calc.py"
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == call["id"]
    # each agent request extends the one before it: the history is a prefix of the next one
    agent = [c for c in chats if c.get("tools")]
    for a, b in zip(agent, agent[1:]):
        assert b["messages"][:len(a["messages"])] == a["messages"]


def test_recorded_requests_hold_no_api_key():
    for r in recorded("gemini-cli.jsonl"):
        assert "key=" not in r["path"] and "x-goog-api-key" not in {k.lower() for k in r["headers"]}


def test_gemini_to_chat_is_what_recon_renders():
    body = recorded("gemini-cli.jsonl")[1]["body"]
    chat = gemini_to_chat(body)
    assert chat["messages"] == to_chat(body)["messages"]


# ---- request mapping ----------------------------------------------------------------------------

def test_a_whole_conversation_maps_to_chat():
    body = {
        "system_instruction": {"parts": [{"text": "Be brief."}, {"text": "Use tools."}]},  # snake_case too
        "contents": [
            USER,
            {"role": "model", "parts": [{"text": "thinking...", "thought": True}, {"text": "Let me run it."},
                                        {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}},
                                         "thoughtSignature": "someone-elses"}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "run_shell_command",
                                                             "response": {"output": "a.txt"}}},
                                       {"text": "and now?"}]},
        ],
        "tools": [SHELL, {"googleSearch": {}}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["run_shell_command"]}},
        "generationConfig": {"temperature": 0.5, "topP": 0.9, "topK": 20, "maxOutputTokens": 100,
                             "stopSequences": ["END"], "seed": 3, "thinkingConfig": {"thinkingBudget": 0}},
        "safetySettings": [],
    }
    t = translator_for("POST", "/v1beta/models/m:generateContent")
    chat = t.request_to_chat(body, {})
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me run it.", "reasoning_content": "thinking...",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "run_shell_command", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
        {"role": "user", "content": "and now?"},
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "run_shell_command"}}
    assert (chat["temperature"], chat["top_p"], chat["top_k"], chat["max_tokens"], chat["seed"]) == \
        (0.5, 0.9, 20, 100, 3)
    assert chat["stop"] == ["END"] and chat["stream"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert any("googleSearch" in n for n in t.notes) and any("safetySettings" in n for n in t.notes)
    assert any("thoughtSignature" in n for n in t.notes)


def test_openapi_parameters_and_json_output_schema():
    t = translator_for("POST", "/v1beta/models/m:generateContent")
    chat = t.request_to_chat({"contents": [USER], "generationConfig": {
        "responseMimeType": "application/json",
        "responseSchema": {"type": "OBJECT", "properties": {"next": {"type": "STRING"}}}}}, {})
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object",
                                                                 "properties": {"next": {"type": "string"}}}
    assert t.auxiliary  # no tools and a JSON schema: the CLI's next-speaker check and the like
    chat = to_chat({"contents": [USER], "tools": [{"functionDeclarations": [{
        "name": "f", "parameters": {"type": "OBJECT", "properties": {"xs": {"type": "ARRAY",
                                                                          "items": {"type": "INTEGER"}}}}}]}]})
    assert chat["tools"][0]["function"]["parameters"] == {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}}}}


# ---- answers ------------------------------------------------------------------------------------

PARTS = [("reasoning", "I should list."), ("text", "Listing."), ("tool", "run_shell_command", {"command": "ls"})]


def _round_trip_request(model_turn: dict) -> dict:
    """The next request the CLI would send: the answer's parts (thought parts left out, as Gemini
    CLI keeps them out of its history) and the tool's result."""
    kept = [p for p in model_turn["parts"] if not p.get("thought")]
    return {"contents": [USER, {"role": "model", "parts": kept},
                         {"role": "user", "parts": [{"functionResponse": {
                             "name": "run_shell_command", "response": {"output": "a.txt"}}}]}],
            "tools": [SHELL]}


def test_the_stream_is_the_gemini_dialect_and_round_trips():
    t = translator_for("POST", STREAM_PATH)
    t.request_to_chat({"contents": [USER], "tools": [SHELL],
                       "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}, {})
    data = b"".join(t.feed_chunk(c) for c in stream(PARTS, finish="tool_calls")) + t.finish()
    chunks = sse_chunks(data)
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert "".join(p["text"] for p in parts if p.get("thought")) == "I should list."
    assert "".join(p["text"] for p in parts if "text" in p and not p.get("thought")) == "Listing."
    last = chunks[-1]
    assert last["candidates"][0]["finishReason"] == "STOP"
    assert last["usageMetadata"] == {"promptTokenCount": 1000, "candidatesTokenCount": 42, "totalTokenCount": 1042}
    (call,) = [p for p in parts if "functionCall" in p]
    assert call["functionCall"] == {"name": "run_shell_command", "args": {"command": "ls"}}
    assert decode_reasoning(call["thoughtSignature"]) == "I should list."
    assert all("finishReason" not in c["candidates"][0] for c in chunks[:-1])
    # the CLI merges the text parts of one turn and resends them with the call and its signature
    merged = {"role": "model", "parts": [{"text": "Listing."}, call]}
    asst = to_chat(_round_trip_request(merged))["messages"][1]
    assert asst == {"role": "assistant", "content": "Listing.", "reasoning_content": "I should list.",
                    "tool_calls": [{"id": "call_1", "type": "function", "function": {
                        "name": "run_shell_command", "arguments": '{"command": "ls"}'}}]}


def test_thoughts_not_asked_for_are_not_shown_but_still_round_trip():
    t = translator_for("POST", STREAM_PATH)
    t.request_to_chat({"contents": [USER]}, {})
    data = b"".join(t.feed_chunk(c) for c in stream([("reasoning", "hmm"), ("text", "Hello.")])) + t.finish()
    chunks = sse_chunks(data)
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert not any(p.get("thought") for p in parts)
    assert "".join(p.get("text", "") for p in parts) == "Hello."
    assert decode_reasoning(parts[-1]["thoughtSignature"]) == "hmm"
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"


def test_the_whole_answer_and_a_length_finish():
    t = translator_for("POST", "/v1beta/models/m:generateContent")
    t.request_to_chat({"contents": [USER], "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}, {})
    out = t.response_from_chat(full_response(PARTS, finish="tool_calls"))
    (cand,) = out["candidates"]
    parts = cand["content"]["parts"]
    assert parts[0] == {"text": "I should list.", "thought": True} and parts[1] == {"text": "Listing."}
    assert parts[2]["functionCall"] == {"name": "run_shell_command", "args": {"command": "ls"}}
    assert cand["finishReason"] == "STOP" and cand["content"]["role"] == "model"
    assert out["usageMetadata"]["promptTokenCount"] > 0 and out["modelVersion"] == "m"
    t = translator_for("POST", "/v1beta/models/m:generateContent")
    t.request_to_chat({"contents": [USER]}, {})
    out = t.response_from_chat(full_response([("text", "cut")], finish="length"))
    assert out["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_upstream_errors_in_the_gemini_shape():
    t = translator_for("POST", STREAM_PATH)
    t.request_to_chat({"contents": [USER]}, {})
    status, body, ctype = t.error_from_chat(400, b'{"error": {"message": "too long", "type": "BadRequest"}}')
    assert status == 400 and ctype == "application/json"
    assert json.loads(body) == {"error": {"code": 400, "message": "too long", "status": "INVALID_ARGUMENT"}}
    t.feed_chunk(stream([("text", "a")])[0])
    (err,) = sse_chunks(t.feed_chunk({"object": "error", "message": "boom", "error": {"message": "boom"}}))
    assert err["error"]["message"] == "boom" and err["error"]["status"] == "INTERNAL"
    assert t.finish() == b""


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("body,match", [
    ({}, "contents must be a non-empty list"),
    ({"contents": []}, "contents must be a non-empty list"),
    ({"contents": "hi"}, "contents must be a non-empty list"),
    ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "unknown role 'system'"),
    ({"contents": [{"role": "user", "parts": "hi"}]}, "parts must be a list"),
    ({"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA"}}]}]},
     "inlineData parts are not supported"),
    ({"contents": [{"role": "user", "parts": [{"fileData": {"fileUri": "gs://x"}}]}]}, "fileData"),
    ({"contents": [{"role": "model", "parts": [{"executableCode": {"code": "1"}}]}]}, "executableCode"),
    ({"contents": [{"role": "user", "parts": [{"frobnicate": 1}]}]}, "unsupported part"),
    ({"contents": [{"role": "user", "parts": [{"text": 3}]}]}, r"parts\[0\].text must be a string"),
    ({"contents": [USER, {"role": "user", "parts": [{"functionResponse": {"name": "f", "response": {}}}]}]},
     "functionResponse for 'f'.*no matching functionCall"),
    ({"contents": [USER, {"role": "model", "parts": [{"functionCall": {"name": "f", "args": [1]}}]}]},
     "args must be an object"),
    ({"contents": [USER, {"role": "model", "parts": [{"functionCall": {"args": {}}}]}]}, "with a name"),
    ({"contents": [USER], "tools": [{"functionDeclarations": [{"description": "x"}]}]}, "has no name"),
    ({"contents": [USER], "tools": [{"frobTool": {}}]}, "unknown tool kind 'frobTool'"),
    ({"contents": [USER], "tools": {"functionDeclarations": []}}, "tools must be a list"),
    ({"contents": [USER], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}}, "unknown mode"),
    ({"contents": [USER], "generationConfig": {"candidateCount": 2}}, "candidateCount 2"),
    ({"contents": [USER], "generationConfig": "hot"}, "generationConfig must be an object"),
    ({"contents": [USER], "generationConfig": {"stopSequences": "END"}}, "stopSequences must be a list"),
    ({"contents": [USER], "generationConfig": {"thinkingConfig": 5}}, "thinkingConfig must be an object"),
    ({"contents": [USER], "systemInstruction": 5}, "systemInstruction must be a Content"),
    ({"contents": [5]}, "contents\\[0\\] must be a Content"),
])
def test_malformed_requests_are_refused_with_a_clear_message(body, match):
    t = translator_for("POST", STREAM_PATH)
    with pytest.raises(TranslationError, match=match):
        t.request_to_chat(body, {})
    data, ctype = t.error_body(400, "x")
    assert json.loads(data)["error"]["status"] == "INVALID_ARGUMENT" and ctype == "application/json"


def test_a_body_that_is_not_an_object_and_a_json_array_stream_are_refused():
    with pytest.raises(TranslationError, match="must be a JSON object"):
        to_chat([USER])
    with pytest.raises(TranslationError, match="alt=sse"):
        to_chat({"contents": [USER]}, "/v1beta/models/m:streamGenerateContent")


def test_the_gemini_api_key_counts_as_a_credential_in_header_and_query():
    from addon.redact import credential_values
    found = credential_values([(b"x-goog-api-key", b"hdr-secret-1")],
                              "/v1beta/models/m:generateContent?alt=sse&key=qry-secret-2")
    assert {"hdr-secret-1", "qry-secret-2"} <= set(found)
    # a parameter merely named like something else is not taken for one
    assert credential_values([], "/v1beta/models/m:generateContent?alt=sse&monkey=x") == []
