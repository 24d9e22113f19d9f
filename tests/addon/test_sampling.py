"""addon/applied_sampling.py and addon/logprobs_probe.py (sans-IO): the effective sampling a call's server
applies, the fields the proxy fills in, the reasons a row's sampling cannot be reproduced, and the
logprobs-mode classifier against the three transforms computed here from random logits."""
import json
import math

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from addon import call as calls
from addon.applied_sampling import (
    NEUTRAL,
    UNKNOWN_DEFAULTS,
    UNKNOWN_PENALTIES,
    GenerationConfigError,
    ModelDefaults,
    load_generation_config,
    resolve,
)
from addon.logprobs_probe import PROBE_TEMPERATURES, ModeCache, ProbeError, classify, probe_body, top_two
from polar_contracts.sampling_fields import combine, normalise

QWEN3 = ModelDefaults({"temperature": 0.6, "top_k": 20, "top_p": 0.95}, "qwen3")


def test_unset_fields_take_the_models_defaults_and_are_filled_in():
    r = resolve({"messages": []}, QWEN3)
    assert r.columns == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "sampling_unsupported": None,
                         "sampling_source": "option: qwen3"}
    assert r.fill == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert not r.unknown
    # what the request sets wins, and is not filled; null is unset (both servers read it so)
    r = resolve({"temperature": 1.0, "top_k": 0, "top_p": None}, QWEN3)
    assert r.columns["temperature"] == 1.0 and r.columns["top_k"] == -1 and r.columns["top_p"] == 0.95
    assert "temperature" not in r.fill and "top_k" not in r.fill and r.fill["top_p"] == 0.95
    assert r.columns["sampling_source"] == "option: qwen3"  # (one of the four came from the defaults)
    # discovered defaults say so; a request that sets all four is its own source
    found = QWEN3.with_origin("discovered: vllm GET /v1/models root -> /m/generation_config.json")
    assert resolve({}, found).columns["sampling_source"] == found.origin
    r = resolve({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0}, found)
    assert r.columns["sampling_source"] == "request"


def test_none_means_the_servers_neutral_defaults():
    r = resolve({}, load_generation_config("none"))
    assert r.columns == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "sampling_unsupported": None,
                         "sampling_source": "option: none"}
    assert r.fill == NEUTRAL


def test_without_the_option_unset_fields_are_unknown_never_guessed():
    r = resolve({"messages": []}, None)
    assert r.columns == {"temperature": None, "top_p": None, "top_k": None, "min_p": None,
                         "sampling_unsupported": None, "sampling_source": f"unknown: {UNKNOWN_DEFAULTS}"}
    # the reason discovery gave is the row's
    r = resolve({"messages": []}, None, "the server serves 'Qwen/Qwen3-8B' (...): set polar_generation_config")
    assert r.columns["sampling_source"].startswith("unknown: the server serves 'Qwen/Qwen3-8B'")
    assert r.fill == {} and set(r.unknown) == {"temperature", "top_p", "top_k", "min_p"}
    # all four known but the penalties not: a model default penalty may apply
    r = resolve({"temperature": 0.7, "top_p": 1, "top_k": -1, "min_p": 0}, None)
    assert r.columns["temperature"] == 0.7 and r.columns["sampling_unsupported"] == UNKNOWN_PENALTIES
    # greedy: the truncations are moot, so known
    r = resolve({"temperature": 0}, None)
    assert (r.columns["temperature"], r.columns["top_k"], r.columns["top_p"]) == (0.0, -1, 1.0) and not r.unknown


@pytest.mark.parametrize("body, reason", [
    ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
    ({"frequency_penalty": -1}, "frequency_penalty=-1"),
    ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
    ({"logit_bias": {"42": -100}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "structured output (response_format json_schema)"),
    ({"response_format": {"type": "json_object"}}, "structured output (response_format json_object)"),
    ({"structured_outputs": {"regex": "a+"}}, "structured output (structured_outputs)"),
    ({"guided_json": {"type": "object"}}, "structured output (guided_json)"),
    ({"regex": "a+"}, "structured output (regex)"),
    ({"tool_choice": "required"}, "tool_choice=required"),
    ({"tool_choice": {"type": "function", "function": {"name": "bash"}}}, "tool_choice=bash"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"min_tokens": 5}, "min_tokens=5"),
    ({"thinking_token_budget": 100}, "thinking_token_budget=100"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"vllm_xargs": {"k": 1}}, "custom logits processor (vllm_xargs)"),
])
def test_what_the_four_parameters_cannot_reproduce_is_named(body, reason):
    assert resolve(body, QWEN3).columns["sampling_unsupported"] == reason


