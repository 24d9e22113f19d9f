"""One model call through the proxy (sans-IO): its state machine ``CallState``, the rewritten
request, the response transform, and the log rows it becomes. The mitmproxy hooks of
model_calls.py (``ModelCalls``) only move bytes in and out."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

import addon.applied_sampling as sampling_rules
from addon.server_dialects import (
    REQUEST_KEYS,
    Plan,
    needs_whole_body,
    plan_request,
    sglext_header_flags,
    strip_response,
)
from polar_contracts.control import WEIGHT_VERSION_HEADER

from . import chat, completions
from .call_tokens import CallTokens
from .json_style import (
    COMPACT_UTF8,
    dumps_faithful,
    dumps_like_python,
    dumps_like_safe,
    dumps_stripped,
    has_escapes,
    json_style,
)
from .jsonhead import request_head
from .redact import (
    SECRET_KEY_MATCH_MAX,
    SECRET_KEY_SCAN,
    Scrubber,
    redact_json,
    secret_values,
    secret_values_in_bytes,
)
from .stream import StreamFilter, TranslatedStream

if TYPE_CHECKING:  # (annotations only: the call module needs none of them at run time)
    from polar_contracts.log.writer import PreparedRequest
    from polar_contracts.translate.common import ChatTranslator

    from .applied_sampling import ModelDefaults
    from .idlists import PromptCache
    from .redact import CleanRequests
    from .weight_gate import Ticket
    from .weight_hold import UpstreamWeights

API_MODULES = {"chat": chat, "completions": completions, "responses": chat, "messages": chat, "gemini": chat}
# Whether a raw body may name a credential key (redact.SecretKeyScan: one pass over the body).
SECRET_KEY_RE = SECRET_KEY_SCAN
SECRET_MATCH_MAX = SECRET_KEY_MATCH_MAX  # the longest match: a key and its quotes
# A call may create at most this many rows (choices): n=200000 would be 200k rows and a 500 MB
# log; the proxy refuses more (option polar_max_choices).
MAX_CHOICES = 128
# An integer of 19+ digits in a request: orjson reads integers past 64 bits as floats, so such
# a body is parsed with the json module (exact ints) where the proxy re-serializes it.
_BIG_INT = re.compile(rb"[:\[,]\s*-?\d{19}")


class RequestRefused(Exception):
    """A request the proxy refuses itself (400 in the harness's API's error shape); says why."""


def loads_request(raw: bytes) -> Any:
    """A request body, every integer exact (see _BIG_INT); a lone surrogate escape (valid JSON
    that orjson refuses, and Python servers such as SGLang's read) is read by the json module."""
    if _BIG_INT.search(raw) is not None:
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)  # (raises ValueError too, naming the problem, where it is not JSON)
MAX_ERROR_BODY = 2000
# The harness asked for prompt ids itself: its answer keeps them, so they must stay JSON lists
# (idlists.PromptCache turns them into arrays, which only the proxy's own fields may be).
_OWN_PROMPT_FLAGS = frozenset({"return_token_ids", "return_prompt_token_ids", "return_input_ids_in_sglext"})
UNPARSED = object()  # a request read through jsonhead: parsed whole only if the log needs it


def add_fields(raw: bytes, body: dict, added: dict[str, Any]) -> bytes:
    """The body with ``added`` set. When none of the keys is present the fields are spliced in
    before the final ``}`` (no re-serialization of an 80 KB body); otherwise re-serialize."""
    if not added:
        return raw
    if raw.rfind(b"}") < 0 or any(k in body for k in added):
        return dumps_like_python({**body, **added})
    return splice_fields(raw, bool(body), added)


def splice_fields(raw: bytes, nonempty: bool, added: dict[str, Any]) -> bytes:
    """``added`` (keys the object lacks) written in before the object's final ``}``."""
    if not added:
        return raw
    end = raw.rfind(b"}")
    ins = b",".join(orjson.dumps(k) + b":" + orjson.dumps(v) for k, v in added.items())
    view = memoryview(raw)  # one copy of the 80 KB body, not three
    return b"".join((view[:end], b"," if nonempty else b"", ins, view[end:]))


