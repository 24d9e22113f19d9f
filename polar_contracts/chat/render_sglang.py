"""How SGLang 0.5.23 prepares a chat request for a Jinja chat template (the SGLang half of render.py).

Followed, line by line, from the sglang 0.5.23 wheel (tests/serve/test_sglang_render.py runs that
wheel's own code on the same requests and compares):
- `srt/entrypoints/openai/protocol.py`: `ChatCompletionRequest` (`set_tool_choice_default`: "none"
  without tools, else "auto"; `normalize_reasoning_inputs`: a `reasoning_effort` sets
  `chat_template_kwargs.thinking` / `.enable_thinking` to `effort != "none"` unless given), the
  message models `ChatCompletionMessageUserParam` / `ChatCompletionMessageGenericParam` (fields
  role, content, tool_call_id, name, phase, reasoning_content, tool_calls, tools, prefix; unknown
  keys such as `reasoning` are ignored; generic roles are lower-cased), `ToolCall` / `FunctionResponse`,
  and `Tool` / `Function`: `Tool.model_dump()` is `{"type", "function", "defer_loading"}` (the
  tool-level `defer_loading` kept, null when unset, and copied into the function when that has
  none); the function keeps the CLIENT's key order, then the fields it left out (`description` /
  `parameters` as null), drops `strict` / `defer_loading` when null and drops unknown keys.
- `serving_chat.py`: `_validate_request` (tool_choice checks; `normalize_json_schema_types`
  rewrites DB-style `type` names in the parameters IN PLACE, so the prompt shows the rewrite),
  `_convert_to_internal_request` (`chat_template_kwargs.reasoning_effort` moves to the request),
  `_process_messages` (tools = `item.model_dump()` of the request's tools; none with tool_choice
  "none"; only the named one with a named tool_choice) and `_apply_jinja_template`: messages are
  `msg.model_dump()`, assistant tool-call `arguments` strings json-decoded (must be an object),
  `content: null` -> "", `process_content_for_template_format` ("string" format for a template
  that does not loop over content, e.g. Qwen3: text parts joined with " ", other parts dropped,
  null fields removed), `_handle_last_assistant_message` (a final assistant turn becomes a USER
  turn, or with `continue_final_message` is cut off and its text encoded after the prompt), the
  template kwargs (`reasoning_effort` when set, then `chat_template_kwargs`), always
  `add_generation_prompt=True`, and a retry with function-only tools when the template fails.
"""
from __future__ import annotations

import copy
import json
from typing import Any

from polar_contracts.chat import RequestError, content_parts, part_text
from polar_contracts.request_fields import FALSE_STRINGS, TRUE_STRINGS

GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")
_MESSAGE_FIELDS = ("tool_call_id", "name", "phase", "reasoning_content", "tool_calls", "tools", "prefix")
_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def _opt_bool(v: Any, where: str) -> bool | None:
    """pydantic's lax bool (Optional[bool] fields)."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in TRUE_STRINGS | FALSE_STRINGS:
        return v.strip().lower() in TRUE_STRINGS
    raise RequestError(f"{where} must be a boolean")


def _opt_str(v: Any, where: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise RequestError(f"{where} must be a string")
    return v


# -- tools ----------------------------------------------------------------------------------------
# function_call/utils.py normalize_json_schema_types (run by _validate_request on every tool).
_STANDARD_TYPES = {"null", "boolean", "object", "array", "number", "string", "integer"}
_TYPE_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "uuid": "string", "date": "string", "datetime": "string", "time": "string", "timestamp": "string",
    "binary": "string", "blob": "string", "bytea": "string", "bytes": "string", "varbinary": "string",
    "bool": "boolean", "bigint": "integer", "smallint": "integer", "tinyint": "integer",
    "double": "number", "decimal": "number", "real": "number", "numeric": "number",
    "arr": "array", "tuple": "array", "set": "array", "map": "object",
}
_PREFIX_BOUNDARY = frozenset("0123456789[<( \t")
_PREFIX_RULES = ((("int", "uint", "long", "short", "unsigned"), "integer"), (("num", "float"), "number"),
                 (("list",), "array"), (("dict",), "object"))


def _normalize_type(raw: Any) -> Any:
    if not isinstance(raw, str) or raw in _STANDARD_TYPES:
        return raw
    base = raw.split("(", 1)[0].strip().lower()
    if base in _STANDARD_TYPES:
        return base
    if base in _TYPE_ALIASES:
        return _TYPE_ALIASES[base]
    for prefixes, target in _PREFIX_RULES:
        for p in prefixes:
            if base == p or (len(base) > len(p) and base.startswith(p) and base[len(p)] in _PREFIX_BOUNDARY):
                return target
    return raw


def normalize_schema_types(schema: Any) -> None:
    """SGLang's in-place rewrite of non-standard JSON-schema `type` names ("varchar" -> "string")."""
    if isinstance(schema, list):
        for item in schema:
            normalize_schema_types(item)
        return
    if not isinstance(schema, dict):
        return
    if "type" in schema:
        t = schema["type"]
        if isinstance(t, str):
            schema["type"] = _normalize_type(t)
        elif isinstance(t, list):
            out: list = []
            for item in t:
                n = _normalize_type(item)
                if n not in out:
                    out.append(n)
            schema["type"] = out
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        nested = schema.get(key)
        if isinstance(nested, dict):
            for v in nested.values():
                normalize_schema_types(v)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        nested = schema.get(key)
        if isinstance(nested, list):
            for v in nested:
                normalize_schema_types(v)
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                "unevaluatedItems", "unevaluatedProperties"):
        if key in schema:
            normalize_schema_types(schema[key])


def tool_dump(t: Any, where: str) -> dict:
    """`Tool.model_validate(t).model_dump()` of protocol.py (parameters normalized as _validate_request does)."""
    if not isinstance(t, dict):
        raise RequestError(f"{where} must be an object")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where}.function.name is required")
    ttype = t.get("type", "function")
    if not isinstance(ttype, str):
        raise RequestError(f"{where}.type must be a string")
    tool_defer = _opt_bool(t.get("defer_loading"), f"{where}.defer_loading")
    params = copy.deepcopy(fn.get("parameters"))
    normalize_schema_types(params)
    data = {"description": _opt_str(fn.get("description"), f"{where}.function.description"), "name": fn["name"],
            "parameters": params, "strict": _opt_bool(fn.get("strict"), f"{where}.function.strict"),
            "defer_loading": _opt_bool(fn.get("defer_loading"), f"{where}.function.defer_loading")}
    if tool_defer is not None and data["defer_loading"] is None:  # Tool._propagate_defer_loading
        data["defer_loading"] = tool_defer
    for k in ("defer_loading", "strict"):  # Function._serialize
        if data[k] is None:
            del data[k]
    order = [k for k in fn if k != "key_order"]
    rest = [k for k in data if k not in order]
    data = {k: data[k] for k in order + rest if k in data}
    return {"type": ttype, "function": data, "defer_loading": tool_defer}


def tool_choice_of(body: dict) -> Any:
    """The request's tool_choice after `set_tool_choice_default` (a dict = a named function)."""
    tc = body.get("tool_choice")
    if tc is None:
        has_message_tools = any(isinstance(m, dict) and isinstance(m.get("role"), str)
                                and m["role"].lower() in ("root", "system", "developer") and m.get("tools")
                                for m in body.get("messages") or [] if isinstance(m, dict))
        return "none" if body.get("tools") is None and not has_message_tools else "auto"
    if isinstance(tc, str):
        if tc not in ("auto", "required", "none"):
            raise RequestError("'tool_choice' must be 'auto', 'required', 'none' or a named function")
        return tc
    if isinstance(tc, dict) and isinstance(tc.get("function"), dict):
        return tc
    raise RequestError("'tool_choice' must be 'auto', 'required', 'none' or a named function")


def _request_tools(tools: Any) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    return [tool_dump(t, f"tools[{i}]") for i, t in enumerate(tools)]