@pytest.mark.parametrize("body", [
    {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1},
    {"logit_bias": {}}, {"response_format": {"type": "text"}}, {"tool_choice": "auto"}, {"tool_choice": "none"},
    {"min_tokens": 0}, {"seed": 7, "n": 4}, {"bad_words": []}, {"stop": ["x"]}, {"ignore_eos": True},
])
def test_neutral_settings_are_no_reason(body):
    assert resolve(body, QWEN3).columns["sampling_unsupported"] is None


def test_a_models_default_penalty_is_a_reason_too(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "repetition_penalty": 1.05}))
    d = load_generation_config(str(tmp_path))
    r = resolve({}, d)
    assert r.fill["repetition_penalty"] == 1.05
    assert r.columns["sampling_unsupported"] == "repetition_penalty=1.05 (the model's default)"
    assert resolve({"repetition_penalty": 1.0}, d).columns["sampling_unsupported"] is None


def test_generation_config_errors_name_the_problem(tmp_path):
    with pytest.raises(GenerationConfigError, match="cannot read"):
        load_generation_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(GenerationConfigError, match="not JSON"):
        load_generation_config(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(GenerationConfigError, match="not a JSON object"):
        load_generation_config(str(tmp_path / "list.json"))
    (tmp_path / "str.json").write_text('{"temperature": "hot"}')
    with pytest.raises(GenerationConfigError, match="temperature is 'hot'"):
        load_generation_config(str(tmp_path / "str.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(GenerationConfigError, match="not a model directory"):
        load_generation_config(str(tmp_path / "empty"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    assert load_generation_config(str(tmp_path / "model")).values == {}  # a model without defaults


def test_the_tiny_models_config_is_qwen3s():
    from harness_recipes.cache import tiny_model

    d = load_generation_config(str(tiny_model()))
    assert d.values == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}


# -- the proxy's request rewrite --------------------------------------------------------------------

def _prepare(raw: bytes, defaults, api="chat", dialect="vllm"):
    c = calls.CapturedCall("e", 0, api, dialect, 0.0, b"")
    c.sampling_defaults = defaults
    new = calls.prepare(c, raw, {})
    return c, json.loads(new if new is not None else raw)


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.none(), st.floats(0, 2)), "top_p": st.one_of(st.none(), st.floats(0.01, 1)),
    "top_k": st.one_of(st.none(), st.integers(-1, 50)), "min_p": st.one_of(st.none(), st.floats(0, 1)),
    "presence_penalty": st.one_of(st.none(), st.sampled_from([0.0, 0.5])),
    "stream": st.booleans()}), st.sampled_from([None, QWEN3]), st.sampled_from(["vllm", "sglang"]),
    st.sampled_from(["chat", "completions"]))
def test_the_forwarded_request_applies_exactly_what_the_row_records(fields, defaults, dialect, api):
    """Property: whatever the request sets, the body the proxy forwards names each of the four
    parameters the row records (so the server applies the recorded value), keeps every field the
    harness set, and the fast top-level path writes what the full parse writes."""
    body = {"model": "m", ("messages" if api == "chat" else "prompt"): [{"role": "user", "content": "x"}]
            if api == "chat" else "x", **fields}
    raw = json.dumps(body).encode()
    c, sent = _prepare(raw, defaults, api, dialect)
    for k, v in fields.items():
        if v is not None:
            assert sent[k] == v
    for k in ("temperature", "top_p", "top_k", "min_p"):
        if c.sampling[k] is not None:
            assert normalise(*(sent.get(p) for p in ("temperature", "top_p", "top_k", "min_p")))[k] == c.sampling[k]
        else:
            assert defaults is None and sent.get(k) is None and k in c.sampling_unknown
    from addon import jsonhead
    saved = jsonhead._simdjson
    jsonhead._simdjson = None  # the full-parse path
    try:
        c2, sent2 = _prepare(raw, defaults, api, dialect)
    finally:
        jsonhead._simdjson = saved
    assert sent2 == sent and c2.sampling == c.sampling


