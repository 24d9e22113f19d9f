"""Server dialects (sans-IO): which request fields make vLLM / SGLang return token ids and
logprobs, and exactly which response fields those flags add (so the proxy can take them out again).

Field names are from docs/reference.md, "Wire formats" (vLLM 0.32, SGLang 0.5.23):
- vLLM, chat and completions: ``return_token_ids: true``. Chat puts ``prompt_token_ids`` top level
  (streams: on the first chunk) and ``token_ids`` on each choice; completions put both on the
  choice. Where vLLM writes these keys as ``null`` when not requested the proxy puts ``null`` back,
  elsewhere it deletes them (``ID_FIELDS``). With the flag (or logprobs) vLLM also sends chat
  chunks whose delta is empty; the proxy drops them unless the harness asked for logprobs.
- SGLang, non-streaming chat: ``return_prompt_token_ids`` / ``return_token_ids`` give
  ``choices[i].prompt_token_ids`` / ``choices[i].response_token_ids`` (docs/reference.md, "Wire formats"); newer
  SGLang sources name the output ids ``choices[i].token_ids`` and let ``return_token_ids`` imply
  the prompt ids: both shapes are read, and only the keys the harness's own flags would not have
  produced are removed. The proxy also sets ``return_meta_info`` (unless the harness did) for
  ``choices[i].meta_info.weight_version``, the policy version that generated the tokens (real
  SGLang sends no weight-version header), and removes ``meta_info`` again. Streaming chat rejects those
  flags: ``return_input_ids_in_sglext`` / ``return_output_ids_in_sglext`` add a final
  ``choices: []`` chunk carrying ``sglext: {input_ids, output_ids}``, which exists only because of
  the flags and is dropped whole, unless the harness asked for ids in it itself (by those fields,
  or by SGLang's headers ``x-sglext-return-input-ids: 1`` / ``x-sglext-return-output-ids: 1``:
  ``sglext_header_flags``): then it keeps what it asked for. Completions: ``return_token_ids`` puts ``prompt_token_ids`` and
  ``token_ids`` on the choice. SGLang leaves unrequested keys out, so the proxy deletes them.
- Logprobs: chat ``logprobs: true`` (per-token ``choices[i].logprobs.content[].logprob``);
  completions ``logprobs: 0`` on vLLM, ``1`` on SGLang (legacy ``token_logprobs``). When the harness did
  not ask for them, the proxy asks and then sets ``choices[i].logprobs`` back to ``null`` (both servers
  send the key).

``auto`` dialect: the addon asks the upstream's ``GET /v1/models`` once and reads ``owned_by`` of
the first model (vLLM answers ``"vllm"``, SGLang ``"sglang"``); see ``dialect_from_models``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from polar_contracts.request_fields import lax_bool, lax_int

DIALECTS = ("vllm", "sglang")
NULL = "null"  # put the key back as null
DROP = "drop"  # delete the key


@dataclass
class Plan:
    """What the proxy added to one request, so the response filter removes exactly that."""

    api: str  # chat | completions
    dialect: str
    stream: bool
    added: dict[str, Any] = field(default_factory=dict)  # request fields the proxy set
    harness_logprobs: bool = False  # the harness asked for logprobs itself: keep them
    n: int = 1
    n_asked: int = 1  # n as the server will read it (the proxy bounds it: call.check_choices)
    echo: bool = False
    harness_flags: frozenset = frozenset()  # id/meta flags the harness set truthy itself
    # vLLM completions with echo, where the proxy asked for the ids: the prompt text of each prompt,
    # which vLLM leaves out of `text` once return_token_ids is set (see plan_echo)
    echo_texts: tuple[str, ...] | None = None
    not_captured: str | None = None  # why this call cannot be recorded exactly (the row's error)

    @property
    def added_logprobs(self) -> bool:
        return not self.harness_logprobs

    @cached_property
    def strip_setup(self) -> tuple:
        """What strip_response does for this plan, worked out once (it runs per stream chunk;
        a plan is not changed once made)."""
        return _strip_setup(self)


def _wants_logprobs(api: str, body: dict) -> bool:
    lp = body.get("logprobs")
    if api == "chat":
        return lax_bool(lp) is True
    return lp is not None and lp is not False  # completions: an int (0 is a request too)


# Every top-level request key plan_request reads (the proxy reads just these, see jsonhead.py).
REQUEST_KEYS = ("stream", "logprobs", "n", "echo", "return_token_ids", "return_prompt_token_ids",
                "return_meta_info", "return_input_ids_in_sglext", "return_output_ids_in_sglext",
                "max_tokens")
# plan_request also reads `prompt`, but only for a vLLM completions request with `echo` (the proxy
# then parses that body whole: NEEDS_WHOLE_BODY).


def needs_whole_body(api: str, dialect: str, head: dict) -> bool:
    """Whether plan_request needs more than REQUEST_KEYS of this request (the echoed prompt)."""
    return api == "completions" and dialect == "vllm" and bool(head.get("echo"))


# SGLang's request headers that set the sglext flags (serving_chat.py _convert_to_internal_request:
# exactly "1"): a harness may ask for the ids that way, and then its stream keeps them.
SGLEXT_HEADERS = (("return_input_ids_in_sglext", "x-sglext-return-input-ids"),
                  ("return_output_ids_in_sglext", "x-sglext-return-output-ids"))


def sglext_header_flags(dialect: str, headers: Any) -> frozenset:
    """The sglext flags the harness set by header (SGLang only; ``headers``: any mapping with a
    case-insensitive ``get``, as mitmproxy's Headers)."""
    if dialect != "sglang" or headers is None:
        return frozenset()
    return frozenset(f for f, h in SGLEXT_HEADERS if headers.get(h) == "1")


def plan_request(api: str, dialect: str, body: dict, header_flags: frozenset = frozenset()) -> Plan:
    """Decide the fields to add; the caller applies ``plan.added`` to the body. ``header_flags``:
    the id flags the harness set by request header (``sglext_header_flags``)."""
    if dialect not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect!r}; expected one of {DIALECTS}")
    stream = lax_bool(body.get("stream")) is True  # ("stream": "true" or 1 streams too)
    harness_lp = _wants_logprobs(api, body)
    added: dict[str, Any] = {}
    if not harness_lp:
        # completions: vLLM returns the sampled token's logprob with logprobs=0; SGLang only
        # returns logprobs when logprobs > 0
        added["logprobs"] = True if api == "chat" else (0 if dialect == "vllm" else 1)
    if dialect == "vllm":
        added["return_token_ids"] = True
    elif api == "chat" and stream:
        added["return_input_ids_in_sglext"] = True
        added["return_output_ids_in_sglext"] = True
    elif api == "chat":
        added["return_prompt_token_ids"] = True
        added["return_token_ids"] = True
        added["return_meta_info"] = True  # for meta_info.weight_version (removed from the answer)
    else:
        added["return_token_ids"] = True
    own = frozenset(k for k in added if k != "logprobs" and (lax_bool(body.get(k)) or k in header_flags))
    for k in own:  # the harness asked for it: nothing to add, and its answer keeps the field
        del added[k]
    n = lax_int(body.get("n"))
    plan = Plan(api, dialect, stream, added, harness_lp, n if n is not None and n > 0 else 1,
                echo=bool(lax_bool(body.get("echo"))), harness_flags=own)
    plan.n_asked = plan.n
    if plan.echo and api == "completions" and dialect == "vllm":
        plan_echo(plan, body)
    return plan


