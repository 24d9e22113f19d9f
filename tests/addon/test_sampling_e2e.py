"""The sampling columns and the logprobs-mode probe end to end: a real mitmdump with the addon in
front of polar-serve (vllm dialect: processed logprobs as the project runs it; sglang dialect:
SGLang's scaled ones), the tiny Qwen3 (generation_config.json: T=0.6, top_k=20, top_p=0.95).

The recorded values must be the ones the server applied: a request without sampling fields,
proxied with ``polar_generation_config``, gives the same tokens and logprobs as the same request
sent directly with those values spelled out (same seed), and different ones from other values.
Without the option the proxy learns the same values from the server (addon/sampling_discovery.py)."""
from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from addon.logprobs_probe import probe_upstream
from harness_recipes.node.local_stack import serve
from polar_contracts.log.reader import read_log
from tests.support.servers import tiny_model_dir

from .procs import mitmdump

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
COLS = ("temperature", "top_p", "top_k", "min_p", "logprobs_mode", "sampling_unsupported")  # (and sampling_source)
MODE = {"vllm": "processed", "sglang": "scaled"}


def body(**extra):
    return {"model": "polar-model", "messages": [{"role": "user", "content": "Write a haiku about rain."}],
            "max_tokens": 4, "seed": 11, "logprobs": True, "chat_template_kwargs": {"enable_thinking": False},
            **extra}


def post(url: str, b: dict, episode: str | None = None) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=b, timeout=120,
                   headers={"x-polar-episode": episode} if episode else {})
    assert r.status_code == 200, r.text
    return r.json()