def test_translated_requests_are_resolved_after_translation():
    from polar_contracts.translate import translator_for

    c = calls.CapturedCall("e", 0, "messages", "vllm", 0.0, b"")
    c.translator = translator_for("POST", "/v1/messages")
    c.sampling_defaults = QWEN3
    raw = json.dumps({"model": "claude", "max_tokens": 10, "temperature": 0.3,
                      "messages": [{"role": "user", "content": "hi"}]}).encode()
    sent = orjson.loads(calls.prepare(c, raw, {}))
    assert sent["temperature"] == 0.3 and sent["top_k"] == 20 and sent["top_p"] == 0.95
    assert (c.sampling["temperature"], c.sampling["top_k"]) == (0.3, 20)


def test_rows_carry_the_sampling_columns_and_the_mode():
    c, _ = _prepare(b'{"model": "m", "messages": [], "presence_penalty": 0.5}', QWEN3)
    c.logprobs_mode = "processed"
    row = calls.rows(c, 1.0, "connection failed")[0]
    assert {k: row[k] for k in ("temperature", "top_p", "top_k", "min_p", "logprobs_mode", "sampling_unsupported")} \
        == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "logprobs_mode": "processed",
            "sampling_unsupported": "presence_penalty=0.5"}
    # a body that is not JSON: nothing known
    c = calls.CapturedCall("e", 0, "chat", "vllm", 0.0, b"")
    c.sampling_defaults = QWEN3
    assert calls.prepare(c, b"{bad", {}) is None
    row = calls.rows(c, 1.0)[0]
    assert row["temperature"] is None and row["logprobs_mode"] is None


def test_combine_nulls_what_differs():
    a = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "logprobs_mode": "processed"}
    assert combine([a, dict(a)]) == {**a, "sampling_unsupported": None, "sampling_source": None}
    src = dict(a, sampling_source="request")
    assert combine([src, dict(src, sampling_source="option: /m")])["sampling_source"] == "request; option: /m"
    got = combine([a, dict(a, top_k=None, sampling_unsupported="logit_bias")])
    assert got["top_k"] is None and got["temperature"] == 0.6
    assert got["sampling_unsupported"] == "logit_bias; mixed sampling parameters across calls"


# -- the logprobs-mode classifier, against the three transforms -----------------------------------

def _server_top2(logits: torch.Tensor, mode: str, t: float) -> tuple[float, float]:
    """The top two logprobs a server in ``mode`` reports for a top_k=2 request at temperature t."""
    if mode == "raw":
        lp = torch.log_softmax(logits, -1)
    elif mode == "scaled":
        lp = torch.log_softmax(logits / t, -1)
    else:
        x = logits / t
        kth = torch.topk(x, 2).values[-1]
        lp = torch.log_softmax(x.masked_fill(x < kth, float("-inf")), -1)
    v = torch.topk(lp, 2).values.tolist()
    return float(v[0]), float(v[1])


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["raw", "scaled", "processed"]), st.floats(0.01, 8.0),
       st.sampled_from([100, 5000, 151936]))
