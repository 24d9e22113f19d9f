"""Gemini API (Gemini CLI) <-> chat completions, sans-IO.

Routes: ``POST /v1beta/models/<model>:generateContent`` (one answer) and
``:streamGenerateContent?alt=sse`` (SSE); the model and whether to stream come from the path, not
the body. Request: systemInstruction -> a system message; contents (role user | model) -> chat
messages, where a model turn's parts (thought text, text, functionCall) become ONE assistant
message with `reasoning_content` and `tool_calls`, and a user turn's functionResponse parts become
tool messages (before the turn's text); functionDeclarations -> chat tools (`parametersJsonSchema`
as is, OpenAPI-style `parameters` with its upper-case types lowered); toolConfig -> tool_choice;
generationConfig -> sampling fields, stop, max_tokens, response_format, enable_thinking.
Answer: a GenerateContentResponse, or `data: {...}` SSE chunks in the shape the Gemini API
streams: thought and text parts as they come, function calls whole (the Gemini API never streams
partial arguments) in the last chunk with finishReason and usageMetadata.

Reasoning round trip: Gemini CLI keeps thought parts out of the history it resends, but resends a
part's `thoughtSignature` untouched (it is how the real API carries thinking across turns). The
exact reasoning text goes into the signature ("polar:v1:" + base64, common.encode_reasoning) on the
first functionCall part (else the text part); a resent signature decodes back to it, so the
template sees what the model sampled. A signature that is not ours is dropped (noted).

Refused with a TranslationError naming the part: inlineData / fileData (the template is
text-only), executableCode / codeExecutionResult, a functionResponse without its functionCall,
candidateCount > 1, streamGenerateContent without alt=sse (the JSON-array stream), and parts of
no known kind. Google's hosted tools (googleSearch, codeExecution, urlContext...) are dropped, noted.
"""
from __future__ import annotations

import json

from polar_contracts.translate.common import (
    ChatTranslator,
    TranslationError,
    decode_reasoning,
    dumps,
    encode_reasoning,
    first_choice,
    forced_tool,
    function_tool,
    join_notes,
    message_reasoning,
    new_id,
    prompt_len,
    reasoning_effort,
    stream_options,
    tool_arguments,
    usage_counts,
)

FINISH = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP", "length": "MAX_TOKENS",
          "content_filter": "SAFETY"}
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
          409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED",
          500: "INTERNAL", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
# Top-level fields that steer Google's own service; dropped and recorded.
DROPPED = ("safetySettings", "cachedContent", "labels", "serviceTier", "store")
# generationConfig fields with a chat equivalent: Gemini name -> chat name.
GEN_FIELDS = {"temperature": "temperature", "topP": "top_p", "topK": "top_k", "maxOutputTokens": "max_tokens",
              "seed": "seed", "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty"}
# generationConfig fields read below, or without meaning here (dropped, noted).
GEN_OTHER = {"stopSequences", "candidateCount", "responseMimeType", "responseSchema", "responseJsonSchema",
             "thinkingConfig", "responseLogprobs", "logprobs", "responseModalities", "mediaResolution",
             "speechConfig", "enableEnhancedCivicAnswers", "routingConfig", "audioTimestamp"}
HOSTED_TOOLS = ("googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext", "googleMaps",
                "computerUse", "fileSearch", "enterpriseWebSearch", "retrieval")


def _camel(key: str) -> str:
    """The REST API takes snake_case too (system_instruction, max_output_tokens): one spelling."""
    head, *rest = key.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def _camel_keys(obj: dict) -> dict:
    return {_camel(k) if isinstance(k, str) else k: v for k, v in obj.items()}


def _parts(content, where: str) -> list[dict]:
    if isinstance(content, str):  # (the SDKs accept a bare string for a Content)
        return [{"text": content}]
    if not isinstance(content, dict):
        raise TranslationError(f"{where} must be a Content object with parts")
    parts = content.get("parts")
    if parts is None:
        return []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise TranslationError(f"{where}.parts must be a list of Part objects")
    return [_camel_keys(p) for p in parts]


