"""Scripted replies on the REAL vLLM: a scripting shim in front of vLLM + a logits processor inside it.

    harness -> mitmdump + Polar addon -> forced_replies shim -> vLLM (+ ForcedReply logits processor)

A random tiny model cannot drive a harness, so, as polar-serve's scripted mode does, a script file
(format: polar_serve/script.py) decides each reply. Neither the harness nor vLLM is changed; the
work is split where the information is:

- The reply depends on the whole request: its messages (turn index, `when` conditions) and its
  declared tools and their JSON schemas (which tool name, which argument names). That is
  polar_serve.script.choose_reply / render_reply, and it needs the request body. This shim, a
  plain HTTP pass-through between the capture proxy and vLLM, reads every
  `POST /v1/chat/completions` body, which is exactly the chat request the proxy sends upstream
  (Codex's Responses and Claude's Messages calls already translated to chat by the addon), picks
  and renders the reply with script.py, tokenizes it with the served model's tokenizer, appends
  the end-of-turn id (generation_config.json's first eos id, `<|im_end|>`), and forwards the body
  with one field added: `"vllm_xargs": {"polar_forced": [ids]}`. `vllm_xargs` is vLLM's own
  per-request extension field; vLLM copies it into SamplingParams.extra_args.
- The logits processor (harness_recipes/demo/vllm_plugin/polar_forced_reply.py, loaded by vLLM with
  `--logits-processors polar_forced_reply:ForcedReply` from a PYTHONPATH holding only that
  folder) sees token ids, not the request: at step k it sets every logit to -inf but that of
  `polar_forced[k]`. vLLM's sampler then samples exactly the forced token; the ids, text, parsed
  tool calls, reasoning and finish reason in the answer are vLLM's own, and its logprobs (the
  default `raw_logprobs` mode) are the model's unforced log-softmax of each forced token at
  temperature 1 (see the plugin's docstring).

Why not elsewhere: the harness cannot add the field; the capture proxy could, but then the
component whose recordings are under test would also be the one doing the scripting (and would need
the tokenizer, which it deliberately never imports: docs/capture.md). A logits processor alone
would have to recover the request from prompt token ids. The shim forwards response bytes
unchanged, chunk by chunk as they arrive (streams stay streams; the chunk holding the final
`data: [DONE]` goes out in one write with the body's end), so the proxy records what vLLM sampled
and reported, and the shim is invisible to it except for one more loopback hop.

Script features: `"sample": true` replies are forwarded without the key (vLLM samples freely);
`delay` is slept before forwarding; a tool reference the request does not satisfy is a 400 in
vLLM's error format, as in polar-serve. Other paths (`/v1/models`, `/v1/completions`, `/tokenize`,
...) and chat bodies that are not JSON objects pass through untouched. `--log FILE` appends one JSON
line per forced reply (source, text, ids), which the tests compare with the capture log.

    python -m harness_recipes.demo.forced_replies --upstream http://127.0.0.1:8000 --model DIR \\
        --script data/tasks/scripts/fix_tasks.json [--port 0] [--log forced.jsonl]

prints `polar-forced-replies listening on http://127.0.0.1:PORT` once it serves
(stack.forced_replies starts it; stack.vllm(..., extra_args=vllm_plugin_args(), env=vllm_plugin_env())
starts vLLM with the plugin).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from importlib.resources import files
from pathlib import Path

from addon.routing import CHAT_PATH
from polar_contracts.chat.render import RequestError, thinking_enabled
from polar_serve.listen import serve_forever
from polar_serve.script import ScriptError, choose_reply, load_script

READY = "polar-forced-replies listening on "
KEY = "polar_forced"  # = polar_forced_reply.KEY (that module lives in vLLM's environment, not ours)
PLUGIN_MODULE = "polar_forced_reply"
PLUGIN_CLASS = f"{PLUGIN_MODULE}:ForcedReply"
DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI-style stream
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}


# -- vLLM side ------------------------------------------------------------------------------------
def vllm_plugin_dir() -> Path:
    """The folder vLLM's PYTHONPATH gets: it holds only the logits-processor module."""
    return Path(str(files(__package__).joinpath("vllm_plugin")))


def vllm_plugin_args() -> list[str]:
    """vLLM flags that load the ForcedReply logits processor."""
    return ["--logits-processors", PLUGIN_CLASS]