def check_tool_choice(body: dict) -> None:
    """The tool_choice checks of serving_chat.py `_validate_request` (400 with its messages)."""
    tools = _request_tools(body.get("tools"))
    for m in body.get("messages") or []:
        if isinstance(m, dict) and str(m.get("role", "")).lower() in ("root", "system", "developer") and m.get("tools"):
            tools += _request_tools(m["tools"])
    tc = tool_choice_of(body)
    if tc == "required" and not tools:
        raise RequestError("Tools cannot be empty if tool choice is set to required.")
    if isinstance(tc, dict):
        if not tools:
            raise RequestError("Tools cannot be empty if tool choice is set to a specific tool.")
        name = tc["function"].get("name")
        if not any(t["function"]["name"] == name for t in tools):
            raise RequestError(f"Tool '{name}' not found in tools list.")


def template_tools(body: dict) -> list[dict] | None:
    """`tools` as serving_chat.py `_process_messages` hands them to the template (None = none)."""
    tools = _request_tools(body.get("tools"))
    tc = tool_choice_of(body)
    if not tools or tc == "none":  # (message-level tools only count for the checks)
        return None
    if isinstance(tc, dict):
        name = tc["function"].get("name")
        return [t for t in tools if t["function"]["name"] == name] or None
    return tools


# -- messages -------------------------------------------------------------------------------------
def _content(content: Any, role: str, where: str) -> Any:
    """The content after pydantic validation and process_content_for_template_format("string")."""
    parts = content_parts(content, where)
    if parts is None:
        return content
    texts = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"{where}.content[{i}] must be an object with a 'type'")
        kind = part["type"]
        if kind == "text":
            texts.append(part_text(part, i, where))
        elif kind in ("thinking", "reasoning"):
            if role != "assistant":
                raise RequestError("thinking content parts are only valid in assistant messages")
        elif kind in ("image_url", "video_url", "audio_url", "input_audio"):  # _validate_media_content
            media = "audio_url" if kind == "input_audio" else kind
            raise RequestError(f"Model only supports text input; received unsupported content type '{media}'.")
        elif kind != "tool_reference":
            raise RequestError(f"{where}.content[{i}]: unknown content part type {kind!r}")
    return " ".join(texts)