def log_request_text(raw: bytes, body: Any, scan: Callable[[bytes], bool] | None = None,
                     secrets: list[str] | None = None) -> bytes:
    """The request as the harness sent it (UTF-8 bytes), with secret fields redacted. A body
    that did not parse (``body`` None) and names a secret key is not logged at all: its value
    cannot be found reliably. ``scan``: whether raw names a secret key (default: search it all;
    the proxy passes its episode's redact.CleanRequests, which reads only what changed).
    ``secrets`` receives the redacted values, to scrub them from what the server echoes."""
    if (scan(raw) if scan is not None else SECRET_KEY_RE.search(raw) is not None):
        if body is UNPARSED:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = None
        if body is None:
            if secrets is not None:
                secrets.extend(secret_values_in_bytes(raw))
            return b"[request body not logged: it is not valid JSON and names a secret key]"
        redacted = redact_json(body)
        if redacted != body:
            if secrets is not None:
                secrets.extend(secret_values(body))
            return dumps_like_python(redacted)
    return raw.decode("utf-8", errors="replace").encode() if not _is_utf8(raw) else raw


def _is_utf8(raw: bytes) -> bool:
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@dataclass
class CallState:
    """One model call the proxy is capturing, from its request to its rows: what the hooks learned
    so far, until its rows are written (the proxy keeps it in ``flow.metadata``). Its token ids and
    logprobs accumulate in ``cap`` (call_tokens.CallTokens) once the answer starts."""
    episode_id: str
    call_index: int
    api: str  # chat | completions | responses | messages | gemini
    dialect: str
    t_start: float
    request_text: bytes | str  # UTF-8 bytes on the hot path (no 80 KB str round trip)
    model: str | None = None
    stream: bool = False
    plan: Plan | None = None
    cap: CallTokens | None = None  # the token record, from the response headers on
    translator: ChatTranslator | None = None  # Responses / Messages / Gemini calls
    transform: StreamFilter | TranslatedStream | None = None  # while streaming
    status: int | None = None
    t_first_byte: float | None = None
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    response_text: bytes | str | None = None  # as the harness received it
    auxiliary: bool = False
    reply: tuple[int, str] | None = None  # (status, content-type) replacing the upstream's
    header_weight_version: str | None = None  # response header x-polar-weight-version (polar-serve)
    weight_ticket: Ticket | None = None  # the version the proxy's sync history gives the call
    weight_hold: UpstreamWeights | None = None  # the upstream's gate that issued the ticket (finished with the row)
    pending_request: tuple[bytes, Any] | None = None  # (raw, parsed JSON or UNPARSED) until request_text is computed
    secrets: list[str] = field(default_factory=list)  # values redacted from the request (scrubbed from the row)
    prepared_request: PreparedRequest | None = None  # computed while the server works
    # Parsed answers and the id lists removed from them: freeing 20k Python ints costs ~0.2 ms,
    # so they are dropped after the harness has its answer (drop_trash), not on its path.
    trash: list[object] = field(default_factory=list)
    prompt_cache: PromptCache | None = None  # the proxy's (None: parse every answer whole)
    clean_requests: CleanRequests | None = None  # the proxy's (None: scan every request whole)
    max_choices: int = MAX_CHOICES
    # credentials in the request's headers and query string: scrubbed from what an upstream
    # error quotes back (error text and non-2xx answers only: a 200 answer never carries them)
    header_secrets: list[str] = field(default_factory=list)
    # every credential the proxy knows (redact.Credentials: its control secret, the upstream key,
    # harnesses' keys, this call's capability mac), scrubbed by value from the request and answer
    # text, errors and notes (an agent's tool result may quote them: it ran `env`)
    known: Scrubber | None = None
    written: bool = False  # the rows are on disk (a stream's are written at its final event)
    # the served model's sampling defaults (None: unknown, sampling_unknown_why says why)
    sampling_defaults: ModelDefaults | None = None
    sampling_unknown_why: str = sampling_rules.UNKNOWN_DEFAULTS  # why sampling_defaults is None (the rows say)
    # the row's sampling columns (applied_sampling.resolve), and what the upstream's logprobs are (logprobs_probe)
    sampling: dict[str, Any] = field(default_factory=lambda: dict(sampling_rules.UNKNOWN_COLUMNS))
    sampling_unknown: tuple[str, ...] = ()  # fields recorded null: unset, and no known default
    logprobs_mode: str | None = None

    def drop_trash(self) -> None:
        self.trash = []