def test_classify_tells_the_three_modes_apart(seed, mode, scale, vocab):
    """Property: for random logits of any spread (a near-uniform random model to a very confident
    one), the classifier names the mode or says it cannot tell (None); it is never wrong."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(vocab, generator=g, dtype=torch.float64) * scale).float()
    got = classify(*(_server_top2(logits, mode, t) for t in PROBE_TEMPERATURES))
    assert got in (mode, None)
    top = torch.topk(logits, 2).values
    if float(top[0] - top[1]) >= 1e-3 and scale >= 0.05 and vocab >= 5000:  # tops not tied: it must tell
        assert got == mode


def test_classify_cannot_tell_equal_top_tokens():
    assert classify((math.log(0.5), math.log(0.5)), (math.log(0.5), math.log(0.5))) is None


def test_probe_body_and_answers():
    b = probe_body("polar-model", 2.0)
    assert (b["model"], b["top_k"], b["top_logprobs"], b["max_tokens"], b["temperature"]) == ("polar-model", 2, 2, 1,
                                                                                              2.0)
    ans = {"choices": [{"logprobs": {"content": [{"top_logprobs": [{"logprob": -2.0}, {"logprob": -0.2}]}]}}]}
    assert top_two(ans) == (-0.2, -2.0)
    with pytest.raises(ProbeError, match="no top_logprobs"):
        top_two({"choices": [{"logprobs": None}]})


def test_mode_cache_backs_off_and_invalidates():
    m = ModeCache()
    assert m.should_probe("u", 0.0)
    g = m.started("u", object())
    assert not m.should_probe("u", 0.0)  # one in flight
    m.done("u", g, None, 10.0)  # failed: retried after a backoff
    assert m.mode("u") is None and not m.should_probe("u", 11.0) and m.should_probe("u", 15.0)
    g = m.started("u", object())
    m.done("u", g, "processed", 20.0)
    assert m.mode("u") == "processed" and not m.should_probe("u", 1e9)
    g = m.started("u", object()) if m.should_probe("u", 0) else m.entry("u").generation
    m.invalidate("u")  # a weight sync: probe again; an older probe finishing later does not count
    assert m.mode("u") is None and m.should_probe("u", 21.0)
    g2 = m.started("u", "new")
    m.done("u", g, "raw", 22.0)
    assert m.mode("u") is None and m.entry("u").task == "new"
    m.done("u", g2, "scaled", 23.0)
    assert m.mode("u") == "scaled"


def test_the_probe_sends_the_servers_key_and_falls_back_to_the_served_model():
    """A server behind --api-key answers the probe only with the key; a model name the server does
    not serve (a translated Messages call's "claude-...") falls back to /v1/models' first id."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            ok = self.headers.get("authorization") == "Bearer k"
            self._send(200 if ok else 401, {"data": [{"id": "served"}]} if ok else {"error": "key"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.headers.get("authorization"), body["model"], body["temperature"]))
            if self.headers.get("authorization") != "Bearer k":
                return self._send(401, {"error": "key"})
            if body["model"] != "served":
                return self._send(404, {"error": "model"})
            t = body["temperature"]  # a processed top-2 with logit gap 1.0 at T=1
            a, b = _server_top2(torch.tensor([1.0, 0.0, -3.0]), "processed", t)
            self._send(200, {"choices": [{"logprobs": {"content": [
                {"top_logprobs": [{"logprob": a}, {"logprob": b}]}]}}]})

    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_port}"
    try:
        from addon.logprobs_probe import probe_upstream

        with pytest.raises(OSError):
            probe_upstream(base, "served", 5)
        assert probe_upstream(base, "claude-x", 5, {"Authorization": "Bearer k"}) == "processed"
        assert [m for k, m, _ in seen if k] == ["claude-x", "served", "served"]
    finally:
        srv.shutdown()


# -- sampling discovery (addon/sampling_discovery.py) -----------------------------------------------

def test_discovery_reads_the_model_path_each_server_names(tmp_path):
    from addon.sampling_discovery import defaults_at, model_path_of

    cards = {"data": [{"id": "lora-a", "root": "/adapters/a"}, {"id": "m", "root": "/models/m"}]}
    assert model_path_of("vllm", "/v1/models", cards, "m") == "/models/m"
    assert model_path_of("vllm", "/v1/models", cards, None) == "/adapters/a"  # (the first card)
    assert model_path_of("vllm", "/v1/models", {"data": [{"id": "m"}]}, None) is None
    assert model_path_of("sglang", "/model_info", {"model_path": "/models/m", "weight_version": "default"}, None) \
        == "/models/m"
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20, "do_sample": True}))
    d = defaults_at(str(model), "vllm GET /v1/models root")
    assert d.defaults.values == {"temperature": 0.6, "top_k": 20}
    assert d.defaults.origin == f"discovered: vllm GET /v1/models root -> {model / 'generation_config.json'}"
    gone = defaults_at("Qwen/Qwen3-8B", "vllm GET /v1/models root")
    assert gone.defaults is None and gone.definite and "not a directory on the proxy's machine" in gone.why
    assert "polar_generation_config" in gone.why
    bad = defaults_at(str(tmp_path), "sglang GET /model_info model_path")  # a directory, not a model's
    assert bad.defaults is None and "not a model directory" in bad.why


def test_discovery_asks_sglangs_older_route_and_retries_an_unreachable_server(tmp_path):
    import http.server
    import threading

    from addon.sampling_discovery import discover

    model = tmp_path / "m"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))

    class Old(http.server.BaseHTTPRequestHandler):  # SGLang before /model_info
        def do_GET(self):
            body = json.dumps({"model_path": str(model)}).encode() if self.path == "/get_model_info" else b"{}"
            self.send_response(200 if self.path == "/get_model_info" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        d = discover(f"http://127.0.0.1:{srv.server_port}", "sglang", None)
    finally:
        srv.shutdown()
    assert d.defaults.values == {"temperature": 0.7} and "sglang GET /get_model_info model_path" in d.defaults.origin
    down = discover(f"http://127.0.0.1:{srv.server_port}", "vllm", None, timeout=2)
    assert down.defaults is None and not down.definite and "could not be asked" in down.why