def vllm_plugin_env() -> dict[str, str]:
    """The environment vLLM needs to import the plugin (stack.vllm drops our own PYTHONPATH)."""
    return {"PYTHONPATH": str(vllm_plugin_dir())}


# -- the shim -------------------------------------------------------------------------------------
def _eos_id(model_dir: Path, tokenizer) -> int:
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if f.is_file():
            e = json.loads(f.read_text()).get("eos_token_id")
            e = e[0] if isinstance(e, list) and e else e
            if isinstance(e, int):
                return e
    tid = tokenizer.token_to_id("<|im_end|>")
    if tid is None:
        raise ValueError(f"{model_dir}: no eos_token_id in generation_config.json / config.json")
    return tid


class Forcer:
    """Script + tokenizer: a chat body -> (the body to forward, what was forced or None)."""

    def __init__(self, model_dir: Path, script_path: Path, log: Path | None = None):
        from tokenizers import Tokenizer


        self.script = load_script(script_path)
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.eos = _eos_id(Path(model_dir), self.tokenizer)
        self.log = Path(log) if log else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids + [self.eos]

    def rewrite(self, body: dict) -> tuple[dict, dict | None, float]:
        """The body with `vllm_xargs.polar_forced` added (unless the reply samples), the forced
        record, and the delay to sleep. Raises polar_contracts.chat.render.RequestError."""

        reply = choose_reply(self.script, body, thinking_enabled(body))
        if reply.text is None:
            return body, None, reply.delay
        ids = self.encode(reply.text)
        xargs = body.get("vllm_xargs")
        body = {**body, "vllm_xargs": {**(xargs if isinstance(xargs, dict) else {}), KEY: ids}}
        rec = {"time": time.time(), "source": reply.source, "text": reply.text, "ids": ids}
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return body, rec, reply.delay


def _error(message: str, status: int = 400, err_type: str = "BadRequestError"):
    from aiohttp import web
    return web.json_response({"error": {"message": message, "type": err_type, "param": None, "code": status}},
                             status=status)


def make_app(forcer: Forcer, upstream: str):
    from aiohttp import ClientError, ClientSession, ClientTimeout, web


    upstream = upstream.rstrip("/")

    async def start(app):
        # no timeouts (generations are as long as they are), bytes passed through undecoded
        app["session"] = ClientSession(timeout=ClientTimeout(total=None, sock_read=None), auto_decompress=False)

    async def stop(app):
        await app["session"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        delay = 0.0
        if request.method == "POST" and request.path.rstrip("/") == CHAT_PATH:
            try:
                data = json.loads(body)
            except ValueError:
                data = None
            if isinstance(data, dict):
                try:
                    data, rec, delay = forcer.rewrite(data)
                except RequestError as e:
                    return _error(str(e))
                if rec is not None:
                    body = json.dumps(data, ensure_ascii=False).encode()
        if delay > 0:
            await asyncio.sleep(delay)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        out = None
        try:
            async with request.app["session"].request(request.method, upstream + request.path_qs, data=body,
                                                      headers=headers, allow_redirects=False) as up:
                out = web.StreamResponse(status=up.status, reason=up.reason, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP - {"content-length"}})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    if chunk.endswith(DONE):
                        # the stream's last event: send it and the body's end in one write, adding no
                        # gap between them (a client that hangs up at the last event, as Codex does at
                        # response.completed, must not find the proxy still waiting for the end)
                        await out.write_eof(chunk)
                        return out
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (ClientError, OSError) as e:
            if out is not None and out.prepared:
                raise  # mid-stream: the client sees the connection drop, as it would from vLLM
            return _error(f"upstream {upstream} unreachable: {e}", 502, "BadGateway")

    app = web.Application(client_max_size=1 << 30)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True, help="vLLM's base URL (started with the ForcedReply plugin)")
    ap.add_argument("--model", required=True, help="the served model's directory (its tokenizer.json)")
    ap.add_argument("--script", required=True, help="the script file (polar_serve/script.py format)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: a free port, reported on the ready line")
    ap.add_argument("--log", default=None, help="append one JSON line per forced reply")
    args = ap.parse_args(argv)
    try:
        forcer = Forcer(Path(args.model), Path(args.script), args.log)
    except (ScriptError, OSError, ValueError) as e:
        print(f"polar-forced-replies: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve_forever(make_app(forcer, args.upstream), args.host, args.port, READY))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
