"""The proxy's addons in process (mitmproxy's test context, no network): control requests that
raise are answered and never forwarded (fault injection), the episode bound, logs never opened
through a symlink, and redaction by key pattern and by known value."""
from __future__ import annotations

import asyncio
import json

import pytest
from mitmproxy.proxy.mode_specs import ProxyMode
from mitmproxy.test import taddons, tflow

from addon import call as calls
from addon.access import OPEN_WARNING
from addon.open_logs import Episodes, TooManyEpisodes
from addon.polar_addon import make_addons
from addon.redact import SECRET_KEY_SCAN, Credentials, credential_values, is_secret_key, redact_json
from polar_contracts.control import CONTROL_HEADER, capability, new_secret
from polar_contracts.log.table import LogError

SECRET = new_secret()


@pytest.fixture(autouse=True)
def loop():
    """One event loop per test, current while it runs (the addons' hooks are coroutines)."""
    lp = asyncio.new_event_loop()
    asyncio.set_event_loop(lp)
    yield lp
    asyncio.set_event_loop(None)
    lp.close()


def run(coro):
    return asyncio.get_event_loop().run_until_complete(coro)


@pytest.fixture
def proxy(tmp_path):
    """The composed addons with a control secret, in mitmproxy's test context."""
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        tctx.options.update(polar_logdir=str(tmp_path / "logs"), polar_control_secret=SECRET,
                            polar_dialect="vllm", polar_logprobs_mode="unknown", polar_server_kind="polar-serve")
        yield addons, tctx