def plan_echo(plan: Plan, body: dict) -> None:
    """vLLM 0.32 completions with ``echo`` (measured; completion/serving.py): with
    ``return_token_ids`` the echoed prompt is left out of ``text`` (for token-id prompts vLLM
    detokenizes them only without the flag), and ``token_ids`` is the completion only; with
    ``logprobs`` the logprobs cover prompt + completion and ``prompt_logprobs`` is filled; a stream's
    echo chunk (each choice's first) carries ``prompt_token_ids`` with or without the flag.
    So the proxy puts the prompt text back in front of each choice's first ``text`` when the
    prompt is text (it is what vLLM echoes), and where it cannot restore the harness's answer it
    asks for nothing and the row says why. It never adds ``logprobs`` to an echo request: that
    makes vLLM compute the prompt's logprobs too (a logprob per prompt token, and an answer with
    ``prompt_logprobs`` the harness did not ask for; measured, it also slows the first chunk enough
    that vLLM merges the first tokens into it). The row has the ids, and logprobs when the harness
    asked for them (their completion part)."""
    if "return_token_ids" in plan.harness_flags:
        texts = None  # the harness gets no echoed text directly either: nothing to put back
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            texts = (prompt,)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            texts = tuple(prompt)
        else:
            texts = None
            plan.not_captured = ("not captured: echo with a prompt of token ids (vLLM echoes it as text only "
                                 "without return_token_ids, so the proxy cannot ask for the ids)")
    if body.get("max_tokens") == 0:
        plan.not_captured = "not captured: echo with max_tokens 0 (the answer is the prompt, no completion)"
    if plan.not_captured is not None:
        plan.added = {}  # (then the answer has nothing of the proxy's: the strips below change nothing)
        return
    plan.added.pop("logprobs", None)
    plan.echo_texts = texts