def _tool_calls(tcs: Any, where: str, decode: bool) -> list[dict]:
    """`ToolCall.model_dump()` of each call; on an assistant turn string arguments are json-decoded
    (normalize_assistant_tool_call_arguments)."""
    if not isinstance(tcs, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = []
    for j, tc in enumerate(tcs):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
            raise RequestError(f"{w}.function is required")
        if tc.get("type", "function") != "function":
            raise RequestError(f"{w}.type must be 'function'")
        fn = tc["function"]
        args = fn.get("arguments")
        if args is not None and not isinstance(args, (str, dict)):
            raise RequestError(f"{w}.function.arguments must be a string or an object")
        if isinstance(args, str) and decode:
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise RequestError("Assistant tool call function.arguments must be valid JSON.") from None
            if not isinstance(args, dict):
                raise RequestError("Assistant tool call function.arguments must be a JSON object.")
        index = tc.get("index")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            raise RequestError(f"{w}.index must be an integer")
        out.append({"id": _opt_str(tc.get("id"), f"{w}.id"), "index": index, "type": "function",
                    "function": {"name": _opt_str(fn.get("name"), f"{w}.function.name"), "arguments": args}})
    return out


def _message(m: Any, where: str) -> dict:
    """One message as `_apply_jinja_template` hands it on: model_dump, content null -> "", string
    content format, null fields removed."""
    if not isinstance(m, dict):
        raise RequestError(f"{where} must be an object")
    role = m.get("role")
    if role == "user":
        if "content" not in m or m["content"] is None:
            raise RequestError(f"{where}.content is required for a user message")
        return {"role": "user", "content": _content(m["content"], role, where)}
    if not isinstance(role, str) or role.lower() not in GENERIC_ROLES:
        allowed = ", ".join(repr(r) for r in GENERIC_ROLES)
        raise RequestError(f"{where}: 'role' must be 'user' or one of {allowed} (case-insensitive).")
    role = role.lower()
    content = _content(m.get("content"), role, where)
    msg: dict[str, Any] = {"role": role, "content": "" if content is None else content}
    for key in _MESSAGE_FIELDS:
        v = m.get(key)
        if v is None:
            continue
        if key == "tool_calls":
            v = _tool_calls(v, where, role == "assistant")
        elif key == "tools":
            v = _request_tools(v)
        elif key == "prefix":
            v = _opt_bool(v, f"{where}.prefix")
        elif key == "phase" and v not in ("commentary", "final_answer"):
            raise RequestError(f"{where}.phase must be 'commentary' or 'final_answer'")
        elif key != "phase":
            v = _opt_str(v, f"{where}.{key}")
        msg[key] = v
    return msg


def template_messages(messages: Any, continue_final: bool = False) -> tuple[list[dict], str | None]:
    """(messages for the template, assistant prefix encoded after the prompt or None)."""
    if not isinstance(messages, list):
        raise RequestError("'messages' must be a list of messages")
    if not messages:
        raise RequestError("Messages cannot be empty.")
    out = [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    prefix = None
    if out[-1]["role"] == "assistant" and isinstance(out[-1].get("content"), str):
        if continue_final:
            prefix = out[-1]["content"]
            out = out[:-1]
        else:
            out[-1] = {"role": "user", "content": out[-1]["content"]}
    return out, prefix


def template_kwargs(body: dict) -> dict:
    """The template kwargs of `_apply_jinja_template` (add_generation_prompt aside)."""
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    kw = dict(kw or {})
    effort = body.get("reasoning_effort")
    reasoning = body.get("reasoning")
    thinking = None
    if isinstance(reasoning, dict):  # normalize_reasoning_inputs
        e = reasoning.get("effort", reasoning.get("reasoning_effort"))
        if e is not None:
            effort = e
        enabled = reasoning.get("enabled") if reasoning.get("enabled") is not None else reasoning.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in TRUE_STRINGS
        if enabled:
            thinking = True
    if effort is not None:
        thinking = effort != "none"
    if thinking is not None:
        kw.setdefault("thinking", thinking)
        kw.setdefault("enable_thinking", thinking)
    moved = kw.pop("reasoning_effort", None)  # _convert_to_internal_request
    if moved is not None:
        effort = moved
    if "chat_template" in kw:
        raise RequestError("Request-supplied chat_template is not allowed. Start the server "
                           "with --trust-request-chat-template to permit it.")
    out = {"reasoning_effort": effort} if effort is not None else {}
    out.update(kw)
    return out


def render(tokenizer, body: dict) -> tuple[str, str | None]:
    """(the rendered prompt text, the assistant prefix appended as ids after it or None)."""
    check_tool_choice(body)
    msgs, prefix = template_messages(body.get("messages"), bool(body.get("continue_final_message")))
    tools = template_tools(body)
    kw = template_kwargs(body)
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, tools=tools,
                                             return_dict=False, **kw)
    except Exception:  # serving_chat retries with function-only tools (templates such as Mistral's)
        flat = [t["function"] if "function" in t else t for t in tools] if tools else None
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, tools=flat,
                                                 return_dict=False, **kw)
        except Exception as e:
            raise RequestError(f"chat template failed: {e}") from None
    return text, prefix


def render_chat(tokenizer, body: dict) -> tuple[str, list[int]]:
    """Prompt text and ids: the rendered text encoded, then the encoded assistant prefix
    (`_append_assistant_prefix_to_prompt_ids`: a leading BOS dropped)."""
    text, prefix = render(tokenizer, body)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if prefix:
        more = list(tokenizer.encode(prefix))
        if more and more[0] == tokenizer.bos_token_id:
            more = more[1:]
        return text + prefix, ids + more
    return text, ids