def request(addons, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    f = tflow.tflow()
    # as the proxy runs: a reverse proxy in front of the server (forward mode checks the destination)
    f.client_conn.proxy_mode = ProxyMode.parse("reverse:http://address:22")
    f.request.method, f.request.path = method, path
    f.request.headers.clear()
    for k, v in (headers or {}).items():
        f.request.headers[k] = v
    f.request.content = body

    async def hooks():
        for a in addons:
            if hasattr(a, "request"):
                r = a.request(f)
                if asyncio.iscoroutine(r):
                    await r
    run(hooks())
    return f


def refusals(tmp_path) -> list[dict]:
    p = tmp_path / "logs" / "refused.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


# -- fault injection: a control request that raises is answered, never forwarded -----------------
@pytest.mark.parametrize("exc", [RuntimeError("boom"), RecursionError("deep"), KeyError("k"), ValueError("v")])
def test_an_end_that_raises_is_answered_not_forwarded(proxy, tmp_path, monkeypatch, exc):
    addons, _ = proxy
    episodes = addons[0].state.episodes

    def explode(*a, **k):
        raise exc
    monkeypatch.setattr(episodes, "end", explode)
    f = request(addons, "POST", "/polar/e1/end", b'{"reward": 1}', {CONTROL_HEADER: SECRET})
    assert f.response is not None and f.response.status_code >= 400  # (None: mitmproxy would forward it)
    assert type(exc).__name__ in json.loads(f.response.content)["error"]["message"]
    assert refusals(tmp_path)[-1]["path"] == "/polar/e1/end"


def test_a_weight_request_that_raises_is_answered_not_forwarded(proxy, monkeypatch):
    addons, _ = proxy

    async def explode(base):
        raise RuntimeError("no server")
    monkeypatch.setattr(addons[0].state, "weights", explode)
    f = request(addons, "POST", "/polar/@weights", b'{"path": "/x", "version": "v1"}', {CONTROL_HEADER: SECRET})
    assert f.response is not None and f.response.status_code >= 400


def test_an_access_check_that_raises_refuses(proxy, monkeypatch):
    addons, _ = proxy
    import addon.access as access

    def explode(*a, **k):
        raise RuntimeError("bug")
    monkeypatch.setattr(access, "route", explode)
    f = request(addons, "POST", "/v1/chat/completions", b"{}", {"x-polar-episode": capability(SECRET, "e1")})
    assert f.response is not None and f.response.status_code == 500


def test_refused_lines_carry_no_credential(proxy, tmp_path):
    addons, _ = proxy
    cap = capability(SECRET, "e1")
    f = request(addons, "POST", f"/polar/{cap}/polar/reload?api_key=sk-query-SECRET", b"{}",
                {"authorization": "Bearer sk-header-SECRET"})
    assert f.response.status_code == 403
    f = request(addons, "POST", "/polar/@weights/hold", b"{}", {CONTROL_HEADER: SECRET + "x"})
    assert f.response.status_code == 403
    text = (tmp_path / "logs" / "refused.jsonl").read_text()
    lines = refusals(tmp_path)
    assert lines[0]["episode"] == "e1" and lines[0]["method"] == "POST" and lines[0]["status"] == 403
    assert "polar/reload" in lines[0]["path"] and "not a model API route" in lines[0]["reason"]
    for secret in (SECRET, cap.rpartition("~")[2], "sk-query-SECRET"):
        assert secret not in text


def test_the_episode_bound_refuses_new_episodes_without_a_file(tmp_path):
    eps = Episodes(tmp_path, max_episodes=2)
    eps.begin_call("a")
    eps.begin_call("b")
    with pytest.raises(TooManyEpisodes, match="polar_max_episodes"):
        eps.begin_call("c")
    with pytest.raises(TooManyEpisodes):
        eps.end("d", 1.0, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.arrow", "b.arrow"]
    eps.begin_call("a")  # an open episode goes on
    eps.call_done("a")
    eps.call_done("a")
    eps.end("a", 1.0, {})  # one ends: a new one may start
    eps.begin_call("c")


def test_a_planted_symlink_is_refused_and_its_target_not_created(tmp_path):
    target = tmp_path / "elsewhere" / "created-by-proxy"
    target.parent.mkdir()
    (tmp_path / "e1.arrow").symlink_to(target)  # dangling
    existing = tmp_path / "elsewhere" / "precious"
    existing.write_bytes(b"keep me")
    (tmp_path / "e2.arrow").symlink_to(existing)
    eps = Episodes(tmp_path)
    for eid in ("e1", "e2"):
        with pytest.raises(LogError, match="symbolic link"):
            eps.begin_call(eid)
    assert not target.exists() and existing.read_bytes() == b"keep me"


# -- redaction -----------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["token", "password", "client_secret", "x-goog-api-key", "apiKey", "API-KEY",
                                 "access_token", "refreshToken", "Authorization", "cookie", "credentials",
                                 "private_key", "aws.secret", "github_token", "x-polar-control", "passphrase"])
def test_secret_key_patterns(key):
    raw = json.dumps({"model": "m", "nested": [{key: "v-SECRET"}]}).encode()
    assert is_secret_key(key) and SECRET_KEY_SCAN.search(raw)
    assert "v-SECRET" not in json.dumps(redact_json(json.loads(raw)))


@pytest.mark.parametrize("key", ["max_tokens", "prompt_token_ids", "return_token_ids", "top_logprobs", "tokens",
                                 "cache_control", "key_points", "content", "monkey"])
def test_ordinary_keys_are_kept(key):
    raw = json.dumps({key: "v"}).encode()
    assert not is_secret_key(key) and SECRET_KEY_SCAN.search(raw) is None


