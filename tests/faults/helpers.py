"""Wire shapes the fault tests script (vLLM 0.32 chat, as tests/vllm captured them) and a client."""
from __future__ import annotations

import json
import uuid

import httpx

from .scripted_upstream import answer_header

PROMPT = [151644, 872, 198, 14990]


def ep() -> str:
    return "f-" + uuid.uuid4().hex[:10]


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def chunk(content, ids, *, prompt=None, finish=None, index=0, lp=None) -> dict:
    ch = {"index": index, "delta": {} if content is None else {"content": content},
          "logprobs": {"content": [{"token": "x", "logprob": -0.5 if lp is None else lp, "bytes": [120],
                                    "top_logprobs": []}]},
          "finish_reason": finish, "token_ids": ids}
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [ch]}
    obj["prompt_token_ids"] = prompt
    return obj


def sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else dumps(obj)) + "\n\n"


def good_stream() -> list[str]:
    return [sse(chunk("Hi", [9707], prompt=PROMPT)), sse(chunk(" there", [1052])),
            sse(chunk("", [151645], finish="stop")), "data: [DONE]\n\n"]


def whole(ids, prompt=PROMPT, index=0) -> str:
    return dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": index, "message": {"role": "assistant", "content": "Hi"},
                               "logprobs": {"content": [{"token": "x", "logprob": -0.5}] * max(1, len(ids or []))},
                               "finish_reason": "stop", "token_ids": ids}],
                  "prompt_token_ids": prompt,
                  "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def call(px, episode, spec, body=None, *, path="/v1/chat/completions", headers=None, stream=None, timeout=30):
    """POST through the proxy with the upstream's answer scripted; (status, body bytes, headers)."""
    b = dict(body or CHAT)
    if stream is not None:
        b["stream"] = stream
    h = {"content-type": "application/json", "x-polar-episode": episode, "x-answer": answer_header(spec),
         **(headers or {})}
    with httpx.Client(timeout=timeout) as c:
        with c.stream("POST", px.url + path, content=json.dumps(b).encode(), headers=h) as r:
            return r.status_code, b"".join(r.iter_raw()), r.headers


def end(px, episode, body: bytes | dict = b"{}"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{px.url}/polar/{episode}/end", content=data, timeout=30)
    return r.status_code, r.content
