"""The harness gets, byte for byte, what a direct connection gives it, less
only what the proxy added. Differential: the same request sent to the upstream directly and
through a real mitmdump with the addon, the answers compared byte for byte (server-made ids and
timestamps aside). Upstreams: polar-serve's SGLang dialect (sglext streams), and the scripted
upstream for lone-surrogate escapes, which no real server here emits on demand."""
from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest

from polar_contracts.log.reader import read_log
from tests.addon.procs import REPO
from tests.support.servers import polar_serve, tiny_model_dir

from .conftest import proxy, scripted
from .helpers import CHAT, ep
from .scripted_upstream import answer_header

SCRIPT = REPO / "data" / "scripts" / "create_hello.json"
VOLATILE = re.compile(rb'("id": ?"[^"]*"|"created": ?\d+)')
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}}}}}]


# polar-serve's float32 math differs in the last digits between two identical requests (its
# prefix cache changes the shapes): not the proxy's doing, so logprob values are compared rounded
LOGPROB = re.compile(rb'"logprob": ?(-?[0-9.]+(?:e-?[0-9]+)?)')


def norm(raw: bytes) -> bytes:
    raw = VOLATILE.sub(lambda m: m.group(0).split(b":")[0] + b":X", raw)
    return LOGPROB.sub(lambda m: b'"logprob":%.3f' % float(m.group(1)), raw)


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", url, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json", **(headers or {})}) as r:
            return r.status_code, b"".join(r.iter_raw())


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    work = tmp_path_factory.mktemp("sglext")
    logdir = work / "logs"
    with polar_serve(tiny_model_dir(), "sglang", script=SCRIPT) as srv:
        with proxy(work, logdir, srv.base_url, polar_dialect="sglang") as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            yield srv, px, logdir, model


SGL_CASES = {
    "plain": ({}, {}),
    "usage": ({"stream_options": {"include_usage": True}}, {}),
    "tools": ({"tools": TOOLS, "stream_options": {"include_usage": True}}, {}),
    "harness-logprobs": ({"logprobs": True, "top_logprobs": 2}, {}),
    "n2": ({"n": 2, "stream_options": {"include_usage": True}}, {}),
    "own-output-ids-field": ({"return_output_ids_in_sglext": True}, {}),
    "own-input-ids-field": ({"return_input_ids_in_sglext": True, "tools": TOOLS}, {}),
    "own-output-ids-header": ({"stream_options": {"include_usage": True}}, {"x-sglext-return-output-ids": "1"}),
    "own-both-headers-framed": ({}, {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1",
                                     "x-sglext-ids-framed": "1"}),
    "framed-only": ({"tools": TOOLS}, {"x-sglext-ids-framed": "1"}),
}


@pytest.mark.parametrize("case", list(SGL_CASES))
def test_sglang_sglext_stream_bytes_equal_direct(sglang, case):
    srv, px, logdir, model = sglang
    extra, headers = SGL_CASES[case]
    body = {"model": model, "max_tokens": 24, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Please create hello.txt"}], **extra}
    e = "sx-" + uuid.uuid4().hex[:8]
    st_d, direct = post(srv.base_url + "/v1/chat/completions", body, headers)
    st_p, proxied = post(px.url + "/v1/chat/completions", body, {**headers, "x-polar-episode": e})
    assert st_d == st_p == 200, proxied[:400]
    assert norm(proxied) == norm(direct)
    df = read_log(logdir / f"{e}.arrow")
    assert df["error"].to_list() == [None] * len(df), df["error"].to_list()
    assert all(len(ids) > 0 for ids in df["completion_ids"].to_list())


# ---- lone surrogates: the scripted upstream answers what vLLM's shapes would, with and without ids ----

# (JSON text as a server writes it: each \\u escape reaches the harness as written)
TEXTS = {
    "lone-high": r"\ud83d and more",
    "lone-low": r"x\ude00",
    "pair": r"\ud83d\ude00 ok",
    "high-at-end": r"tail \ud83d",
    "mixed": "caf\u00e9 " + r"\u00e9 \ud83d \/ \\ud83d \" \n",  # raw UTF-8, escapes, an escaped backslash
}


def _chunk(content: str, tid: int, ids: bool, lp: bool, *, first=False, finish=None) -> str:
    # vLLM 0.32 shapes (compact): without return_token_ids its ids keys are null
    lps = ('{"content":[{"token":"' + content[:6].replace("\\", "") + '","logprob":-1.19e-7,"bytes":[72],'
           '"top_logprobs":[]}]}') if lp else "null"
    tok = f"[{tid}]" if ids else "null"
    prompt = ',"prompt_token_ids":' + ("[1,2,3]" if ids else "null") if first else ""
    fin = "null" if finish is None else f'"{finish}"'
    return ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
            '[{"index":0,"delta":{"content":"' + content + '"},"logprobs":' + lps + ',"finish_reason":' + fin
            + ',"token_ids":' + tok + '}]' + prompt + '}\n\n')


