"""Several capture proxies on one node: K mitmdump + addon processes (default one per core) sharing
one log directory, each episode sent to one of them by its id, and weight syncs spanning all K.

    with proxy_pool(server_url, logdir, k=2) as pool:
        pool.for_episode(eid)             # the proxy URL of this episode, always the same one
        await pool.sync(path, version)    # hold all K, the server loads once, release all K

Why one address per episode and not one front address: one Python mitmdump saturates one core,
so a front process that parses HTTP to route by episode would be the bottleneck again, and a
front that does not parse (SO_REUSEPORT, a TCP balancer) spreads connections, not episodes: an
episode's calls on two connections would reach two processes, and its log would get two writers.
The episode id is in every call's URL (``/polar/<id>/...``) or header, and the rollout node picks
the harness's base URL itself, so it hands each episode one proxy's address. The choice is a
stable hash of the id (``pick``), not a counter: anyone holding the id (the end call, a retry
of the end, a test, a tool reading the logs) finds the proxy again without shared state.

One log directory for all K is safe: an episode has one writer (its proxy), episode files are
named by id, and ``weight-syncs.jsonl`` gets whole lines appended (O_APPEND, one write each).

The K proxies share one control secret (polar_contracts/control.py), made here and handed to them
in a file of mode 0600 in the pool's work directory (``polar_control_secret_file``): never in
their argv or environment, which a process in a sandbox without its own pid namespace could read.
The pool's holder (the rollout node) ends episodes and syncs weights with it (``pool.secret``,
``pool.control_headers``) and gives each harness its episode's capability only.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from addon.weight_hold import Http, urllib_http
from harness_recipes.node.die_with_parent import command as with_parent_death
from harness_recipes.node.processes import Proc, free_port, running, stop, venv_bin, wait_ready
from polar_contracts.control import HOLD_PATH, RELEASE_PATH, SYNC_PATH, control_headers, new_secret, write_secret_file
from polar_contracts.weight_versions import unknown

DEFAULT_LEASE_S = 900.0  # a held proxy releases itself after this if the coordinator is gone
DEFAULT_TIMEOUT_S = 900.0  # each request of a sync (a hold drains, the leader's sync loads)


def addon_script() -> Path:
    """The capture addon's mitmproxy script (`mitmdump -s`), from the installed `addon` package."""
    return Path(str(files("addon").joinpath("polar_addon.py")))


