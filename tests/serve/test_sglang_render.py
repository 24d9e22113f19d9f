"""polar-serve's SGLang prompt rendering (polar_contracts.chat.render_sglang) against SGLang 0.5.23's own code.

The sglang 0.5.23 wheel comes from PyPI at setup (`pip download --no-deps`, cached under
$POLAR_CACHE/sglang-0.5.23; skipped with a message when PyPI is unreachable, which fails under
POLAR_NO_SKIP=1). SGLang itself cannot be imported here (no CPU build; it needs pybase64, msgspec,
fastapi, ...), so the reference is assembled from the wheel's source files:

REAL SGLang code (the wheel's text, unmodified):
- `srt/entrypoints/openai/protocol.py`, imported whole: ChatCompletionRequest (its validators),
  the message models, Tool / Function (their serializers), MessageProcessingResult;
- from `srt/entrypoints/openai/serving_chat.py`, compiled from the wheel's AST: the module functions
  normalize_tool_content, parse_tool_call_arguments, normalize_assistant_tool_call_arguments, the
  ThinkingMode enum, and the OpenAIServingChat methods _effective_tools, _validate_request,
  _validate_media_content, _convert_to_internal_request (up to rendering), _process_messages,
  _apply_jinja_template, _handle_last_assistant_message, _append_assistant_prefix_to_prompt_ids,
  _render_and_encode_chat_template, _encode_messages, _probe_prompt_text_round_trip;
- `srt/parser/jinja_template_utils.py`, imported whole (content-format detection, content flattening);
- from `srt/function_call/utils.py`: normalize_json_schema_types and its helpers.

STUBS (this file): the `msgspec` module (protocol.py only subclasses msgspec.Struct once),
`sglang.utils.convert_json_schema_to_str` and `sglang.srt.utils` (names jinja_template_utils imports
for media parts), get_serving()/get_model() (server flags: no request chat templates, context 40960),
jsonschema's Draft202012Validator (not installed: schemas are not checked), parallel_prompt_encode
(documented as a drop-in for tokenizer.encode), the hunyuan/minimax/kimi/GLM/grammar hooks (not
reached for Qwen3, or building sampling constraints only: tool_call_parser is None here, which
changes no rendered text), `_get_reasoning_from_request` / `_thinking_requested` (they pick
sampling and custom-encoder modes, not the Jinja input), the attribute `_tokenizer_auto_adds_specials`
(one line of __init__: len(tokenizer.encode("")) > 0). `_process_messages` is wrapped to stop
after rendering (the rest builds the GenerateReqInput).
"""
from __future__ import annotations
import __future__

import ast
import copy
import fcntl
import json
import logging
import subprocess
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import polar_contracts.chat.render_sglang as ours
from harness_recipes.cache import polar_cache
from polar_contracts.chat.render import RequestError, render_chat, render_rules

SGLANG_VERSION = "0.5.23"
FILES = ("sglang/srt/entrypoints/openai/protocol.py", "sglang/srt/entrypoints/openai/serving_chat.py",
         "sglang/srt/parser/jinja_template_utils.py", "sglang/srt/function_call/utils.py")


def sglang_source() -> Path:
    """The wheel's source files, extracted once into the cache (file lock: parallel test processes)."""
    root = polar_cache(f"sglang-{SGLANG_VERSION}")
    done = root / ".complete"
    if done.is_file():
        return root / "src"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            wheels = list((root / "wheel").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
            if not wheels:
                cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
                       f"sglang=={SGLANG_VERSION}", "-d", str(root / "wheel")]
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                except subprocess.TimeoutExpired:
                    pytest.skip(f"PyPI timed out downloading sglang=={SGLANG_VERSION} (`{' '.join(cmd)}`)")
                wheels = list((root / "wheel").glob(f"sglang-{SGLANG_VERSION}-*.whl"))
                if r.returncode != 0 or not wheels:
                    pytest.skip(f"could not download sglang=={SGLANG_VERSION} from PyPI (`{' '.join(cmd)}`): "
                                f"{(r.stderr or r.stdout).strip()[-300:]}")
            with zipfile.ZipFile(wheels[0]) as z:
                for name in FILES:
                    z.extract(name, root / "src")
            done.write_text("ok\n")
    return root / "src"


