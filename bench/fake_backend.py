"""A fast fake inference server for the proxy benchmark and the proxy's failure tests.

Speaks the streaming and non-streaming shapes of vLLM 0.32 or SGLang 0.5.23 (docs/reference.md, "Wire formats") for
/v1/chat/completions and /v1/completions, returning token ids and logprobs only when the request
asks for them, as the real servers do. No model: the prompt ids are derived from the request
(cheaply, or with the real Qwen3 tokenizer with --tokenizer), the completion is a fixed cycle of
words. Misbehaviour on demand, by request header ``x-fake``:
  error500 | reset (abort the connection mid-stream) | noids (ignore the id flags) |
  crlf (CRLF framing, keep-alive comments, UTF-8 characters split across writes) | slow.

    python bench/fake_backend.py --port 8000 --dialect vllm [--chunks 60 --gap-ms 5 --first-ms 20]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import zlib

from aiohttp import web

# token 2 decodes to no text (think of a special token): vLLM streams a chunk for it only when ids
# or logprobs were asked for.
WORDS = ["Hé", "llo", "", "ld", " 日本", " and", " 😀", " more", " text", "."]
WORD_IDS = [39, 654, 151667, 507, 220, 323, 26525, 803, 1467, 13]
EOS = 151645
FAKE_WEIGHT_VERSION = "fake-v1"  # SGLang's meta_info.weight_version (with return_meta_info)


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class Backend:
    def __init__(self, dialect: str, chunks: int, gap: float, first: float, tokenizer=None):
        self.dialect, self.chunks, self.gap, self.first = dialect, chunks, gap, first
        self.tok = tokenizer
        self.calls = 0
        self.cache: dict = {}

    def prompt_ids(self, body: dict) -> list[int]:
        if self.tok is not None:
            if "messages" in body:
                text = "".join(f"<|im_start|>{m.get('role')}\n{m.get('content') or ''}"
                               f"{json.dumps(m.get('tool_calls')) if m.get('tool_calls') else ''}<|im_end|>\n"
                               for m in body["messages"])
            else:
                text = str(body.get("prompt", ""))
            return self.tok.encode(text, add_special_tokens=False).ids
        # cheap: one id per 4 bytes of the conversation (so longer prompts have more ids)
        src = dumps(body.get("messages") or body.get("prompt") or "")
        n = min(max(1, len(src) // 4), 40000)  # a real server refuses prompts past its context
        seed = zlib.crc32(src[:256])
        return [(seed + i * 2654435761) % 151643 for i in range(n)]

    def completion(self, n: int):
        toks = [(WORDS[i % len(WORDS)], WORD_IDS[i % len(WORD_IDS)], -0.125 * (1 + i % 7)) for i in range(n)]
        return toks

    # -- handlers ---------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "fake-model", "object": "model", "created": 0, "owned_by": self.dialect}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        raw = await request.read()
        mode = request.headers.get("x-fake", "")
        try:
            body = json.loads(raw)
        except ValueError as exc:
            return web.json_response({"error": {"message": f"bad JSON: {exc}", "code": 400}}, status=400)
        if mode == "error500":
            return web.json_response({"error": {"message": "boom", "type": "InternalServerError", "code": 500}},
                                     status=500)
        api = "chat" if request.path.endswith("chat/completions") else "completions"
        if self.dialect == "sglang" and api == "chat" and body.get("stream") and (
                body.get("return_token_ids") or body.get("return_prompt_token_ids")):
            return web.json_response({"error": {"message": "return_token_ids is not supported with stream",
                                                "code": 400}}, status=400)
        ids = mode != "noids"
        want_ids = ids and bool(body.get("return_token_ids") or body.get("return_prompt_token_ids")
                                or body.get("return_output_ids_in_sglext"))
        lp = body.get("logprobs")
        want_lp = (lp is True) if api == "chat" else (lp is not None and lp is not False)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or self.chunks)
        n = min(n, self.chunks)
        # identical requests (the benchmark's) are answered from a cache: the backend should cost
        # next to nothing, so what is measured is the proxy
        key = (request.path, mode, raw)
        hit = self.cache.get(key)
        if hit is None:
            prompt = self.prompt_ids(body)
            toks = self.completion(n)
            if body.get("stream"):
                nl = b"\r\n" if mode == "crlf" else b"\n"
                hit = [b"data: " + dumps(o) + nl + nl for o in self.chunks_of(api, body, prompt, toks, want_ids, want_lp)]
            else:
                hit = self.whole(api, body, prompt, toks, want_ids, want_lp)
            if len(self.cache) > 64:
                self.cache.clear()
            self.cache[key] = hit
        if body.get("stream"):
            return await self.stream(request, hit, mode)
        return web.Response(body=hit, content_type="application/json")

    def whole(self, api, body, prompt, toks, want_ids, want_lp) -> bytes:
        text = "".join(t for t, _, _ in toks)
        cids = [i for _, i, _ in toks]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(toks), "total_tokens": len(prompt) + len(toks)}
        v = self.dialect == "vllm"
        if api == "chat":
            ch = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                  "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                           for t, _, lp in toks]} if want_lp else None,
                  "finish_reason": "length"}
            if v:
                ch["token_ids"] = cids if want_ids else None
            elif want_ids:
                ch["prompt_token_ids"] = prompt
                ch["response_token_ids"] = cids
            if not v and body.get("return_meta_info"):  # SGLang: per-choice meta_info on request
                ch["meta_info"] = {"id": "chatcmpl-1", "finish_reason": {"type": "length"},
                                   "prompt_tokens": len(prompt), "weight_version": FAKE_WEIGHT_VERSION,
                                   "completion_tokens": len(toks), "cached_tokens": 0}
            out = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": body.get("model"),
                   "choices": [ch], "usage": usage}
            if v:
                out["prompt_token_ids"] = prompt if want_ids else None
        else:
            ch = {"index": 0, "text": text, "logprobs": self._legacy(toks) if want_lp else None,
                  "finish_reason": "length"}
            if want_ids:
                ch["prompt_token_ids"], ch["token_ids"] = prompt, cids
            elif v:
                ch["prompt_token_ids"] = ch["token_ids"] = None
            out = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": body.get("model"),
                   "choices": [ch], "usage": usage}
        return dumps(out)

    @staticmethod
    def _legacy(toks):
        return {"tokens": [t for t, _, _ in toks], "token_logprobs": [lp for _, _, lp in toks],
                "top_logprobs": [None] * len(toks), "text_offset": list(range(len(toks)))}

    def chunks_of(self, api, body, prompt, toks, want_ids, want_lp):
        head = {"id": "chatcmpl-1" if api == "chat" else "cmpl-1",
                "object": "chat.completion.chunk" if api == "chat" else "text_completion",
                "created": 1, "model": body.get("model")}
        v = self.dialect == "vllm"
        last = len(toks) - 1
        if api == "chat":
            first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if v:
                first.update(prompt_token_ids=prompt if want_ids else None, prompt_text=None)
            yield first
            held = []
            for j, (t, i, lp) in enumerate(toks):
                held.append({"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []})
                silent = v and t == "" and j != last  # a token without text
                if silent and not want_ids and not want_lp:
                    continue  # vLLM sends no chunk for it unless ids or logprobs were asked for
                ch = {"index": 0, "delta": {} if silent else {"content": t},
                      "logprobs": {"content": held} if want_lp else None,
                      "finish_reason": "length" if j == last else None}
                held = []
                if v:
                    ch["token_ids"] = [i] if want_ids else None
                yield {**head, "choices": [ch]}
            if not v and want_ids:
                yield {**head, "choices": [], "sglext": {"input_ids": prompt, "output_ids": [[i for _, i, _ in toks]]}}
        else:
            for j, (t, i, lp) in enumerate(toks):
                ch = {"index": 0, "text": t,
                      "logprobs": {"tokens": [t], "token_logprobs": [lp], "top_logprobs": [None], "text_offset": [j]}
                      if want_lp else None, "finish_reason": "length" if j == last else None}
                if v:  # vLLM 0.32 (measured): both keys on every chunk, null when not requested
                    ch["stop_reason"] = None
                    ch["prompt_token_ids"] = prompt if want_ids and j == 0 else None
                    ch["token_ids"] = [i] if want_ids else None
                elif want_ids:  # unrequested, SGLang leaves these keys out of stream chunks
                    ch["token_ids"] = [i]
                    if j == 0:
                        ch["prompt_token_ids"] = prompt
                yield {**head, "choices": [ch]}
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**head, "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(toks),
                                                    "total_tokens": len(prompt) + len(toks)}}

    async def stream(self, request, events, mode) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        gap = 0.05 if mode == "slow" else self.gap
        await asyncio.sleep(self.first)
        nl = b"\r\n" if mode == "crlf" else b"\n"
        for k, ev in enumerate(events):
            if mode == "reset" and k == 3:
                request.transport.abort()  # connection reset mid-stream
                return resp
            if mode == "crlf":
                if k < 2:  # keep-alives at the start, not tied to events the proxy may drop
                    await resp.write(b": keep-alive" + nl + nl)
                cut = next((i for i in range(len(ev)) if ev[i] >= 0xC0), len(ev) // 2) + 1
                await resp.write(ev[:cut])
                await asyncio.sleep(0)
                await resp.write(ev[cut:])
            else:
                await resp.write(ev)
            if gap:
                await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]" + nl + nl)
        await resp.write_eof()
        return resp


def make_app(backend: Backend) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/v1/models", backend.models)
    app.router.add_post("/v1/chat/completions", backend.handle)
    app.router.add_post("/v1/completions", backend.handle)
    return app


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dialect", choices=["vllm", "sglang"], default="vllm")
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--first-ms", type=float, default=20.0)
    ap.add_argument("--tokenizer", help="tokenizer.json to derive real prompt ids from the messages")
    a = ap.parse_args(argv)
    tok = None
    if a.tokenizer:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(a.tokenizer)
    backend = Backend(a.dialect, a.chunks, a.gap_ms / 1000, a.first_ms / 1000, tok)
    web.run_app(make_app(backend), host="127.0.0.1", port=a.port, print=lambda *_: print("ready", flush=True),
                backlog=1024, access_log=None)


if __name__ == "__main__":
    main()