# ------------------------------------------------------------------------------------------------
# response field removal. Each function mutates the parsed object and returns True when it
# changed anything (then the event / body is re-serialized; otherwise the bytes pass untouched).


def _undo(obj: dict, key: str, how: str) -> bool:
    if key not in obj:
        return False
    if how == NULL:
        if obj[key] is None:
            return False
        obj[key] = None
    else:
        del obj[key]
    return True


# How each dialect writes an id field it was not asked for: NULL (key kept, null) or DROP (absent).
# (dialect, api, stream) -> (top-level keys, choice keys, how). From the servers' serializers:
# vLLM dumps whole models for non-streaming answers, and its chat and completions chunks set the
# id keys explicitly (completions chunks: both keys on every chunk, vLLM 0.32 measured). SGLang
# excludes unset id fields.
ID_FIELDS: dict[tuple[str, str, bool], tuple[tuple[str, ...], tuple[str, ...], str]] = {
    ("vllm", "chat", False): (("prompt_token_ids",), ("token_ids",), NULL),
    ("vllm", "chat", True): (("prompt_token_ids",), ("token_ids",), NULL),
    ("vllm", "completions", False): ((), ("prompt_token_ids", "token_ids"), NULL),
    ("vllm", "completions", True): ((), ("prompt_token_ids", "token_ids"), NULL),
    ("sglang", "chat", False): ((), (), DROP),  # see _strip_sglang_chat
    ("sglang", "chat", True): ((), (), DROP),  # ids ride the sglext chunk instead
    ("sglang", "completions", False): ((), ("prompt_token_ids", "token_ids"), DROP),
    ("sglang", "completions", True): ((), ("prompt_token_ids", "token_ids"), DROP),
}


def sglang_chat_caused(plan: Plan, choice: dict) -> tuple[str, ...]:
    """The keys of one SGLang non-streaming chat choice that exist only because of the proxy's
    flags. Old shape (``response_token_ids``): prompt ids <- return_prompt_token_ids, output ids
    <- return_token_ids. New shape (``token_ids``): return_token_ids also implies the prompt ids."""
    own = plan.harness_flags
    out_key = "token_ids" if "token_ids" in choice else "response_token_ids"
    caused = []
    if "return_token_ids" not in own:
        caused.append(out_key)
    if "return_prompt_token_ids" not in own and "return_token_ids" not in own:
        # (0.5.23's _build_chat_response also gives the prompt ids for return_token_ids alone)
        caused.append("prompt_token_ids")
    if "return_meta_info" not in own:
        caused.append("meta_info")
    return tuple(caused)


def _strip_sglang_chat(plan: Plan, obj: dict) -> bool:
    changed = False
    for ch in obj.get("choices") or ():
        if isinstance(ch, dict):
            for k in sglang_chat_caused(plan, ch):
                changed |= _undo(ch, k, DROP)
    return changed


def _empty_chunk(obj: dict) -> bool:
    """A vLLM chat chunk that only exists because of the proxy's flags: with return_token_ids or
    logprobs vLLM sends a chunk even for a token that produced no text delta (docs/reference.md, "Wire formats");
    without them it skips the token."""
    choices = obj.get("choices")
    if not choices:  # (the usage chunk; with continuous_usage_stats every chunk has usage: no test)
        return False
    for ch in choices:  # (a loop, not all(genexpr): this runs for every stream chunk)
        if not isinstance(ch, dict) or ch.get("finish_reason") is not None:
            return False
        delta = ch.get("delta")
        if not isinstance(delta, dict) or delta:
            return False
    return True