def _refuse_part(p: dict, where: str) -> None:
    for kind in ("inlineData", "fileData"):
        if kind in p:
            raise TranslationError(f"{where}: {kind} parts are not supported (the chat template is text-only)")
    for kind in ("executableCode", "codeExecutionResult"):
        if kind in p:
            raise TranslationError(f"{where}: {kind} parts are not supported (code execution runs on "
                                   "Google's side)")
    raise TranslationError(f"{where}: unsupported part with keys {sorted(p)}")


def _system_text(body: dict) -> str:
    si = body.get("systemInstruction")
    if si is None:
        return ""
    texts = []
    for i, p in enumerate(_parts(si, "systemInstruction")):
        if "text" not in p:
            _refuse_part(p, f"systemInstruction.parts[{i}]")
        texts.append(_text(p["text"], f"systemInstruction.parts[{i}].text"))
    return "\n".join(texts)


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise TranslationError(f"{where} must be a string")
    return value


def _tool_content(response) -> str:
    """A functionResponse's `response` as tool-message text: Gemini CLI wraps a tool's text as
    {"output": text} (or {"error": text}); that text alone is what the model should read, anything
    else goes as its JSON."""
    if isinstance(response, dict) and len(response) == 1:
        (key, value), = response.items()
        if key == "output" and isinstance(value, str):
            return value
    return json.dumps(response, ensure_ascii=False)


class _Calls:
    """The functionCalls of the latest model turn waiting for their functionResponse (by id when
    the harness echoes one, else by name in order) and the chat ids minted for them."""

    def __init__(self) -> None:
        self.pending: list[tuple[str | None, str, str]] = []  # (gemini id, name, chat id)
        self.count = 0

    def new(self, gid, name: str) -> str:
        self.count += 1
        chat_id = f"call_{self.count}"
        self.pending.append((gid, name, chat_id))
        return chat_id

    def answer(self, gid, name, where: str) -> str:
        for k, (pid, pname, chat_id) in enumerate(self.pending):
            if (gid is not None and pid == gid) or (gid is None or pid is None) and pname == name:
                del self.pending[k]
                return chat_id
        raise TranslationError(f"{where}: functionResponse for {name!r} (id {gid!r}) has no matching "
                               "functionCall in an earlier model turn")