# The former name (before CallState; scripts and tests written against it keep working).
CapturedCall = CallState


_HEAD_KEYS = frozenset((*REQUEST_KEYS, "model", *sampling_rules.REQUEST_KEYS))


def resolve_sampling(call: CallState, body: Mapping[str, Any]) -> dict[str, Any]:
    """Record the sampling the server will apply to ``body`` on the call; returns the unset fields
    to write into the forwarded request (applied_sampling.py: so the recorded value is the applied one)."""
    r = sampling_rules.resolve(dict(body), call.sampling_defaults, call.sampling_unknown_why)
    call.sampling, call.sampling_unknown = r.columns, r.unknown
    return r.fill


def prepare(call: CallState, raw: bytes, headers: Mapping[str, str]) -> bytes | None:
    """Parse and rewrite the request. Returns the body to send upstream, or None to pass the
    harness's request through untouched (bad JSON: the server answers it as it would directly)."""
    head = request_head(raw, _HEAD_KEYS) if call.translator is None else None
    if head is not None and needs_whole_body(call.api, call.dialect, head[0]):
        head = None  # (rare: a completions echo, whose prompt the plan needs)
    if head is not None:  # the top-level fields only (jsonhead.py)
        fields, size = head
        call.pending_request = (raw, UNPARSED)
        model = fields.get("model")
        call.model = model if isinstance(model, str) else None
        call.plan = plan_request(call.api, call.dialect, fields, sglext_header_flags(call.dialect, headers))
        call.stream = call.plan.stream
        check_choices(call)
        added = {**call.plan.added, **resolve_sampling(call, fields)}
        if any(k in fields for k in added):  # the harness set one (to false, null): re-serialize
            return add_fields(raw, loads_request(raw), added)
        return splice_fields(raw, size > 0, added)
    try:
        body = loads_request(raw) if raw else None
    except ValueError as exc:  # (orjson.JSONDecodeError and json's are ValueErrors)
        call.errors.append(f"request body is not valid JSON ({exc}); passed through unmodified")
        call.request_text = _known(call, log_request_text(raw, None, secrets=call.secrets))
        return None
    if call.translator is None and isinstance(body, dict):
        # the log's request text (secret scan of 80 KB) is not needed upstream: computed by
        # finish_request_text while the server works, or at the latest when the row is made
        call.pending_request = (raw, body)
    else:  # (a translator may change the body it is given)
        call.request_text = _known(call, log_request_text(raw, body, secrets=call.secrets))
    if not isinstance(body, dict):
        call.errors.append(f"request body is a JSON {type(body).__name__}, not an object; passed through unmodified")
        return None
    call.model = body.get("model") if isinstance(body.get("model"), str) else None
    if call.translator is not None:
        chat_body = call.translator.request_to_chat(body, headers)
        call.notes.extend(call.translator.notes)
        call.auxiliary = bool(call.translator.auxiliary)
        if call.model is None and isinstance(chat_body.get("model"), str):
            call.model = chat_body["model"]  # (the Gemini API names the model in the path)
        call.plan = plan_request("chat", call.dialect, chat_body)
        call.stream = call.plan.stream
        check_choices(call)
        return dumps_like_python({**chat_body, **call.plan.added, **resolve_sampling(call, chat_body)})
    call.plan = plan_request(call.api, call.dialect, body, sglext_header_flags(call.dialect, headers))
    call.stream = call.plan.stream
    check_choices(call)
    return add_fields(raw, body, {**call.plan.added, **resolve_sampling(call, body)})


def check_choices(call: CallState) -> None:
    """Bound what one call may create: n choices are n rows."""
    n = call.plan.n_asked if call.plan is not None else 1
    if n > call.max_choices:
        raise RequestRefused(f"n={n} asks for more choices than this proxy records in one call "
                             f"(polar_max_choices={call.max_choices}); ask for fewer, or raise the option")