def _sglang_logprob_only(obj: dict) -> bool:
    """An SGLang chat chunk that only exists because of the logprobs the proxy asked for: with a
    reasoning or tool-call parser, serving_chat.py `_generate_stream_content` sends a step's
    logprobs that no text chunk took (`<think>`, `</think>`, `<|im_end|>`, tool-call steps) in a
    chunk whose delta is `{"reasoning_content": null}`; without logprobs it sends nothing."""
    choices = obj.get("choices")
    if not choices or obj.get("usage") is not None or obj.get("sglext") is not None:
        return False
    for ch in choices:
        if not isinstance(ch, dict) or ch.get("finish_reason") is not None:
            return False
        delta = ch.get("delta")
        if not isinstance(delta, dict):
            return False
        for v in delta.values():
            if v is not None:
                return False
    return True


def _strip_setup(plan: Plan) -> tuple:
    top, keys, how = ID_FIELDS[(plan.dialect, plan.api, plan.stream)]
    if "return_token_ids" in plan.harness_flags or plan.not_captured:  # the proxy caused no ids: keep all
        top, keys = (), ()
    elif plan.echo and plan.stream and plan.dialect == "vllm" and plan.api == "completions":
        keys = ("token_ids",)  # vLLM sends the echo chunk's prompt_token_ids with or without the flag
    sgl_chat = plan.dialect == "sglang" and plan.api == "chat"
    echo = (plan.echo_texts, plan.n) if plan.echo_texts is not None else None
    # empty-delta chunks exist directly too when the harness asked for ids or logprobs itself
    drop_empty = (plan.dialect == "vllm" and plan.api == "chat" and plan.stream and plan.added_logprobs
                  and "return_token_ids" not in plan.harness_flags)
    return (top, keys, how, plan.added_logprobs, sgl_chat and plan.stream, sgl_chat and not plan.stream,
            drop_empty, echo)


def _restore_echo(echo: tuple, ch: dict) -> bool:
    """One vLLM completions choice (plan_echo): the echoed prompt text back in front of the choice's
    first text (the one that carries ``prompt_token_ids``: the whole answer, or a choice's first
    chunk)."""
    texts, n = echo
    changed = False
    if texts is not None and ch.get("prompt_token_ids") is not None and isinstance(ch.get("text"), str):
        i = ch.get("index", 0)
        p = i // n if isinstance(i, int) else -1  # vLLM: choice index = prompt index * n + sample
        if 0 <= p < len(texts):
            ch["text"] = texts[p] + ch["text"]
            changed = True
    return changed


def strip_response(plan: Plan, obj: dict) -> bool | None:
    """Remove the added fields from one response object (a stream chunk or a whole body).
    Returns True (changed), False (unchanged) or None (drop this stream event entirely)."""
    top, keys, how, added_lp, sgl_stream, sgl_whole, vllm_chat_stream, echo = plan.strip_setup
    changed = False
    for k in top:
        changed |= _undo(obj, k, how)
    if sgl_stream and "sglext" in obj:
        changed = True
        ext = obj["sglext"]
        own = [k for k, f in (("input_ids", "return_input_ids_in_sglext"),
                              ("output_ids", "return_output_ids_in_sglext")) if f in plan.harness_flags]
        if own and isinstance(ext, dict):
            obj["sglext"] = {k: v for k, v in ext.items() if k in own or k not in ("input_ids", "output_ids")}
        else:
            del obj["sglext"]
            if not obj.get("choices") and obj.get("usage") is None:
                return None
    if sgl_whole:
        changed = _strip_sglang_chat(plan, obj) | changed
    choices = obj.get("choices")
    if isinstance(choices, list):
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            if echo is not None:  # (before the ids are nulled: their presence marks the echo chunk)
                changed = _restore_echo(echo, ch) | changed
            for k in keys:
                changed |= _undo(ch, k, how)
            if added_lp and ch.get("logprobs") is not None:  # (the _undo(ch, "logprobs", NULL) case)
                ch["logprobs"] = None
                changed = True
    if vllm_chat_stream and _empty_chunk(obj):
        return None  # (when the harness asked for logprobs itself, it gets these chunks directly too)
    if sgl_stream and added_lp and _sglang_logprob_only(obj):
        return None  # (likewise: a harness that asked for logprobs gets them)
    return changed


def dialect_from_models(models_body: Any) -> str | None:
    """vllm | sglang from a /v1/models answer (owned_by of the first model), else None."""
    try:
        owner = str(models_body["data"][0].get("owned_by", "")).lower()
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    for d in DIALECTS:
        if d in owner:
            return d
    return None