def test_known_credentials_scrubbed_by_value_from_request_and_answer():
    """The agent ran `env`: its tool result quotes the upstream key, the control secret, its
    harness's key and its capability; none reaches the row."""
    creds = Credentials()
    creds.configure("upstream api key", "sk-upstream-VALUE-123")
    creds.configure("control secret", SECRET)
    harness_key = credential_values([(b"authorization", b"Bearer sk-harness-VALUE-456")])
    creds.learn(harness_key)
    cap = capability(SECRET, "e1")
    env = f"OPENAI_API_KEY=sk-harness-VALUE-456\nUPSTREAM=sk-upstream-VALUE-123\nS={SECRET}\nPOLAR_EPISODE={cap}\n"
    body = {"model": "m", "messages": [{"role": "user", "content": "run env"},
                                       {"role": "tool", "tool_call_id": "t", "content": env}]}
    c = calls.CapturedCall("e1", 0, "chat", "vllm", 0.0, b"")
    c.known = creds.scrubber([cap.rpartition("~")[2]])
    calls.prepare(c, json.dumps(body).encode(), {})
    calls.finish_request_text(c)
    calls.finish_body(c, 200, json.dumps({"choices": [{"index": 0, "message": {"content": env}}]}).encode())
    (row,) = calls.rows(c, 1.0)
    text = json.dumps({k: v for k, v in row.items() if isinstance(v, (str, bytes))}, default=str)
    text += row["request"].decode() if isinstance(row["request"], bytes) else row["request"]
    for v in ("sk-harness-VALUE-456", "sk-upstream-VALUE-123", SECRET, cap.rpartition("~")[2]):
        assert v not in text
    assert "[redacted]" in text and "POLAR_EPISODE=e1~[redacted]" in text


def test_short_learned_placeholders_are_not_scrubbed_everywhere():
    creds = Credentials()
    creds.learn(["EMPTY", "none"])
    assert creds.scrubber()("EMPTY means none") == "EMPTY means none"


def test_weight_sync_never_adopts_the_callers_authorization(proxy, monkeypatch):
    """The proxy's requests to the server carry polar_server_api_key, whoever calls @weights and
    whatever Authorization the first model call or the sync request carries."""
    addons, tctx = proxy
    tctx.options.update(polar_server_api_key="sk-operator-key")
    from addon.weight_hold import UpstreamWeights
    seen = []

    async def detect(self, kind_option):
        self.kind, self.gate.version = "polar-serve", "v0"

    async def sync(self, path, version, drain_s, peers_drained=True):
        seen.append(dict(self.headers))
        return 200, {"weight_version": version}
    monkeypatch.setattr(UpstreamWeights, "detect", detect)
    monkeypatch.setattr(UpstreamWeights, "sync", sync)
    f = request(addons, "POST", "/polar/@weights", b'{"path": "/w", "version": "v1"}',
                {CONTROL_HEADER: SECRET, "authorization": "Bearer agent-chosen"})
    assert f.response.status_code == 200, f.response.content
    assert seen == [{"Authorization": "Bearer sk-operator-key"}]
    tctx.options.update(polar_server_api_key="")
    f = request(addons, "POST", "/polar/@weights", b'{"path": "/w", "version": "v2"}',
                {CONTROL_HEADER: SECRET, "authorization": "Bearer agent-chosen"})
    assert f.response.status_code == 200 and seen[-1] == {}


def test_logdir_checks(tmp_path):
    from mitmproxy import exceptions

    from addon.model_calls import check_logdir
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(exceptions.OptionsError, match="world-writable"):
        check_logdir(str(open_dir))
    open_dir.chmod(0o1777)  # sticky: as /tmp
    assert check_logdir(str(open_dir)) == str(open_dir)
    (tmp_path / "link").symlink_to(open_dir)
    assert check_logdir(str(tmp_path / "link")) == str(open_dir)  # its real path: a later swap does not move logs


def test_an_open_control_plane_is_warned_about_once(tmp_path, caplog):
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        tctx.options.update(polar_logdir=str(tmp_path / "logs"))
        with caplog.at_level("WARNING", logger="polar"):
            addons[0].running()
            addons[0].running()
        assert [r.message for r in caplog.records].count(OPEN_WARNING) == 1
        # open: bare ids and an unauthenticated end work, as for a proxy run by hand
        f = request(addons, "POST", "/polar/e1/end", b'{"reward": 0.5}')
        assert f.response.status_code == 200
    addons = make_addons()
    with taddons.context(*addons) as tctx, caplog.at_level("WARNING", logger="polar"):
        caplog.clear()
        tctx.options.update(polar_logdir=str(tmp_path / "logs2"), polar_control_secret=SECRET)
        addons[0].running()
        assert not caplog.records