def finish_request_text(call: CallState) -> None:
    """The request text for the log (secrets redacted), if prepare() left it to later."""
    if call.pending_request is not None:
        raw, body = call.pending_request
        call.pending_request = None
        cache = call.clean_requests
        call.request_text = _known(call, log_request_text(raw, body, None if cache is None else
                                                          (lambda r: cache.has_secret(call.episode_id, r)),
                                                          call.secrets))


def _known(call: CallState, text: bytes) -> bytes:
    return text if call.known is None else call.known(text)


def start_response(call: CallState, status: int, content_type: str) -> StreamFilter | TranslatedStream | None:
    """At the response headers: the stream transform to install, or None (read whole body)."""
    call.status = status
    call.t_first_byte = time.time()
    if call.plan is None or not (200 <= status < 300) or "text/event-stream" not in content_type:
        return None
    call.cap = CallTokens(call.plan)
    mod = API_MODULES["chat" if call.translator is not None else call.api]
    if call.translator is not None:
        call.transform = TranslatedStream(call.cap, mod.extract, call.translator, mod.Assembler())
    else:
        call.transform = StreamFilter(call.cap, mod.extract, mod.Assembler())
        if not call.plan.harness_flags & _OWN_PROMPT_FLAGS:
            call.transform.prompt_cache, call.transform.cache_key = call.prompt_cache, call.episode_id
    return call.transform


def finish_body(call: CallState, status: int, body: bytes) -> bytes | None:
    """A whole (non-streamed) response: returns the bytes for the harness, or None if unchanged."""
    call.status = status
    if call.t_first_byte is None:
        call.t_first_byte = time.time()
    if not (200 <= status < 300):
        call.errors.append(f"upstream status {status}: {body[:MAX_ERROR_BODY].decode('utf-8', 'replace')}")
        if call.translator is not None and call.plan is not None:
            new_status, new_body, ctype = call.translator.error_from_chat(status, body)
            call.reply = (new_status, ctype)
            call.response_text = new_body
            return new_body
        call.response_text = body
        return None
    if call.plan is None:
        call.response_text = body
        return None
    own_ids = call.plan.harness_flags & _OWN_PROMPT_FLAGS
    cache = call.prompt_cache if call.translator is None and not own_ids else None
    try:
        obj = cache.loads(call.episode_id, body) if cache is not None else orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        try:  # valid JSON orjson refuses (a lone surrogate escape): the json module reads it
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            call.errors.append(f"response is not JSON ({exc}); passed through")
            call.response_text = body
            return None
    if not isinstance(obj, dict):
        call.errors.append("response is not a JSON object; passed through")
        call.response_text = body
        return None
    call.cap = CallTokens(call.plan)
    mod = API_MODULES["chat" if call.translator is not None else call.api]
    mod.extract(call.cap, obj)
    # hold what stripping takes out (see trash): the top level and each choice, shallowly
    call.trash.append((obj, dict(obj), [dict(ch) for ch in obj.get("choices") or () if isinstance(ch, dict)]))
    if call.translator is not None:
        out = dumps_like_python(call.translator.response_from_chat(obj))
        call.response_text = out
        return out
    changed = strip_response(call.plan, obj)
    if changed:
        out = None
        plan = call.plan
        if has_escapes(body):  # (lone surrogates, \u-escaped text: written back as the server wrote them)
            out = dumps_stripped(body, lambda o: strip_response(plan, o))
        elif plan.harness_logprobs and json_style(body) == COMPACT_UTF8:  # its floats as the server printed them
            out = dumps_faithful(body, lambda o: strip_response(plan, o))
        if out is None:
            out = dumps_like_safe(body, obj)
        call.response_text = out
        return out
    call.response_text = body
    return None


def stream_final(call: CallState, ended: bool = True) -> None:
    """At the stream's final event ([DONE], or the end of a stream without it): what the row
    needs from the stream, taken now (the row is written before the harness gets that end).
    ``ended``: the server ended the stream (not a connection error)."""
    t = call.transform
    if ended and not t.saw_done:
        call.errors.append("stream ended without [DONE]")
    if getattr(t, "mid_stream_error", None) is not None:
        call.errors.append(f"server error event mid-stream: {json.dumps(t.mid_stream_error)[:MAX_ERROR_BODY]}")
    call.response_text = t.response_text()