def _user_messages(parts: list[dict], calls: _Calls, notes: list[str], where: str) -> list[dict]:
    tools, texts = [], []
    for j, p in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if "functionResponse" in p:
            fr = p["functionResponse"]
            if not isinstance(fr, dict) or not isinstance(fr.get("name"), str):
                raise TranslationError(f"{at}.functionResponse must be an object with a name")
            if fr.get("parts"):
                raise TranslationError(f"{at}.functionResponse.parts (multimodal results) are not supported")
            chat_id = calls.answer(fr.get("id"), fr["name"], at)
            tools.append({"role": "tool", "tool_call_id": chat_id, "content": _tool_content(fr.get("response"))})
        elif "text" in p:
            if p.get("thought"):
                join_notes(notes, "thought part in a user turn dropped")
                continue
            texts.append(_text(p["text"], f"{at}.text"))
        else:
            _refuse_part(p, at)
    out = tools
    if texts or not tools:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _model_message(parts: list[dict], calls: _Calls, notes: list[str], where: str) -> dict:
    texts, thoughts, tool_calls, signed = [], [], [], None
    calls.pending.clear()  # (a model turn answers nothing: results of an older turn are not owed any more)
    for j, p in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if "thoughtSignature" in p and signed is None:
            signed = decode_reasoning(p["thoughtSignature"])
            if signed is None:
                join_notes(notes, "thoughtSignature not made by this proxy dropped")
        if "functionCall" in p:
            fc = p["functionCall"]
            if not isinstance(fc, dict) or not isinstance(fc.get("name"), str):
                raise TranslationError(f"{at}.functionCall must be an object with a name")
            args = fc.get("args") if fc.get("args") is not None else {}
            if not isinstance(args, dict):
                raise TranslationError(f"{at}.functionCall.args must be an object")
            tool_calls.append({"id": calls.new(fc.get("id"), fc["name"]), "type": "function", "function": {
                "name": fc["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        elif "text" in p:
            (thoughts if p.get("thought") else texts).append(_text(p["text"], f"{at}.text"))
        elif p.keys() <= {"thoughtSignature", "thought"}:
            continue  # a bare signature part
        else:
            _refuse_part(p, at)
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    reasoning = "".join(thoughts) if thoughts else signed
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def convert_contents(body: dict, notes: list[str]) -> list[dict]:
    contents = body.get("contents")
    if isinstance(contents, dict):
        contents = [contents]
    if not isinstance(contents, list) or not contents:
        raise TranslationError("contents must be a non-empty list of Content objects")
    out: list[dict] = []
    system = _system_text(body)
    if system:
        out.append({"role": "system", "content": system})
    calls = _Calls()
    for i, c in enumerate(contents):
        where = f"contents[{i}]"
        parts = _parts(c, where)
        role = (c.get("role") if isinstance(c, dict) else None) or "user"
        if role == "user":
            out.extend(_user_messages(parts, calls, notes, where))
        elif role == "model":
            out.append(_model_message(parts, calls, notes, where))
        else:
            raise TranslationError(f"{where}: unknown role {role!r} (user or model)")
    return out


def _openapi_schema(schema):
    """An OpenAPI-style Schema (types in upper case: OBJECT, STRING) as JSON Schema."""
    if isinstance(schema, list):
        return [_openapi_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            out[k] = v.lower()
        elif k in ("properties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _openapi_schema(s) for name, s in v.items()}
        elif k in ("items", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[k] = _openapi_schema(v)
        else:
            out[k] = v
    return out


def convert_tools(body: dict, notes: list[str]) -> list[dict]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise TranslationError("tools must be a list of Tool objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise TranslationError(f"tools[{i}] must be a Tool object")
        t = _camel_keys(t)
        for key in t:
            if key in HOSTED_TOOLS:
                join_notes(notes, f"dropped Google hosted tool {key}")
            elif key != "functionDeclarations":
                raise TranslationError(f"tools[{i}]: unknown tool kind {key!r}")
        for j, fd in enumerate(t.get("functionDeclarations") or ()):
            fd = _camel_keys(fd)
            if not isinstance(fd.get("name"), str) or not fd["name"]:
                raise TranslationError(f"tools[{i}].functionDeclarations[{j}] has no name")
            params = fd.get("parametersJsonSchema")
            if params is None and fd.get("parameters") is not None:
                params = _openapi_schema(fd["parameters"])
            if params is not None and not isinstance(params, dict):
                raise TranslationError(f"tools[{i}].functionDeclarations[{j}] parameters must be an object schema")
            out.append(function_tool(fd["name"], fd.get("description", ""), params, None))
    return out


def convert_tool_config(body: dict, chat: dict) -> None:
    cfg = body.get("toolConfig")
    if cfg is None:
        return
    fcc = _camel_keys(cfg).get("functionCallingConfig") if isinstance(cfg, dict) else None
    if fcc is None:
        return
    if not isinstance(fcc, dict):
        raise TranslationError("toolConfig.functionCallingConfig must be an object")
    fcc = _camel_keys(fcc)
    mode = fcc.get("mode") or "AUTO"
    allowed = fcc.get("allowedFunctionNames") or []
    if mode in ("AUTO", "MODE_UNSPECIFIED", "VALIDATED"):
        chat["tool_choice"] = "auto"
    elif mode == "NONE":
        chat["tool_choice"] = "none"
    elif mode == "ANY":
        chat["tool_choice"] = forced_tool(allowed[0]) if len(allowed) == 1 else "required"
    else:
        raise TranslationError(f"toolConfig.functionCallingConfig.mode: unknown mode {mode!r}")


class GeminiTranslator(ChatTranslator):
    api = "gemini"
    DROPPED = DROPPED
    KNOWN = frozenset({"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "model",
                       *DROPPED})

    def __init__(self, normalize: bool = True, model: str = "", stream: bool = False, sse: bool = True) -> None:
        super().__init__(normalize)
        self.model = model
        self.stream = stream
        self._sse = sse
        self.include_thoughts = True
        self._resp_id = new_id("resp")
        self._calls: dict[int, list] = {}  # upstream tool index -> [name, argument text]
        self._reasoning: list[str] = []

    # ---- request ----
    def request_to_chat(self, body, headers=None) -> dict:
        if isinstance(body, dict):
            body = _camel_keys(body)
        chat = super().request_to_chat(body, headers)
        stream_options(chat, self.stream)  # the path says whether to stream, not the body
        return chat

    def _to_chat(self, body: dict) -> dict:
        if self.stream and not self._sse:
            raise TranslationError("streamGenerateContent without alt=sse (the JSON-array stream) is not "
                                   "supported: ask for ?alt=sse")
        if not self.model:
            self.model = body.get("model") if isinstance(body.get("model"), str) else ""
        chat: dict = {"model": self.model.removeprefix("models/"),
                      "messages": convert_contents(body, self.notes)}
        tools = convert_tools(body, self.notes)
        if tools:
            chat["tools"] = tools
        convert_tool_config(body, chat)
        schema = self._generation(body, chat)
        self._auxiliary_if(schema is not None, tools)  # Gemini CLI's next-speaker check and the like
        last = chat["messages"][-1]
        if last["role"] == "assistant" and not last.get("tool_calls"):
            chat["continue_final_message"] = True  # the answer continues the model's last turn
            chat["add_generation_prompt"] = False
            join_notes(self.notes, "trailing model turn sent as continue_final_message")
        return chat

    def _generation(self, body: dict, chat: dict):
        gen = body.get("generationConfig")
        if gen is None:
            gen = {}
        if not isinstance(gen, dict):
            raise TranslationError("generationConfig must be an object")
        gen = _camel_keys(gen)
        for key, name in GEN_FIELDS.items():
            if gen.get(key) is not None:
                chat[name] = gen[key]
        stops = gen.get("stopSequences")
        if stops:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise TranslationError("generationConfig.stopSequences must be a list of strings")
            chat["stop"] = stops
        n = gen.get("candidateCount")
        if n is not None and n != 1:
            raise TranslationError(f"generationConfig.candidateCount {n!r}: this proxy returns one candidate")
        for key in gen.keys() - GEN_FIELDS.keys() - GEN_OTHER:
            join_notes(self.notes, f"dropped unknown generationConfig field {key}")
        for key in ("responseLogprobs", "logprobs", "responseModalities", "mediaResolution", "speechConfig"):
            if key in gen:
                join_notes(self.notes, f"dropped generationConfig.{key}")
        self._thinking(gen.get("thinkingConfig"), chat)
        schema = gen.get("responseJsonSchema")
        if schema is None and gen.get("responseSchema") is not None:
            schema = _openapi_schema(gen["responseSchema"])
        if schema is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        elif gen.get("responseMimeType") == "application/json":
            chat["response_format"] = {"type": "json_object"}
        return schema

    def _thinking(self, cfg, chat: dict) -> None:
        if cfg is None:
            cfg = {}
        if not isinstance(cfg, dict):
            raise TranslationError("generationConfig.thinkingConfig must be an object")
        cfg = _camel_keys(cfg)
        budget = cfg.get("thinkingBudget")
        # Gemini models think unless the budget is 0; includeThoughts only says whether the
        # thoughts come back (they are sampled tokens either way, and go into the signature).
        chat["chat_template_kwargs"] = {"enable_thinking": budget != 0}
        self.include_thoughts = bool(cfg.get("includeThoughts"))
        if budget not in (None, 0, -1):
            join_notes(self.notes, "thinkingConfig.thinkingBudget dropped (no chat equivalent)")
        level = cfg.get("thinkingLevel")
        if isinstance(level, str):
            reasoning_effort(level.lower(), chat, self.notes)

    # ---- errors ----
    def error_body(self, status: int, message: str) -> tuple[bytes, str]:
        state = STATUS.get(status, "INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
        return dumps({"error": {"code": status, "message": message, "status": state}}), "application/json"

    # ---- answer ----
    def _usage(self, counts: dict) -> dict:
        usage = {"promptTokenCount": counts["input"], "candidatesTokenCount": counts["output"],
                 "totalTokenCount": counts["input"] + counts["output"]}
        if counts["cached"]:
            usage["cachedContentTokenCount"] = counts["cached"]
        if counts["reasoning"]:
            usage["thoughtsTokenCount"] = counts["reasoning"]
        return usage

    def _candidate(self, parts: list[dict], finish: str | None) -> dict:
        cand: dict = {"content": {"role": "model", "parts": parts}, "index": 0}
        if finish is not None:
            cand["finishReason"] = FINISH.get(finish, "OTHER")
        return cand

    def _answer(self, parts: list[dict], finish: str | None, usage: dict | None) -> dict:
        out: dict = {"candidates": [self._candidate(parts, finish)]}
        if usage is not None:
            out["usageMetadata"] = usage
        out["modelVersion"] = self.model
        out["responseId"] = self._resp_id
        return out

    def _final_parts(self, reasoning: str, text: str | None, calls: list[tuple[str, str]]) -> list[dict]:
        """The text part (if any) and the functionCall parts; the reasoning goes into the
        thoughtSignature of the first functionCall, else of the text part (as the real API does)."""
        parts: list[dict] = []
        if text is not None:
            parts.append({"text": text})
        for name, args in calls:
            parts.append({"functionCall": {"name": name, "args": tool_arguments(args, self.notes)}})
        if reasoning:
            target = next((p for p in parts if "functionCall" in p), parts[-1] if parts else None)
            if target is None:
                parts.append(target := {"text": ""})
            target["thoughtSignature"] = encode_reasoning(reasoning)
        return parts

    def response_from_chat(self, chat_resp: dict) -> dict:
        choice, msg = first_choice(chat_resp)
        reasoning = message_reasoning(msg) or ""
        calls = [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
                 for c in msg.get("tool_calls") or ()]
        text = msg.get("content") or None
        parts = []
        if reasoning and self.include_thoughts:
            parts.append({"text": reasoning, "thought": True})
        parts += self._final_parts(reasoning, text if text or not calls else None, calls)
        counts = usage_counts(chat_resp.get("usage"), prompt_len(chat_resp))
        return self._answer(parts, choice.get("finish_reason") or "stop", self._usage(counts))

    # ---- streaming answer (ChatTranslator.feed_chunk / finish) ----
    @staticmethod
    def _chunk(obj: dict) -> bytes:
        return b"data: " + dumps(obj) + b"\r\n\r\n"  # the framing the Gemini API streams with

    def _start(self, out: list) -> None:
        self._started = True  # the Gemini stream has no opening event: the first part opens it

    def _step(self, step: tuple, out: list) -> None:
        kind = step[0]
        if kind == "reasoning":
            self._reasoning.append(step[1])
            if self.include_thoughts:
                out.append(self._chunk(self._answer([{"text": step[1], "thought": True}], None, None)))
        elif kind == "text":
            out.append(self._chunk(self._answer([{"text": step[1]}], None, None)))
        elif kind == "tool_start":
            self._calls[step[1]] = [step[3], ""]
        elif kind == "tool_args":
            self._calls[step[1]][1] += step[2]

    def _end(self, out: list) -> None:
        calls = [(name, args) for _, (name, args) in sorted(self._calls.items())]
        # the last chunk: the calls whole, the signature, the finish reason and the usage; an empty
        # text part when there is nothing else, as the real API ends a stream
        parts = self._final_parts("".join(self._reasoning), None if calls else "", calls)
        counts = usage_counts(self._reader.usage, self._reader.prompt_len)
        out.append(self._chunk(self._answer(parts, self._reader.finish_reason or "stop", self._usage(counts))))

    def fail(self, message: str) -> bytes:
        self._finished = True
        return self._chunk({"error": {"code": 500, "message": message, "status": "INTERNAL"}})