def lps(answer: dict) -> list[float]:
    return [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def server(request):
    with serve(tiny_model_dir(), dialect=request.param) as srv:
        srv.dialect = request.param
        yield srv


@contextlib.contextmanager
def proxy(tmp_path, srv, **sets):
    logdir = tmp_path / f"logs-{len(list(tmp_path.iterdir()))}"
    with mitmdump(tmp_path, logdir, upstream=srv.base_url, sets={"termlog_verbosity": "warn", **sets},
                  quiet=False) as px:
        px.logdir = logdir
        yield px


def row(px, episode: str) -> dict:
    (r,) = read_log(px.logdir / f"{episode}.arrow").iter_rows(named=True)
    return r


def test_rows_record_what_the_server_applied(server, tmp_path):
    """No sampling fields + polar_generation_config=the model dir -> the row says 0.6/0.95/20/0.0
    and the server's mode, and the server sampled exactly that: the proxied answer equals a direct
    request with the values spelled out."""
    with proxy(tmp_path, server, polar_generation_config=str(tiny_model_dir())) as px:
        got = post(px.url, body(), "ep")
        r = row(px, "ep")
    assert {k: r[k] for k in COLS} == {**QWEN3, "logprobs_mode": MODE[server.dialect], "sampling_unsupported": None}
    direct = post(server.base_url, body(**QWEN3))
    assert got["choices"][0]["message"] == direct["choices"][0]["message"]
    assert r["completion_logprobs"] == pytest.approx(lps(direct), abs=1e-4)
    assert lps(got) == pytest.approx(lps(direct), abs=1e-4)  # what the harness sees is unchanged


def test_the_filled_in_defaults_are_what_the_server_applies(server, tmp_path):
    """A config naming other defaults than the server's own: the proxy writes them into the request,
    so the server applies them and the row records them (never the server's own, unseen ones)."""
    cfg = tmp_path / "generation_config.json"
    cfg.write_text(json.dumps({"temperature": 1.3, "top_k": 3, "repetition_penalty": 1.0}))
    with proxy(tmp_path, server, polar_generation_config=str(cfg)) as px:
        post(px.url, body(), "ep")
        r = row(px, "ep")
    assert {k: r[k] for k in COLS[:4]} == {"temperature": 1.3, "top_p": 1.0, "top_k": 3, "min_p": 0.0}
    spelled = post(server.base_url, body(temperature=1.3, top_k=3, top_p=1.0, min_p=0.0))
    assert r["completion_logprobs"] == pytest.approx(lps(spelled), abs=1e-4)
    server_default = post(server.base_url, body())
    assert r["completion_logprobs"] != pytest.approx(lps(server_default), abs=1e-3)


def test_without_the_option_the_server_says_what_it_applies(server, tmp_path):
    """No option: the proxy asks the server which model it serves (vLLM /v1/models root, SGLang
    /model_info model_path), reads that directory's generation_config.json, and records (and fills
    in) the server's defaults, saying where they come from; the server sampled exactly that."""
    with proxy(tmp_path, server) as px:
        got = post(px.url, body(), "ep")
        post(px.url, body(temperature=0.8, top_p=0.5, top_k=5, min_p=0.1), "own")
        r, own = row(px, "ep"), row(px, "own")
    assert {k: r[k] for k in COLS} == {**QWEN3, "logprobs_mode": MODE[server.dialect], "sampling_unsupported": None}
    how = "vllm GET /v1/models root" if server.dialect == "vllm" else "sglang GET /model_info model_path"
    assert r["sampling_source"] == f"discovered: {how} -> {tiny_model_dir() / 'generation_config.json'}"
    direct = post(server.base_url, body(**QWEN3))
    assert got["choices"][0]["message"] == direct["choices"][0]["message"]
    assert r["completion_logprobs"] == pytest.approx(lps(direct), abs=1e-4)
    assert own["sampling_source"] == "request" and own["temperature"] == 0.8 and own["top_k"] == 5


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_a_model_path_the_proxy_cannot_read_is_recorded_null_with_the_reason(dialect, tmp_path):
    """The server names a model path that is not a directory on the proxy's machine (here: the link
    it loaded from is gone, as for a model on another machine): the unset fields are null, and the
    row's sampling_source says why and names the option; what the request set is still recorded."""
    link = tmp_path / "model-elsewhere"
    link.symlink_to(tiny_model_dir(), target_is_directory=True)
    with serve(link, dialect=dialect) as srv:
        link.unlink()
        srv.dialect = dialect
        with proxy(tmp_path, srv) as px:
            post(px.url, body(temperature=0.8, presence_penalty=0.5), "ep")
            r = row(px, "ep")
            out = px.output()
    assert {k: r[k] for k in COLS} == {"temperature": 0.8, "top_p": None, "top_k": None, "min_p": None,
                                       "logprobs_mode": MODE[dialect], "sampling_unsupported": "presence_penalty=0.5"}
    assert r["sampling_source"].startswith(f"unknown: the server serves {str(link)!r}"), r["sampling_source"]
    assert "not a directory on the proxy's machine" in r["sampling_source"]
    assert "polar_generation_config" in r["sampling_source"] and "polar_generation_config" in out


def test_the_probe_tells_each_servers_mode(server):
    assert probe_upstream(server.base_url, "polar-model") == MODE[server.dialect]


def test_the_probe_says_raw_for_polar_serves_default():
    with serve(tiny_model_dir(), dialect="vllm", logprobs_mode=None) as srv:  # vLLM's default: raw_logprobs
        assert probe_upstream(srv.base_url, None) == "raw"


def test_an_unreadable_generation_config_stops_the_proxy_with_a_clear_error(tmp_path):
    import subprocess

    from harness_recipes.node.local_stack import addon_script, venv_bin

    r = subprocess.run([venv_bin("mitmdump"), "--listen-host", "127.0.0.1", "--listen-port", "0", "-s",
                        str(addon_script()), "--set", f"polar_logdir={tmp_path / 'logs'}", "--set",
                        f"polar_generation_config={tmp_path / 'nope.json'}", "--set", f"confdir={tmp_path / 'c'}"],
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "polar_generation_config" in out and "cannot read" in out, out[-2000:]