def finish_stream(call: CallState, error: str | None = None) -> None:
    """The stream ended (completely, or with ``error``)."""
    t = call.transform
    if t is None:
        return
    if not call.written:  # (else the row was written at the final event: nothing goes into it now)
        if error is None and not t.closed:
            t.close()  # (writes the row of a stream that ended without [DONE]: stream_final)
        if not call.written:
            stream_final(call, ended=error is None)
    t.release()
    call.transform = None


def rows(call: CallState, t_end: float, error: str | None = None) -> list[dict[str, Any]]:
    """The log rows of a finished call: one per choice (one with no ids if nothing came back)."""
    finish_request_text(call)
    errors = list(call.errors)
    if error:
        errors.append(error)
    notes = list(call.notes)
    for n in getattr(call.translator, "notes", None) or ():  # notes added after the request (at finish())
        if n not in notes:
            notes.append(n)
    # a server that echoes the request (a validation error's "input") must not carry the
    # harness's key into the row either (a no-op for the requests without secrets)
    scrub = Scrubber(call.secrets)
    if call.header_secrets:
        hscrub = Scrubber(call.header_secrets)
        errors = [hscrub(e) for e in errors]
        if call.status is None or not 200 <= call.status < 300:
            call.response_text = hscrub(call.response_text)
    errors, notes = [scrub(e) for e in errors], [scrub(n) for n in notes]
    call.response_text = scrub(call.response_text)
    if call.known is not None:
        errors, notes = [call.known(e) for e in errors], [call.known(n) for n in notes]
        call.response_text = call.known(call.response_text)
    base = dict(
        api=call.api, dialect=call.dialect, model=call.model, status=call.status, stream=call.stream,
        t_start=call.t_start, t_first_byte=call.t_first_byte, t_end=t_end, request=call.request_text,
        prepared_request=call.prepared_request,
        response=call.response_text, auxiliary=call.auxiliary,
        **call.sampling, logprobs_mode=call.logprobs_mode,
    )
    if call.cap is None:
        if not errors:
            errors.append("no token ids: the response was not captured")
        return [dict(base, choice=0, prompt_ids=None, completion_ids=None, completion_logprobs=None,
                     weight_version=weight_version(call, notes), error="; ".join(errors), notes=notes or None)]
    version = weight_version(call, notes)
    out = []
    if call.plan is not None and call.plan.not_captured:
        errors.append(call.plan.not_captured)
    for r in call.cap.rows():
        missing = r.pop("missing")
        errs = errors + ([scrub(missing)] if missing else [])  # (errors are scrubbed already)
        out.append(dict(base, **r, weight_version=version, error="; ".join(errs) or None,
                        notes=(notes + [scrub(n) for n in call.cap.notes]) or None))
    call.cap.free()
    return out




def weight_version(call: CallState, notes: list[str]) -> str | None:
    """The policy version that generated this call. A call in flight while the proxy had the server
    load new weights carries the spanning marker (polar_contracts.weight_versions), whatever the server
    says. Otherwise the server's own word wins: SGLang's ``meta_info.weight_version`` (per request),
    then polar-serve's header; else the version the proxy's sync history gives (weight_gate.Ticket:
    learned from the server at first contact, then each sync through the proxy; vLLM's chat answers
    carry none). A disagreement is noted, never silently merged."""
    ticket = call.weight_ticket
    if ticket is not None and ticket.spanned:
        notes.append(f"weight_version: the call was in flight while the proxy had the server load version "
                     f"{ticket.span_to!r} (it started under {ticket.start_version!r})")
        return ticket.version
    meta = call.cap.weight_version if call.cap is not None else None
    head = call.header_weight_version
    if meta is not None and head is not None and meta != head:
        notes.append(f"weight_version: meta_info says {meta!r}, header {WEIGHT_VERSION_HEADER} says {head!r}")
    server = meta if meta is not None else head
    proxy = ticket.start_version if ticket is not None else None
    if server is not None and proxy is not None and server != proxy:
        notes.append(f"weight_version: the server says {server!r}, the proxy's sync history says {proxy!r} "
                     f"(weights loaded without the proxy?)")
    return server if server is not None else proxy
