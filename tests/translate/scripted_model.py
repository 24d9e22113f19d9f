"""A scripted "model" behind the translators, for driving the real Codex CLI / Claude Code.

It listens on 127.0.0.1, translates each /v1/responses, /v1/messages or Gemini request with
polar_contracts.translate (exactly as the addon does), answers the chat request from a two-step script
(first a tool call that writes hello.txt, then a final text once a tool result is in the
history) as vLLM-shaped chat chunks, and streams the translator's bytes back chunk by chunk.
No proxy and no inference server: only the translators are under test.
"""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from polar_contracts.translate import TranslationError, translator_for
from tests.translate.chat_chunks import full_response, stream

TOOL_CALLS = {"Bash": {"command": "echo hi > hello.txt", "description": "Create hello.txt"},
              "exec_command": {"cmd": "echo hi > hello.txt"},
              "run_shell_command": {"command": "echo hi > hello.txt", "description": "Create hello.txt"}}


def script(chat: dict) -> tuple[list[tuple], str]:
    """The answer parts for a chat request and its finish reason."""
    if "response_format" in chat and not chat.get("tools"):
        return [("text", json.dumps({"title": "Create hello.txt"}))], "stop"
    if chat["messages"][-1]["role"] == "tool":
        return [("reasoning", "The file is written."), ("text", "Done: hello.txt contains hi.")], \
            "stop"
    names = {t["function"]["name"] for t in chat.get("tools") or ()}
    name = next((n for n in TOOL_CALLS if n in names), None)
    if name is None:
        return [("text", "I have no shell tool.")], "stop"
    return [("reasoning", "I will write the file with the shell."),
            ("text", "Creating the file."), ("tool", name, TOOL_CALLS[name])], "tool_calls"


class ScriptedModel:
    def __init__(self) -> None:
        self.calls: list[dict] = []      # {"path", "chat", "notes", "auxiliary"} per model call
        self.other: list[str] = []       # requests that were not model calls
        self.errors: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        t = translator_for(request.method, request.path_qs)
        if t is None:
            self.other.append(f"{request.method} {request.path_qs}")
            return web.Response(status=404 if request.method != "HEAD" else 200)
        body = await request.json()
        try:
            chat = t.request_to_chat(body, request.headers)
        except TranslationError as exc:
            self.errors.append(str(exc))
            data, ctype = t.error_body(400, str(exc))
            return web.Response(status=400, body=data, content_type=ctype.split(";")[0])
        self.calls.append({"path": request.path_qs, "chat": chat, "notes": t.notes,
                           "auxiliary": t.auxiliary})
        parts, finish = script(chat)
        if not chat.get("stream"):
            answer = t.response_from_chat(full_response(parts, finish=finish))
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in stream(parts, finish=finish):
            data = t.feed_chunk(chunk)
            if data:
                await resp.write(data)
        await resp.write(t.finish())
        await resp.write_eof()
        return resp

    def __enter__(self) -> ScriptedModel:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
