"""Weight sync: a real polar-serve process reloads the trainer's weights; the vLLM LoRA request shape
against a local aiohttp endpoint; errors are clear."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch

from tests.trainer.shardkit import row, synthetic_seq, write_shard
from tests.trainer.test_grpo_trainer import PLAIN, config, trainer
from trainer.weight_sync import WeightSyncCallback, WeightSyncError, parse_reload_response, post_json


def http(method: str, url: str, body: dict | None = None) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method=method)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def prompt_logprobs(base: str, prompt: list[int]) -> list[float]:
    # Greedy, one token at a time with its logprob: a fingerprint of the served weights.
    d = http("POST", base + "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                "logprobs": 1, "return_token_ids": True})
    return d["choices"][0]["logprobs"]["token_logprobs"]


def test_sync_to_real_polar_serve(tmp_path, tiny_dir):
    from tests.support import servers
    p = [151644, 872, 198, 151645, 198, 151644, 77091, 198]
    rows = [row(synthetic_seq(p, [400 + 10 * g + e, 9]), f"g{g}-e{e}", f"g{g}", float(e), group_size=2,
                weight_version="0", **PLAIN) for g in range(4) for e in range(2)]
    write_shard(tmp_path / "shards", 1, rows)
    with servers.polar_serve(tiny_dir, "vllm", extra_args=["--weight-version", "0"]) as srv:
        assert http("GET", srv.base_url + "/polar/weight_version")["weight_version"] == "0"
        before = prompt_logprobs(srv.base_url, p)
        cfg = config(tmp_path, max_steps=2, learning_rate=5e-2, sync_server=srv.base_url, sync_steps=1, sync_keep=1,
                     max_policy_lag=4)
        t = trainer(tiny_dir, cfg)
        t.train()
        sync = next(c for c in t.callback_handler.callbacks if isinstance(c, WeightSyncCallback))
        assert [s["weight_version"] for s in sync.syncs] == ["1", "2"]
        assert t.shard_source.current_version == 2
        served = http("GET", srv.base_url + "/polar/weight_version")
        assert served["weight_version"] == "2" and served["model"] == sync.syncs[-1]["dir"]
        assert [d.name for d in (tmp_path / "out" / "polar-weights").iterdir()] == ["step-000002"]  # keep=1
        after = prompt_logprobs(srv.base_url, p)
        assert after != before  # the server now samples from the trained weights
        # ...and those are exactly the trainer's weights.
        from safetensors.torch import load_file
        saved = load_file(str(Path(sync.syncs[-1]["dir"]) / "model.safetensors"))
        for name, param in t.model.named_parameters():
            if name in saved:
                assert torch.equal(saved[name], param.detach()), name


class FakeVLLM:
    """127.0.0.1 aiohttp server answering /v1/load_lora_adapter the way vLLM does (plain text)."""

    def __init__(self, status: int = 200):
        self.status = status
        self.requests: list[dict] = []

    def __enter__(self):
        from aiohttp import web

        async def load(request):
            self.requests.append({"body": await request.json(), "auth": request.headers.get("Authorization")})
            if self.status != 200:
                return web.json_response({"error": {"message": "The lora adapter 'polar' has already been loaded."}},
                                         status=self.status)
            return web.Response(text="Success: LoRA adapter 'polar' added successfully.")

        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", load)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class SecuredProxy(FakeVLLM):
    """127.0.0.1 stand-in for a capture proxy with a control secret: it refuses the weight-sync path
    (GET and POST) without the secret, with the proxy's own 403 text."""

    def __enter__(self):
        from aiohttp import web

        from polar_contracts.control import SYNC_PATH

        async def refuse(request):
            self.requests.append({"method": request.method, "control": request.headers.get("x-polar-control")})
            return web.Response(status=403, text="control request without header x-polar-control")

        app = web.Application()
        app.router.add_route("*", SYNC_PATH, refuse)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self


class FullModel:
    """Stands in for a full (non-PEFT) model: the callback calls `save_pretrained`."""

    def save_pretrained(self, path, safe_serialization=True):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")


def test_proxy_refusal_names_the_secret_option(tmp_path):
    """A secured proxy's 403 names polar-train's --sync_secret_file; the version probe at train begin
    already fails with it, before the first (long) training step."""
    with SecuredProxy() as srv:
        cb = WeightSyncCallback(f"http://127.0.0.1:{srv.port}", save_dir=tmp_path, mode="proxy")
        with pytest.raises(WeightSyncError, match=r"HTTP 403: control request without.*--sync_secret_file FILE"):
            cb.initial_version()
        with pytest.raises(WeightSyncError, match=r"HTTP 403.*--sync_secret_file FILE") as info:
            cb.sync(FullModel(), None, 1)
        assert info.value.status == 403
        wrong = WeightSyncCallback(f"http://127.0.0.1:{srv.port}", save_dir=tmp_path, mode="proxy",
                                   control_secret="s" * 43)
        with pytest.raises(WeightSyncError, match=r"is not the proxy's"):
            wrong.initial_version()
    assert [r["method"] for r in srv.requests] == ["GET", "POST", "GET"]


class AdapterModel:
    """Stands in for a PEFT model: what the callback uses is `peft_config` and `save_pretrained`."""

    peft_config = {"default": {}}

    def save_pretrained(self, path, safe_serialization=True):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "adapter_config.json").write_text("{}")


def test_vllm_lora_request(tmp_path):
    with FakeVLLM() as srv:
        cb = WeightSyncCallback(f"http://127.0.0.1:{srv.port}", save_dir=tmp_path, mode="vllm_lora",
                                lora_name="polar", api_key="sk-secret-1")
        assert cb.sync(AdapterModel(), None, 3) == "1"
        assert cb.sync(AdapterModel(), None, 6) == "2"
    assert [r["body"] for r in srv.requests] == [
        {"lora_name": "polar", "lora_path": str(tmp_path / "step-000003"), "load_inplace": True},
        {"lora_name": "polar", "lora_path": str(tmp_path / "step-000006"), "load_inplace": True}]
    assert srv.requests[0]["auth"] == "Bearer sk-secret-1"
    assert (tmp_path / "step-000006" / "adapter_config.json").is_file()


def test_sync_errors(tmp_path, caplog):
    with FakeVLLM(status=400) as srv:
        cb = WeightSyncCallback(f"http://127.0.0.1:{srv.port}", save_dir=tmp_path, mode="vllm_lora",
                                api_key="sk-secret-2")
        with pytest.raises(WeightSyncError, match="HTTP 400: .*already been loaded"):
            cb.sync(AdapterModel(), None, 1)
    assert "sk-secret-2" not in caplog.text
    with pytest.raises(WeightSyncError, match="failed after 2 tries"):
        post_json("http://127.0.0.1:9/polar/reload", {"model": "x"}, retries=1, backoff=0.01, timeout=2)
    with pytest.raises(WeightSyncError, match="no weight_version"):
        parse_reload_response(b'{"success": true}')
    assert parse_reload_response(b'{"weight_version": 3}') == "3"
    cb = WeightSyncCallback("http://127.0.0.1:9", save_dir=tmp_path, mode="vllm_lora")
    with pytest.raises(WeightSyncError, match="needs a PEFT"):
        cb.sync(torch.nn.Linear(1, 1), None, 1)