class _Obj(types.SimpleNamespace):
    pass


def _stub_module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def _load_file(name: str, path: Path) -> types.ModuleType:
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _pick(tree: ast.Module, names: set[str]) -> list[ast.stmt]:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            out.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in names for t in node.targets):
            out.append(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
            out.append(node)
    missing = names - {getattr(n, "name", None) or getattr(getattr(n, "target", None), "id", None)
                       or n.targets[0].id for n in out}
    assert not missing, f"not in the wheel's source: {missing}"
    return out


def _compile(nodes: list[ast.stmt], filename: str, ns: dict) -> None:
    mod = ast.Module(body=nodes, type_ignores=[])
    ast.fix_missing_locations(mod)
    exec(compile(mod, filename, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)


METHODS = {"_effective_tools", "_validate_request", "_validate_media_content", "_convert_to_internal_request",
           "_process_messages", "_apply_jinja_template", "_handle_last_assistant_message",
           "_append_assistant_prefix_to_prompt_ids", "_render_and_encode_chat_template", "_encode_messages",
           "_probe_prompt_text_round_trip"}


class Rendered(Exception):
    def __init__(self, result):
        self.result = result


@pytest.fixture(scope="module")
def sglang_ref():
    src = sglang_source()
    saved = {k: sys.modules.get(k) for k in ("msgspec",)}
    stubs = {
        "sglang": _stub_module("sglang", __path__=[]),
        "sglang.utils": _stub_module("sglang.utils", convert_json_schema_to_str=lambda s: json.dumps(s)),
        "sglang.srt": _stub_module("sglang.srt", __path__=[]),
        "sglang.srt.entrypoints": _stub_module("sglang.srt.entrypoints", __path__=[]),
        "sglang.srt.entrypoints.openai": _stub_module("sglang.srt.entrypoints.openai", __path__=[]),
        "sglang.srt.parser": _stub_module("sglang.srt.parser", __path__=[]),
        "sglang.srt.utils": _stub_module("sglang.srt.utils", GLM_MEDIA_CONFIG_KEYS=(), ImageData=dict, VideoData=dict),
        "msgspec": _stub_module("msgspec", Struct=type("Struct", (), {"__init_subclass__": classmethod(
            lambda cls, **kw: None)})),
    }
    sys.modules.update(stubs)
    try:
        protocol = _load_file("sglang.srt.entrypoints.openai.protocol", src / FILES[0])
        jtu = _load_file("sglang.srt.parser.jinja_template_utils", src / FILES[2])
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    ns: dict[str, Any] = {k: v for k, v in vars(protocol).items() if not k.startswith("__")}
    import typing

    import jinja2
    import orjson
    ns.update({k: getattr(typing, k) for k in ("Any", "Dict", "List", "Tuple", "Optional", "Union")})
    fc_utils = ast.parse((src / FILES[3]).read_text())
    _compile(_pick(fc_utils, {"_STANDARD_JSON_SCHEMA_TYPES", "_JSON_SCHEMA_TYPE_ALIASES", "_PREFIX_BOUNDARY_CHARS",
                              "_PREFIX_RULES", "_matches_type_prefix", "_normalize_single_type",
                              "_normalize_type_list", "normalize_json_schema_types"}), str(src / FILES[3]), ns)

    class SchemaError(Exception):
        pass

    class _NoClass:
        pass

    from enum import Enum
    from http import HTTPStatus

    ns.update(
        Enum=Enum, HTTPStatus=HTTPStatus, copy=copy, json=json, orjson=orjson, jinja2=jinja2,
        logger=logging.getLogger("sglang-ref"),
        process_content_for_template_format=jtu.process_content_for_template_format,
        _CHAT_TEMPLATE_CLIENT_ERRORS=(jinja2.TemplateError, TypeError),
        # --- stubs (see the module doc) ---
        get_serving=lambda: _Obj(trust_request_chat_template=False, allow_auto_truncate=False,
                                 default_chat_template_kwargs=None, return_input_ids=False, return_output_ids=False),
        get_model=lambda: _Obj(context_length=40960),
        Draft202012Validator=_Obj(check_schema=lambda schema: None), SchemaError=SchemaError,
        normalize_hunyuan_reasoning_effort=lambda *a, **k: None, uses_hunyuan_reasoning_effort=lambda *a: False,
        _normalize_minimax_m3_request=lambda r: None, _validate_minimax_m3_request=lambda r: None,
        get_json_schema_constraint=lambda *a, **k: {}, FunctionCallParser=None,
        ResponseTemplateToolDetector=_NoClass, ResponseTemplateReasoningDetector=_NoClass,
        parallel_prompt_encode=lambda tok, text, kw=None: tok.encode(text, **(kw or {})),
    )
    sc = ast.parse((src / FILES[1]).read_text())
    _compile(_pick(sc, {"ThinkingMode", "normalize_tool_content", "parse_tool_call_arguments",
                        "normalize_assistant_tool_call_arguments", "_MEDIA_CONTENT_PART_TYPES"}), str(src / FILES[1]), ns)
    cls = next(n for n in sc.body if isinstance(n, ast.ClassDef) and n.name == "OpenAIServingChat")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert {m.name for m in methods} == METHODS
    _compile([ast.ClassDef(name="ServingChatPieces", bases=[], keywords=[], body=methods, decorator_list=[],
                           type_params=[])], str(src / FILES[1]), ns)
    return types.SimpleNamespace(protocol=protocol, jtu=jtu, Pieces=ns["ServingChatPieces"], ns=ns)


class _RecordingTokenizer:
    """The tokenizer, with the arguments of each apply_chat_template call recorded."""

    def __init__(self, tok):
        self._tok = tok
        self.calls: list[tuple] = []

    def apply_chat_template(self, messages, **kw):
        self.calls.append((copy.deepcopy(messages), copy.deepcopy(kw)))
        return self._tok.apply_chat_template(messages, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def sglang_render(ref, tok, body: dict) -> tuple[list[int] | None, str | None, list]:
    """(prompt ids, error, apply_chat_template calls) of SGLang 0.5.23's own code for a chat body."""
    template = tok.chat_template
    rt = _RecordingTokenizer(tok)

    class Chat(ref.Pieces):
        def _process_messages(self, request, is_multimodal, **kw):
            raise Rendered(super()._process_messages(request, is_multimodal, **kw))

    tm = _Obj(reasoning_config=None, chat_template_name=None, python_chat_template=None, force_reasoning=False,
              jinja_template_content_format=ref.jtu.detect_jinja_template_content_format(template),
              jinja_template_may_reorder_tool_results=ref.jtu.jinja_template_may_reorder_tool_results(template))
    chat = Chat()
    chat.__dict__.update(
        tokenizer_manager=_Obj(tokenizer=rt, model_config=_Obj(is_multimodal=False, hf_config=None)),
        template_manager=tm, tool_call_parser=None, reasoning_parser="qwen3", default_chat_template_kwargs={},
        is_minimax_m3=False, is_gpt_oss=False, is_gemma4=False, chat_encoding_spec=None, _encoding_adapter=None,
        _reasoning_detector=None, _chat_template_cache=OrderedDict(),
        _tokenizer_auto_adds_specials=len(tok.encode("")) > 0,
        _patch_reasoning_skip_special_tokens=lambda r: None, _get_reasoning_from_request=lambda r: False,
        _thinking_requested=lambda r: False, _takes_turn_grammar=lambda r, **k: False,
        _requires_response_template_detokenization=lambda r: False,
    )
    chat._prompt_text_round_trip_is_lossy = chat._probe_prompt_text_round_trip()
    rt.calls.clear()
    try:
        request = ref.protocol.ChatCompletionRequest.model_validate(copy.deepcopy(body))
    except Exception as e:  # pydantic ValidationError: a 400
        return None, f"validation: {e}", []
    err = chat._validate_request(request)
    if err:
        return None, err, []
    try:
        chat._convert_to_internal_request(request, None)
    except Rendered as r:
        return list(r.result.prompt_ids), None, rt.calls
    except ValueError as e:
        return None, str(e), rt.calls
    raise AssertionError("the request was not rendered")


# -- the requests ---------------------------------------------------------------------------------
PARAMS = {"type": "object", "properties": {"command": {"type": "string"}, "n": {"type": "int32"}},
          "required": ["command"]}
T_ODD = {"function": {"parameters": PARAMS, "name": "bash", "description": "Run a command"}, "type": "function"}
T_MIN = {"type": "function", "function": {"name": "ls"}}
T_FULL = {"type": "function", "defer_loading": True, "function": {
    "strict": True, "name": "grep", "x_extra": 1, "parameters": {"type": "object", "properties": {
        "pattern": {"type": "varchar(20)"}, "flags": {"type": ["str", "null", "text"]}}}}}
T_NULLS = {"type": "function", "function": {"name": "cat", "description": None, "parameters": None, "strict": False,
                                            "defer_loading": False}}
USER = {"role": "user", "content": "hi"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls", "n": 1}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}

REQUESTS = {
    "plain": {"messages": [USER]},
    "tools-odd-key-order": {"messages": [USER], "tools": [T_ODD, T_MIN, T_FULL, T_NULLS]},
    "tool-choice-none": {"messages": [USER], "tools": [T_ODD], "tool_choice": "none"},
    "tool-choice-auto": {"messages": [USER], "tools": [T_ODD, T_MIN], "tool_choice": "auto"},
    "tool-choice-required": {"messages": [USER], "tools": [T_ODD, T_MIN], "tool_choice": "required"},
    "tool-choice-null": {"messages": [USER], "tools": [T_MIN], "tool_choice": None},
    "tool-choice-named": {"messages": [USER], "tools": [T_ODD, T_MIN, T_FULL],
                          "tool_choice": {"type": "function", "function": {"name": "grep"}}},
    "tool-choice-named-missing": {"messages": [USER], "tools": [T_MIN],
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "required-without-tools": {"messages": [USER], "tool_choice": "required"},
    "empty-tools": {"messages": [USER], "tools": []},
    "multi-part": {"messages": [{"role": "system", "content": [{"type": "text", "text": "be"},
                                                              {"type": "text", "text": "brief"}]},
                                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                                             {"type": "text", "text": "c"}]}]},
    "empty-parts": {"messages": [{"role": "user", "content": []}]},
    "image-part": {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,x"}}]}]},
    "tool-call-string-args": {"messages": [USER, CALL, RESULT], "tools": [T_ODD]},
    "tool-call-dict-args": {"messages": [USER, {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
        "tools": [T_ODD]},
    "tool-call-bad-json": {"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{bad"}}]}, RESULT]},
    "tool-call-array-args": {"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "[1]"}}]}, RESULT]},
    "reasoning-content": {"messages": [USER, {"role": "assistant", "content": "4", "reasoning_content": "2+2"},
                                       {"role": "user", "content": "and 3+3?"}]},
    "reasoning-alias-ignored": {"messages": [USER, {"role": "assistant", "content": "4", "reasoning": "2+2"},
                                             {"role": "user", "content": "again"}]},
    "reasoning-after-tools": {"messages": [USER, dict(CALL, reasoning_content="think first"), RESULT], "tools": [T_ODD]},
    "developer-role": {"messages": [{"role": "developer", "content": "dev rules"}, USER]},
    "system-and-developer": {"messages": [{"role": "system", "content": "sys"}, {"role": "developer", "content": "dev"},
                                          USER]},
    "uppercase-system": {"messages": [{"role": "System", "content": "sys"}, USER]},
    "system-with-tools": {"messages": [{"role": "system", "content": "sys"}, USER], "tools": [T_MIN]},
    "last-assistant": {"messages": [USER, {"role": "assistant", "content": "partial"}]},
    "continue-final": {"messages": [USER, {"role": "assistant", "content": " partial answer"}],
                       "continue_final_message": True},
    "continue-final-agp-false": {"messages": [USER, {"role": "assistant", "content": "go"}],
                                 "continue_final_message": True, "add_generation_prompt": False},
    "enable-thinking-false": {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}},
    "reasoning-effort-none": {"messages": [USER], "reasoning_effort": "none"},
    "reasoning-effort-low-kwargs-false": {"messages": [USER], "reasoning_effort": "low",
                                          "chat_template_kwargs": {"enable_thinking": False}},
    "effort-in-kwargs": {"messages": [USER], "chat_template_kwargs": {"reasoning_effort": "none"}},
    "template-in-kwargs": {"messages": [USER], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
    "unknown-role": {"messages": [{"role": "wizard", "content": "x"}]},
    "no-messages": {"messages": []},
    "user-name-dropped": {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
    "tool-name-kept": {"messages": [USER, CALL, dict(RESULT, name="bash")]},
    "unicode": {"messages": [{"role": "user", "content": "héllo ✓ 日本"}],
                "tools": [{"type": "function", "function": {"name": "f", "description": "é ✓"}}]},
}


def _bodies():
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "harness-requests"
    yield from REQUESTS.items()
    for name in ("qwen-code", "pi"):
        path = fixtures / f"{name}.jsonl"
        if path.is_file():
            for i, line in enumerate(path.read_text().splitlines()):
                yield f"{name}-{i}", json.loads(line)["body"]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def test_the_reference_is_sglangs_code(sglang_ref):
    """The pieces run are the wheel's: Tool's serializer keeps the client's key order."""
    t = sglang_ref.protocol.Tool.model_validate(T_ODD).model_dump()
    assert list(t) == ["type", "function", "defer_loading"]
    assert list(t["function"]) == ["parameters", "name", "description"]


@pytest.mark.parametrize("name,body", list(_bodies()), ids=[n for n, _ in _bodies()])
def test_prompt_ids_equal_sglang_0_5_23(sglang_ref, tok, name, body):
    ref_ids, ref_err, calls = sglang_render(sglang_ref, tok, body)
    try:
        _, ids = render_chat(tok, copy.deepcopy(body), render_rules("sglang"))
        err = None
    except RequestError as e:
        ids, err = None, str(e)
    if ref_err is not None:
        assert err is not None, f"SGLang refuses ({ref_err}), polar-serve renders"
        return
    assert err is None, f"polar-serve refuses ({err}), SGLang renders"
    assert ids == ref_ids
    # the template input itself, key order included (json.dumps keeps dict order)
    msgs, tools = calls[-1][0], calls[-1][1].get("tools")
    assert json.dumps(ours.template_messages(body["messages"], bool(body.get("continue_final_message")))[0]) \
        == json.dumps(msgs)
    mine = ours.template_tools(body)
    assert json.dumps(mine) == json.dumps(tools)
    kw = {k: v for k, v in calls[-1][1].items() if k not in ("tools", "tokenize", "add_generation_prompt", "return_dict")}
    assert ours.template_kwargs(body) == kw


def test_tool_dump_layout(sglang_ref):
    """Tool.model_dump() after _validate_request's in-place normalize_json_schema_types (both real)."""
    for t in (T_ODD, T_MIN, T_FULL, T_NULLS):
        real = sglang_ref.protocol.Tool.model_validate(copy.deepcopy(t))
        sglang_ref.ns["normalize_json_schema_types"](real.function.parameters)
        assert json.dumps(ours.tool_dump(t, "t")) == json.dumps(real.model_dump())