def _stream(text: str, ids: bool, lp: bool) -> list[str]:
    return [_chunk(text, 9707, ids, lp, first=True), _chunk("more " + text, 1052, ids, lp),
            _chunk("", 151645, ids, lp, finish="stop"), "data: [DONE]\n\n"]


def _whole(text: str, ids: bool, lp: bool) -> str:
    lps = '{"content":[{"token":"' + text[:6].replace("\\", "") + '","logprob":-1.19e-7}]}' if lp else "null"
    return ('{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
            '"message":{"role":"assistant","content":"' + text + '"},"logprobs":' + lps + ',"finish_reason":"stop",'
            '"token_ids":' + ("[9707]" if ids else "null") + '}],"prompt_token_ids":' + ("[1,2,3]" if ids else "null")
            + ',"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')


@pytest.fixture(scope="module")
def scripted_stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("surrogates")
    logdir = work / "logs"
    with scripted(work) as up, proxy(work, logdir, up.url, polar_logprobs_mode="unknown") as px:
        yield up, px, logdir


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("harness_lp", [False, True], ids=["no-lp", "harness-lp"])
@pytest.mark.parametrize("text", list(TEXTS))
def test_surrogate_escapes_reach_the_harness_as_direct(scripted_stack, text, harness_lp, stream):
    up, px, logdir = scripted_stack
    t = TEXTS[text]
    json.loads('"' + t + '"')  # (valid JSON, as a server would send it)
    if stream:
        spec = {"status": 200, "ctype": "text/event-stream", "chunks": _stream(t, False, harness_lp),
                "ids_chunks": _stream(t, True, True)}
    else:
        spec = {"status": 200, "body": _whole(t, False, harness_lp), "ids_body": _whole(t, True, True)}
    body = {**CHAT, "stream": stream, **({"logprobs": True} if harness_lp else {})}
    h = {"x-answer": answer_header(spec)}
    st_d, direct = post(up.url + "/v1/chat/completions", body, h)
    e = ep()
    st_p, proxied = post(px.url + "/v1/chat/completions", body, {**h, "x-polar-episode": e})
    assert st_d == st_p == 200
    assert b"9707" not in direct  # (the upstream answered the direct call without ids)
    assert proxied == direct
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["error"] is None, row["error"]
    assert row["completion_ids"] == ([9707, 1052, 151645] if stream else [9707])


def test_request_with_a_lone_surrogate_is_captured(scripted_stack):
    """A request a Python server reads (json.loads takes a lone surrogate escape): the proxy adds
    its flags, the harness gets what it would directly, and the row has its ids."""
    up, px, logdir = scripted_stack
    raw = b'{"model":"m","messages":[{"role":"user","content":"half an emoji: \\ud83d"}]}'
    spec = {"status": 200, "body": _whole("ok", False, False), "ids_body": _whole("ok", True, True)}
    h = {"content-type": "application/json", "x-answer": answer_header(spec)}
    direct = httpx.post(up.url + "/v1/chat/completions", content=raw, headers=h).content
    e = ep()
    proxied = httpx.post(px.url + "/v1/chat/completions", content=raw, headers={**h, "x-polar-episode": e}).content
    assert proxied == direct
    sent = json.loads(up.record.read_text().splitlines()[-1])["body"]
    assert '"content":"half an emoji: \\ud83d"' in sent and '"return_token_ids":true' in sent  # spliced in
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["error"] is None and row["completion_ids"] == [9707]
    assert "\\ud83d" in row["request"]


def test_count_tokens_is_forwarded_not_recorded(scripted_stack):
    """Claude Code's POST /v1/messages/count_tokens: on the model-API allowlist, answered by the
    server byte for byte, and no model call in the episode's log (it generates no tokens)."""
    up, px, logdir = scripted_stack
    answer = '{"input_tokens":12}'
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    h = {"x-answer": answer_header({"status": 200, "body": answer})}
    e = ep()
    for path in ("/v1/messages/count_tokens", f"/polar/{e}/messages/count_tokens"):
        st, got = post(px.url + path, body, {**h, "x-polar-episode": e})
        assert (st, got) == (200, answer.encode())
    sent = [json.loads(x) for x in up.record.read_text().splitlines()][-2:]
    assert [s["path"] for s in sent] == ["/v1/messages/count_tokens", "/messages/count_tokens"]
    assert json.loads(sent[0]["body"]) == body  # untouched: no flags added
    assert not (logdir / f"{e}.arrow").exists()