def default_k() -> int:
    """One proxy per core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not Linux)
        return max(1, os.cpu_count() or 1)


def pick(eid: str, k: int) -> int:
    """The index of the proxy of episode ``eid`` among ``k``: a stable hash (the same in every process
    and every run: Python's own hash() of a str is salted per process)."""
    if k < 1:
        raise ValueError(f"need at least one proxy, not {k}")
    h = hashlib.blake2b(eid.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") % k


# -- one weight sync across several proxies -------------------------------------------------------
@dataclass
class SyncResult:
    status: int  # 200: loaded; else the failure (the leader's status, or the first failed hold's)
    weight_version: str | None  # what every proxy serves now
    leader: dict = field(default_factory=dict)  # the leader's answer (or the reason it has none)
    holds: list[dict] = field(default_factory=list)  # each held proxy's answer to its hold
    releases: list[dict] = field(default_factory=list)  # ... and to its release
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


async def _post(http: Http, url: str, body: dict, headers: dict, timeout: float) -> tuple[int | None, dict]:
    """(status, JSON answer); status None when the proxy could not be reached."""
    try:
        status, raw = await http("POST", url, body, headers, timeout)
    except Exception as exc:  # noqa: BLE001 - an unreachable proxy is this proxy's failure
        return None, {"error": f"POST {url} failed: {type(exc).__name__}: {exc}"}
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        obj = {"error": f"POST {url}: HTTP {status}, not JSON: {raw[:300]!r}"}
    return status, obj if isinstance(obj, dict) else {"answer": obj}


def _message(ans: dict) -> str:
    err = ans.get("error")
    return str(err.get("message") if isinstance(err, dict) else err)


async def hold_proxies(urls: Sequence[str], version: str, *, lease_s: float = DEFAULT_LEASE_S,
                       timeout: float = DEFAULT_TIMEOUT_S, headers: dict | None = None,
                       http: Http = urllib_http) -> list[dict]:
    """``POST /polar/@weights/hold`` to every proxy at once; each answer with its ``proxy`` and
    ``status`` (None: unreachable)."""
    urls = [u.rstrip("/") for u in urls]
    answers = await asyncio.gather(*(_post(http, u + HOLD_PATH, {"version": version, "lease_s": lease_s},
                                           headers or {}, timeout) for u in urls))
    return [{"proxy": u, "status": s, **a} for u, (s, a) in zip(urls, answers, strict=True)]


async def lead_sync(url: str, path: str, version: str, peers_drained: bool | None, *,
                    timeout: float = DEFAULT_TIMEOUT_S, headers: dict | None = None,
                    http: Http = urllib_http) -> dict:
    """The one ordinary sync (``POST /polar/@weights``) that has the server load; ``peers_drained``
    None: there are no held peers."""
    body = {"path": path, "version": version}
    if peers_drained is not None:
        body["peers_drained"] = peers_drained
    status, ans = await _post(http, url.rstrip("/") + SYNC_PATH, body, headers or {}, timeout)
    return {"proxy": url.rstrip("/"), "status": status, **ans}


async def release_proxies(held: Sequence[dict], version: str, after: str | None, ok: bool, *, keep: bool = False,
                          timeout: float = DEFAULT_TIMEOUT_S, headers: dict | None = None,
                          http: Http = urllib_http) -> list[dict]:
    """``POST /polar/@weights/release`` to every held proxy (the answers of hold_proxies): serve
    ``after`` from now on; ``keep``: each its own previous version (nothing was loaded)."""
    async def one(h):
        body = {"version": version, "weight_version": h["weight_version"] if keep else after, "ok": ok and not keep}
        s, a = await _post(http, h["proxy"] + RELEASE_PATH, body, headers or {}, timeout)
        return {"proxy": h["proxy"], "status": s, **a}
    return list(await asyncio.gather(*(one(h) for h in held)))


Hold = Callable[[], Awaitable[list[dict]]]
Lead = Callable[[bool | None], Awaitable[dict]]
Release = Callable[[list[dict], str | None, bool, bool], Awaitable[list[dict]]]


async def coordinate(version: str, hold: Hold, lead: Lead, release: Release, lease_s: float) -> SyncResult:
    """One sync across proxies, whatever carries the requests (HTTP here; Ray calls to each node of
    a fleet, fleet/driver.py): hold every follower, have the leader sync (the server loads once), release
    the followers with the version the leader's sync ended with.

    A hold that fails releases the holds already taken (unchanged) and nothing loads. A leader with
    no answer (unreachable, died mid-sync) leaves the version unknown: the held proxies are released
    with an ``unknown:`` marker, so their rows say so until the next good sync."""
    res = SyncResult(status=0, weight_version=None)
    res.holds = await hold()
    held = [h for h in res.holds if h["status"] == 200]
    if len(held) < len(res.holds):
        bad = next(h for h in res.holds if h["status"] != 200)
        res.status = bad["status"] or 503
        res.error = f"proxy {bad['proxy']} could not be held for the sync to {version!r}: {_message(bad)}"
        res.releases = await release(held, None, False, True)
        return res
    res.leader = ans = await lead(all(h["drained"] for h in held) if res.holds else None)
    status = ans["status"]
    if status is None or "weight_version" not in ans:
        after = unknown(f"the sync to {version} through {ans['proxy']} gave no answer")
        res.status, res.error = status or 503, _message(ans)
    else:
        after = ans["weight_version"]
        res.status = status
        res.error = None if status == 200 else _message(ans)
    res.weight_version = after
    res.releases = await release(held, after, status == 200, False)
    failed = [r for r in res.releases if r["status"] != 200]
    if failed and res.ok:
        # The server loaded; a proxy that did not take the release frees itself at its lease's end
        # with the version the server reports then.
        res.error = (f"{len(failed)} held proxies did not take the release (they release themselves after "
                     f"{lease_s:g} s): " + "; ".join(f"{r['proxy']}: {_message(r)}" for r in failed))
    return res


async def sync_proxies(urls: Sequence[str], path: str, version: str, *, lease_s: float = DEFAULT_LEASE_S,
                       timeout: float = DEFAULT_TIMEOUT_S, headers: dict | None = None,
                       http: Http = urllib_http) -> SyncResult:
    """Make the server behind ``urls`` (proxies of one inference server) serve ``path`` as ``version``,
    with no proxy admitting a call while it loads and the server loading once: the first proxy
    leads (its ordinary ``POST /polar/@weights`` talks to the server), the others are held first
    (``/hold``: new calls wait, calls in flight drain) and released after (``/release``); see
    ``coordinate``."""
    if not urls:
        raise ValueError("sync_proxies needs at least one proxy URL")
    kw = {"timeout": timeout, "headers": headers, "http": http}
    return await coordinate(
        version,
        lambda: hold_proxies(urls[1:], version, lease_s=lease_s, **kw),
        lambda drained: lead_sync(urls[0], path, version, drained, **kw),
        lambda held, after, ok, keep: release_proxies(held, version, after, ok, keep=keep, **kw),
        lease_s)


# -- the processes --------------------------------------------------------------------------------
@dataclass
class ProxyPool:
    procs: list[Proc]
    logdir: Path
    secret: str | None = field(default=None, repr=False)  # the proxies' control secret (None: open)
    secret_file: Path | None = None

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    @property
    def control_headers(self) -> dict[str, str]:
        return control_headers(self.secret)

    def for_episode(self, eid: str) -> str:
        return self.procs[pick(eid, len(self.procs))].url

    async def sync(self, path: str, version: str, **kw) -> SyncResult:
        return await sync_proxies(self.urls, path, version, **{"headers": self.control_headers, **kw})


SECRET_FILE = "control-secret"


def secret_file(workdir: Path, secret: str) -> Path:
    """Write the control secret to ``workdir/control-secret`` (0600; a leftover file or a link
    there is removed first, never followed)."""
    path = Path(workdir) / SECRET_FILE
    path.unlink(missing_ok=True)
    write_secret_file(path, secret)
    return path


def mitmdump_cmd(upstream: str, logdir: Path, port: int, *, confdir: Path | None = None,
                 sets: dict | None = None) -> list[str]:
    """The command line of one capture proxy (as stack.capture_proxy runs it)."""
    cmd = [venv_bin("mitmdump"), "-q", "--listen-host", "127.0.0.1", "--listen-port", str(port),
           "--mode", f"reverse:{upstream}", "-s", str(addon_script()), "--set", f"polar_logdir={logdir}"]
    if confdir is not None:
        cmd += ["--set", f"confdir={confdir}"]
    for key, value in {"termlog_verbosity": "warn", **(sets or {})}.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


@contextlib.contextmanager
def proxy_pool(upstream: str, logdir: Path, k: int | None = None, *, workdir: Path | None = None,
               sets: dict | None = None, timeout: float = 60.0, die_with_parent: bool = False,
               control_secret: str | bool | None = True) -> Iterator[ProxyPool]:
    """K capture proxies in reverse mode in front of ``upstream``, all writing ``logdir``; each one's
    output goes to ``workdir/mitmdump-<i>.log`` (default: ``logdir/../proxies``). The first starts
    alone (it creates mitmproxy's CA in the shared confdir), the rest start together. Every one is
    stopped by its pid when the block exits. ``die_with_parent``: the kernel also kills them when
    this process dies without reaching that (die_with_parent.py; enter the block from a thread
    that lives as long as they should: the death signal follows the starting thread).
    ``control_secret``: True (default) a new one, a string that one, None an open control plane."""
    k = default_k() if k is None else k
    if k < 1:
        raise ValueError(f"proxies per node must be >= 1, not {k}")
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(workdir) if workdir is not None else logdir.parent / "proxies"
    confdir = workdir / "mitmconf"
    confdir.mkdir(parents=True, exist_ok=True)
    secret = new_secret() if control_secret is True else (control_secret or None)
    sfile = secret_file(workdir, secret) if secret else None
    if sfile is not None:
        sets = {**(sets or {}), "polar_control_secret_file": sfile}
    with contextlib.ExitStack() as stack:
        procs: list[Proc] = []

        def start(i: int) -> Proc:
            port = free_port()
            cmd = mitmdump_cmd(upstream, logdir, port, confdir=confdir, sets=sets)
            if die_with_parent:
                cmd = with_parent_death(cmd)
            p = stack.enter_context(running(cmd, log=workdir / f"mitmdump-{i}.log"))
            p.url = f"http://127.0.0.1:{port}"
            return p

        procs.append(start(0))
        wait_ready(procs[0], port=procs[0].port, timeout=timeout, what="mitmdump 0")
        procs += [start(i) for i in range(1, k)]
        try:
            with ThreadPoolExecutor(max_workers=max(1, k - 1)) as ex:
                list(ex.map(lambda ip: wait_ready(ip[1], port=ip[1].port, timeout=timeout, what=f"mitmdump {ip[0]}"),
                            enumerate(procs[1:], 1)))
        except BaseException:
            for p in procs:
                stop(p.proc)
            raise
        try:
            yield ProxyPool(procs, logdir, secret, sfile)
        finally:
            if sfile is not None:
                sfile.unlink(missing_ok=True)
