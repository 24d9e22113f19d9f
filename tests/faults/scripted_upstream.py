"""A misbehaving upstream for the fault tests (a test double: real servers do not misbehave on
demand). Each request says what to answer in its header ``x-answer``: base64url of a JSON object
  {"status": 200, "ctype": "application/json", "body": "<text>"}                  a whole body
  {"status": 200, "ctype": "text/event-stream", "chunks": ["<raw>", ...],
   "gap_s": 0, "hold_s": 0}                  chunks written one by one, then held open hold_s
As a server does, it answers the ids only when asked: ``"ids_body"`` / ``"ids_chunks"`` replace
``body`` / ``chunks`` when the request sets ``return_token_ids`` (so one spec, sent directly and
through the proxy, gives the differential tests both answers).
``"quote_request": true`` appends the request's Authorization header and path to the body (an
error that quotes what it got). Every request body is appended to --record (one JSON line).

    python tests/faults/scripted_upstream.py --port 8000 --record requests.jsonl
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json

from aiohttp import web

READY = "scripted upstream ready"


def answer_header(spec: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()


def _asks_ids(raw: bytes) -> bool:
    try:
        body = json.loads(raw)  # (the json module: a request with a lone surrogate is valid JSON)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("return_token_ids") is True


async def handle(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    rec = request.app["record"]
    if rec:
        with open(rec, "a") as f:
            f.write(json.dumps({"path": request.path_qs, "body": raw.decode("utf-8", "replace")}) + "\n")
    if request.path == "/v1/models":
        return web.json_response({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})
    head = request.headers.get("x-answer")
    if head is None:
        return web.json_response({"error": {"message": "no x-answer header"}}, status=400)
    spec = json.loads(base64.urlsafe_b64decode(head))
    if _asks_ids(raw):
        spec = {**spec, **{k[4:]: v for k, v in spec.items() if k.startswith("ids_")}}
    status, ctype = spec.get("status", 200), spec.get("ctype", "application/json")
    if "chunks" not in spec:
        body = spec.get("body", "")
        if spec.get("quote_request"):
            body += f" (got Authorization: {request.headers.get('authorization')}, path {request.path_qs})"
        return web.Response(status=status, body=body.encode(), content_type=None, headers={"content-type": ctype})
    resp = web.StreamResponse(status=status, headers={"content-type": ctype})
    await resp.prepare(request)
    for chunk in spec["chunks"]:
        await resp.write(chunk.encode())
        if spec.get("gap_s"):
            await asyncio.sleep(spec["gap_s"])
    if spec.get("hold_s"):
        await asyncio.sleep(spec["hold_s"])
    await resp.write_eof()
    return resp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--record", default="")
    a = ap.parse_args()
    app = web.Application(client_max_size=64 * 2**20)
    app["record"] = a.record
    app.router.add_route("*", "/{tail:.*}", handle)
    print(READY, flush=True)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
