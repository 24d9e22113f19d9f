"""The aiohttp application: routes, request decoding, error answers, streaming. I/O only.

Everything a response contains is computed by generation.py and the dialect object; this module
reads bodies, maps RequestError to the dialect's error body, writes SSE, and swaps weights on
reload. Routes only one server has are registered by its dialect (`Dialect.extra_routes`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from aiohttp import web

from polar_contracts.chat.render import RequestError, render_chat
from polar_contracts.control import SERVE_RELOAD_PATH, SERVE_VERSION_PATH
from polar_contracts.control import WEIGHT_VERSION_HEADER as VERSION_HEADER
from polar_serve.dialect_base import Dialect

from .engine import Engine, Job
from .generation import GenerationResult, chat_request, collect_result, completion_request
from .model import ServedModel
from .params import param_error

log = logging.getLogger("polar-serve")
SCRIPT_HEADER = "x-polar-script-turn"


class Server:
    def __init__(self, model: ServedModel, dialect: Dialect, served_names, script: dict | None = None,
                 weight_version: str | None = None):
        self.model = model
        self.engine = Engine(model)
        self.dialect = dialect
        self.served_names = [served_names] if isinstance(served_names, str) else list(served_names)
        self.served_name = self.served_names[0]
        self.script = script
        self.reloads = 0
        self.weight_version = weight_version or "default"

    # -- helpers ------------------------------------------------------------------------------
    def error(self, message: str, status: int = 400, err_type: str | None = None, param: str | None = None):
        body = self.dialect.error_body(message, status, err_type)
        if param is not None and isinstance(body.get("error"), dict) and "param" in body["error"]:
            body["error"]["param"] = param
        return self.json(body, status=status)

    def headers(self) -> dict:
        return {VERSION_HEADER: self.weight_version}

    def json(self, obj, status: int = 200, extra_headers: dict | None = None) -> web.Response:
        """A JSON answer as the server writes it (the dialect's bytes and content type), with the
        weight version header."""
        return web.Response(body=self.dialect.dumps(obj), status=status,
                            headers={"Content-Type": self.dialect.json_content_type, **self.headers(),
                                     **(extra_headers or {})})

    def answer(self, obj: dict, extra_headers: dict | None = None) -> web.Response:
        """A model answer."""
        return self.json(obj, extra_headers=extra_headers)

    async def body(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            data = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise RequestError("the request body must be a JSON object")
        return data

    def check_prompt_logprobs(self, body: dict) -> None:
        if body.get("prompt_logprobs") is None:
            return
        if body.get("stream"):
            raise param_error("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs",
                              with_value=False)
        if not self.dialect.prompt_logprobs:
            raise RequestError("polar-serve does not compute prompt_logprobs for this dialect")

    async def prompt_logprobs(self, body: dict, ids: list[int], echo_k=None):
        """The prompt's logprob positions when asked for (`prompt_logprobs`, or completions' echo
        with logprobs, as vLLM fills them), else None."""
        k = body.get("prompt_logprobs")
        if k is None:
            k = echo_k
        if k is None or not self.dialect.prompt_logprobs:
            return None
        return await self.engine.run_sync(lambda m: m.prompt_logprobs(ids, int(k)))

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if self.dialect.checks_model_name and name not in (None, "") and name not in self.served_names:
            e = RequestError(f"The model `{name}` does not exist."
                             + self.dialect.model_hint(self.served_names), 404, "NotFoundError")
            e.param = self.dialect.model_param
            raise e

    async def sse(self, request: web.Request, chunks, job: Job | list[Job] | None = None, extra: dict | None = None):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", **self.headers(), **(extra or {})})
        await resp.prepare(request)
        done = False
        try:
            async for c in chunks:
                await resp.write(c)
            done = True
        finally:
            if not done and job is not None:
                for j in job if isinstance(job, list) else [job]:
                    j.cancelled = True  # the client went away: free the worker for the next request
        await resp.write_eof()
        return resp

    # -- routes -------------------------------------------------------------------------------
    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/v1/chat/completions", self.wrap(self.chat))
        r.add_post("/v1/completions", self.wrap(self.completions))
        r.add_get("/v1/models", self.wrap(self.models))
        r.add_post("/tokenize", self.wrap(self.tokenize))
        r.add_post("/detokenize", self.wrap(self.detokenize))
        r.add_get("/health", self.wrap(self.health))
        r.add_get(SERVE_VERSION_PATH, self.wrap(self.get_version))
        r.add_post(SERVE_RELOAD_PATH, self.wrap(self.reload))
        self.dialect.extra_routes(self, r)

    def wrap(self, fn):
        async def handler(request: web.Request):
            try:
                return await fn(request)
            except RequestError as e:
                msg, param = str(e), getattr(e, "param", None)
                if hasattr(e, "with_value"):  # params.param_error: the dialect words it
                    msg, param = self.dialect.param_error(msg, param, e.value, e.with_value)
                return self.error(msg, e.status, e.err_type if e.err_type != "BadRequestError" else None, param)
            except web.HTTPException:
                raise
            except Exception as e:  # a bug must answer 500 and keep the server up
                log.exception("request failed")
                return self.error(f"internal error: {type(e).__name__}: {e}", 500)
        return handler

    async def chat(self, request: web.Request):
        body = await self.body(request)
        self.check_model(body)
        self.check_prompt_logprobs(body)
        self.dialect.check_chat(body)
        n = _n(body)
        self.dialect.check_sampling(body, n)
        reqs = [await self.engine.run_sync(chat_request, b, self.dialect, self.served_name, self.script)
                for b in _choice_bodies(body, n)]
        for r in reqs[1:]:  # one answer: the first choice's id and time
            r.request_id, r.created = reqs[0].request_id, reqs[0].created
        req = reqs[0]
        started = time.time()
        plp = None if body.get("stream") else await self.prompt_logprobs(body, req.prompt_ids)
        jobs = [r.job for r in reqs]
        queues = self.engine.stream_many(jobs)
        # Which script entry answered ("turn 1", "rule 0", "fallback"): for debugging e2e tests.
        extra = {SCRIPT_HEADER: req.script_source} if req.script_source else {}
        if body.get("stream"):
            return await self.sse(request, self.dialect.chat_stream(self, reqs, queues, request.headers), jobs, extra)
        results = [await self.collect(j, q) for j, q in zip(jobs, queues, strict=True)]
        return self.answer(self.dialect.chat_answer(self, reqs, results, started, plp), extra)

    async def completions(self, request: web.Request):
        body = await self.body(request)
        self.check_model(body)
        self.check_prompt_logprobs(body)
        n = _n(body) if self.dialect.prompt_logprobs else 1
        self.dialect.check_sampling(body, n)
        reqs = [await self.engine.run_sync(completion_request, b, self.dialect, self.served_name)
                for b in _choice_bodies(body, n)]
        for r in reqs[1:]:
            r.request_id, r.created = reqs[0].request_id, reqs[0].created
        echo_k = body.get("logprobs") if body.get("echo") and body.get("logprobs") not in (None, False) else None
        plp = await self.prompt_logprobs(body, reqs[0].prompt_ids, echo_k)
        jobs = [r.job for r in reqs]
        queues = self.engine.stream_many(jobs)
        if body.get("stream"):
            return await self.sse(request, self.dialect.completion_stream_n(self, reqs, queues, plp), jobs)
        results = [await self.collect(j, q) for j, q in zip(jobs, queues, strict=True)]
        return self.answer(self.dialect.completion_answer(self, reqs, results, plp))

    @staticmethod
    async def collect(job: Job, q) -> GenerationResult:
        """The finished generation of `job` (whose Events arrive on `q`)."""
        try:
            return await collect_result(q)
        except asyncio.CancelledError:
            job.cancelled = True  # client disconnected: stop the generation
            raise

    async def models(self, request: web.Request):
        created = int(time.time())
        cards = [self.dialect.model_card(self, name, created) for name in self.served_names]
        return self.json({"object": "list", "data": cards})

    async def tokenize(self, request: web.Request):
        body = await self.body(request)
        self.check_model(body)
        tok = self.model.tokenizer
        if "messages" in body:
            _, ids = await self.engine.run_sync(lambda m: render_chat(m.tokenizer, body, self.dialect.render))
        elif isinstance(body.get("prompt"), str):
            add = body.get("add_special_tokens", True)
            ids = tok.encode(body["prompt"], add_special_tokens=bool(add))
        else:
            raise RequestError("/tokenize needs 'prompt' (a string) or 'messages'")
        out = {"count": len(ids), "max_model_len": self.model.max_len, "tokens": ids}
        self.dialect.tokenize_extra(out, body, tok)
        return self.json(out)

    async def detokenize(self, request: web.Request):
        body = await self.body(request)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
            raise RequestError("/detokenize needs 'tokens': a list of token ids")
        vocab = self.model.hf.config.vocab_size
        if any(x < 0 or x >= vocab for x in ids):
            raise RequestError(f"token ids must be in [0, {vocab})")
        return self.json({"prompt": self.model.tokenizer.decode(ids)})

    async def health(self, request: web.Request):
        return web.Response(status=200, headers=self.headers())

    async def get_version(self, request: web.Request):
        return web.json_response({"weight_version": self.weight_version, "reloads": self.reloads,
                                  "model": str(self.model.model_dir)}, headers=self.headers())

    async def reload(self, request: web.Request):
        body = await self.body(request)
        d = body.get("model")
        if not isinstance(d, str) or not (Path(d) / "config.json").is_file():
            raise RequestError(f"'model' must name a model directory with a config.json (got {d!r})")
        # On the worker thread: waits for the running generation, never swaps mid-request.
        await self.engine.run_sync(lambda m: m.load(d))
        self.reloads += 1
        self.weight_version = str(body.get("weight_version") or self.reloads)
        return web.json_response({"success": True, "message": "weights reloaded", "weight_version": self.weight_version,
                                  "model": d}, headers=self.headers())


def _choice_bodies(body: dict, n: int) -> list[dict]:
    """One request body per choice: choice i is seeded with seed + i, as vLLM seeds the children of
    a parallel-sampling request (n=1 keeps the body as sent)."""
    if n == 1:
        return [body]
    out = []
    for i in range(n):
        b = dict(body, n=1)
        if body.get("seed") is not None:
            b["seed"] = body["seed"] + i
        out.append(b)
    return out


def _n(body: dict) -> int:
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
        raise RequestError(f"'n' must be an integer in [1, 16] (got {n!r})")
    return n


def make_app(server: Server) -> web.Application:
    @web.middleware
    async def http_errors(request, handler):
        """404 / 405 of unknown routes in the dialect's layout (vLLM: FastAPI's {"detail": ...})."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            body = server.dialect.http_error_body(e.status, e.reason) if e.status >= 400 else None
            if body is None:
                raise
            return server.json(body, status=e.status)

    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[http_errors])
    server.routes(app)
    return app

