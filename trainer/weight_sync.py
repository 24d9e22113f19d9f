"""Push the policy to the inference server every N optimizer steps (a TrainerCallback).

Three targets:
- ``proxy`` (any server behind the capture proxy): save the full model + tokenizer to
  ``SYNC_DIR/step-NNNNNN`` and ``POST {proxy}/polar/@weights {"path": DIR, "version": "step-NNNNNN"}``.
  The proxy holds new model calls, lets the calls in flight finish, has the server load DIR by
  its own API (real vLLM's RL routes, SGLang's ``/update_weights_from_disk``, polar-serve's
  ``/polar/reload``; addon/weight_hold.py), records the version on every row and answers
  ``{"weight_version": "step-NNNNNN", ...}``. DIR must be readable by the server at that path.
- ``polar``: save the full model + tokenizer to ``SYNC_DIR/step-NNNNNN`` and
  ``POST {server}/polar/reload {"model": DIR}``; polar-serve answers ``{"weight_version": "<n>", ...}``
  (its reload counter, an integer as a string). The version goes to the ShardSource, which bounds
  staleness with it (see shard_source.py).
- ``polar`` without the proxy in the way (polar-serve directly), as below.
- ``vllm_lora``: save the PEFT adapter to ``SYNC_DIR/step-NNNNNN`` and
  ``POST {server}/v1/load_lora_adapter {"lora_name": NAME, "lora_path": DIR, "load_inplace": true}``
  (vLLM answers plain text; ``load_inplace`` replaces the adapter under the same name so the harness
  keeps calling one model name). vLLM must run with ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. vLLM has no weight version for adapters; the callback
  counts syncs itself and reports that count.

When training starts the callback reads the server's current version (the proxy's ``GET
/polar/@weights``, polar-serve's ``GET /polar/weight_version``; ``"0"`` for vllm_lora) and tells
the ShardSource, whose sync history orders the versions (position 0; see shard_source.py).

Directories are written under a temporary name and renamed, so the server never reads a half-written
model; the newest ``keep`` directories stay (the server may still be reading the previous one).
A failed request is retried, then raises WeightSyncError: training on while the server serves stale
weights would silently turn on-policy RL into off-policy RL. The API key, if any, is sent as a bearer
token and never logged.

``proxy``: a proxy with a control secret (the rollout node's always have one) refuses a sync without
it (403). The trainer reads it from the file ``sync_secret_file`` names (config field), else from
the file in the environment variable ``POLAR_CONTROL_SECRET_FILE`` (mode 0600; the node writes
it), and sends it in header ``x-polar-control``. The proxy's own requests to the server carry the
proxy's ``polar_server_api_key``, never the trainer's Authorization header.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

from transformers import TrainerCallback

from polar_contracts.control import (
    SERVE_RELOAD_PATH,
    SERVE_VERSION_PATH,
    SYNC_PATH,
    control_headers,
    read_secret_file,
)
from trainer.config_choices import SYNC_MODES

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status  # the HTTP status the server refused with, if it answered


SECRET_FILE_ENV = "POLAR_CONTROL_SECRET_FILE"


def refused_control(refusal: str, secret_given: bool) -> WeightSyncError:
    """A proxy's 403 to a weight sync, naming the trainer option that fixes it: the user sees this after
    a whole training step, so it must say what to pass, not only what the proxy said."""
    fix = ("the secret in --sync_secret_file (or $POLAR_CONTROL_SECRET_FILE) is not the proxy's: pass the file "
           "the proxy reads (mitmdump --set polar_control_secret_file=FILE, polar-rollout --control-secret-file FILE)"
           if secret_given else
           "the proxy holds a control secret: pass polar-train --sync_secret_file FILE (the file given to the proxy "
           "as --set polar_control_secret_file=FILE, and to polar-rollout as --control-secret-file FILE) or set "
           f"${SECRET_FILE_ENV}")
    return WeightSyncError(f"{refusal.strip()[:400]}; {fix}", 403)


def sync_secret(path: str | None) -> str | None:
    """The proxy's control secret for sync_mode=proxy: from ``path`` (config sync_secret_file), else
    the file named by $POLAR_CONTROL_SECRET_FILE, else None (an open proxy)."""
    path = path or os.environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        return read_secret_file(path)
    except ValueError as exc:
        raise WeightSyncError(str(exc)) from None


def post_json(url: str, body: dict, *, timeout: float = 120.0, api_key: str | None = None,
              retries: int = 2, backoff: float = 1.0, headers: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    last = ""
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:  # the server answered: do not retry a refusal
            raise WeightSyncError(f"POST {url} -> HTTP {e.code}: {e.read()[:500].decode(errors='replace')}",
                                  e.code) from None
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", e))
            if attempt < retries:
                time.sleep(backoff * (2 ** attempt))
    raise WeightSyncError(f"POST {url} failed after {retries + 1} tries: {last}")


def parse_reload_response(body: bytes, what: str = SERVE_RELOAD_PATH) -> str:
    try:
        d = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise WeightSyncError(f"{what} answered non-JSON: {body[:200]!r}") from None
    v = d.get("weight_version") if isinstance(d, dict) else None
    if v is None:
        raise WeightSyncError(f"{what} answer has no weight_version: {d!r}"[:500])
    return str(v)


def get_json(url: str, *, timeout: float = 30.0, api_key: str | None = None, headers: dict | None = None) -> dict:
    headers = {**({"Authorization": f"Bearer {api_key}"} if api_key else {}), **(headers or {})}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        d = json.loads(r.read())
    if not isinstance(d, dict):
        raise WeightSyncError(f"GET {url} answered {d!r}"[:300])
    return d


MODES = SYNC_MODES  # the public name, kept
# harness_recipes/fleet/driver.py's named coordinator (imports run one way: the names, not the module)
FLEET_WEIGHTS_ACTOR, FLEET_NAMESPACE = "polar-fleet-weights", "polar"


def _fleet_coordinator(address: str):
    """The running fleet's weight-sync actor; this process joins the Ray cluster at ``address``
    (auto | HOST:PORT) if it has not."""
    try:
        import ray
    except ImportError:
        raise WeightSyncError("sync_mode=fleet needs Ray in the trainer's environment (pip install 'polar[fleet]')") \
            from None
    if not ray.is_initialized():
        from .ray_join import join
        try:
            join(address)  # fails in seconds when nothing answers there (ray.init alone retries for minutes)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise WeightSyncError(f"sync_mode=fleet: cannot join the Ray cluster at sync_server={address!r}: {exc}") \
                from None
    try:
        return ray, ray.get_actor(FLEET_WEIGHTS_ACTOR, namespace=FLEET_NAMESPACE)
    except ValueError:
        raise WeightSyncError(f"no polar-rollout fleet is running on the Ray cluster {address!r} (no actor "
                              f"{FLEET_WEIGHTS_ACTOR!r} in namespace {FLEET_NAMESPACE!r})") from None


def fleet_sync(address: str, path: str, version: str, timeout: float = 900.0) -> dict:
    """Have every proxy of every node of the fleet hold while the server loads ``path`` as
    ``version`` once (harness_recipes/node/proxies.py coordinate). Returns the coordinator's answer;
    WeightSyncError when the sync failed."""
    ray, coord = _fleet_coordinator(address)
    ans = ray.get(coord.sync.remote(path, version), timeout=timeout)
    if ans["status"] != 200:
        raise WeightSyncError(f"the fleet's weight sync to {version!r} failed (HTTP {ans['status']}): {ans['error']}; "
                              f"the proxies serve {ans['weight_version']!r}")
    return ans


def fleet_version(address: str, timeout: float = 60.0) -> str | None:
    """The version every proxy of the fleet serves (None: they disagree or there are none)."""
    ray, coord = _fleet_coordinator(address)
    versions = {i.get("weight_version") for i in ray.get(coord.info.remote(), timeout=timeout)}
    return versions.pop() if len(versions) == 1 else None


def save_policy(model, tokenizer, out: Path) -> Path:
    """Write model (or PEFT adapter) + tokenizer to `out` atomically (temp dir, then rename)."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def share_from_rank0(version: str | None, error: str | None) -> tuple[str | None, str | None]:
    """Rank 0's (version, error) on every rank (torch.distributed broadcast; one process: unchanged)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return version, error
    box = [(version, error)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class WeightSyncCallback(TrainerCallback):
    def __init__(self, server: str, *, every_steps: int = 1, save_dir: str | Path, mode: str = "polar",
                 lora_name: str = "polar", keep: int = 2, source=None, api_key: str | None = None,
                 timeout: float = 120.0, control_secret: str | None = None):
        if mode not in MODES:
            raise ValueError(f"weight sync mode {mode!r} not in {MODES}")
        if every_steps < 1 or keep < 1:
            raise ValueError("every_steps and keep must be >= 1")
        self.server = server.rstrip("/") if mode != "fleet" else server
        self.every = every_steps
        self.save_dir = Path(save_dir)
        self.mode = mode
        self.lora_name = lora_name
        self.keep = keep
        self.source = source
        self.api_key = api_key
        self.timeout = timeout
        # the proxy's control secret (sync_mode=proxy): sent in x-polar-control, never logged
        self.control = control_headers(control_secret) if mode == "proxy" else {}
        self.secret_given = control_secret is not None
        self.syncs: list[dict] = []  # {step, dir, weight_version, seconds}

    @classmethod
    def from_config(cls, args, source=None) -> WeightSyncCallback:

        secret = sync_secret(getattr(args, "sync_secret_file", None)) if args.sync_mode == "proxy" else None
        return cls(args.sync_server, every_steps=args.sync_steps, mode=args.sync_mode, lora_name=args.lora_name,
                   keep=args.sync_keep, source=source, api_key=os.environ.get("POLAR_SYNC_API_KEY"),
                   save_dir=args.sync_dir or Path(args.output_dir) / "polar-weights", control_secret=secret)

    def initial_version(self) -> str | None:
        """The version the server serves before the first sync (None: it could not be read)."""
        if self.mode == "vllm_lora":
            return "0"  # (vLLM names no adapter versions: the callback counts syncs from 0)
        if self.mode == "fleet":
            try:
                return fleet_version(self.server, self.timeout)
            except Exception as exc:  # noqa: BLE001 - as below
                log.warning("could not read the fleet's weight version: %s", exc)
                return None
        url = self.server + (SYNC_PATH if self.mode == "proxy" else SERVE_VERSION_PATH)
        try:
            v = get_json(url, timeout=self.timeout, api_key=self.api_key, headers=self.control).get("weight_version")
        except urllib.error.HTTPError as exc:
            if self.mode == "proxy" and exc.code == 403:  # fail before the first step, not after it
                raise refused_control(f"GET {url} -> HTTP 403: {exc.read()[:300].decode(errors='replace')}",
                                      self.secret_given) from None
            log.warning("could not read the served weight version from %s: %s; rows of the initial weights "
                        "have no place in the sync history (dropped under max_policy_lag)", url, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - training can start; the lag of old rows stays unknown
            log.warning("could not read the served weight version from %s: %s; rows of the initial weights "
                        "have no place in the sync history (dropped under max_policy_lag)", url, exc)
            return None
        return None if v is None else str(v)

    # Rank 0 talks to the server; every rank's ShardSource must learn the same history, or ranks >= 1
    # could bound no lag (with max_policy_lag they would drop every group and starve). So rank 0's
    # answer (or its failure) is broadcast, and every rank applies it.
    def on_train_begin(self, args, state, control, **kwargs):
        v, refused = None, None
        if state.is_world_process_zero:
            try:
                v = self.initial_version()
            except WeightSyncError as e:  # re-raised below, after telling the other ranks
                refused = e
        v, error = share_from_rank0(v, None if refused is None else str(refused))
        if refused is not None:
            raise refused
        if error is not None:
            raise WeightSyncError(f"rank 0 cannot sync weights ({error}); every rank stops here")
        if error is None and v is not None and self.source is not None:
            self.source.set_current_version(v)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every:
            return
        version, error = None, None
        if state.is_world_process_zero:
            try:  # (sync tells rank 0's source; learning the same version again below is a no-op)
                version = self.sync(model, processing_class, state.global_step)
            except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error = e
        version, message = share_from_rank0(version, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise WeightSyncError(f"rank 0's weight sync failed ({message}); every rank stops here")
        if version is not None and self.source is not None:
            self.source.set_current_version(version)

    def sync(self, model, tokenizer, step: int) -> str | None:
        t0 = time.perf_counter()
        is_peft = hasattr(model, "peft_config")
        if self.mode == "vllm_lora" and not is_peft:
            raise WeightSyncError("sync_mode=vllm_lora needs a PEFT (LoRA) model; this one is a full model")
        if self.mode in ("polar", "proxy", "fleet") and is_peft:  # servers load plain HF directories here
            raise WeightSyncError(f"sync_mode={self.mode} with a PEFT model: merge the adapter first or use vllm_lora")
        out = save_policy(model, tokenizer, self.save_dir / f"step-{step:06d}")
        if self.mode == "proxy":
            want = out.name  # step-NNNNNN: the version every row generated by these weights carries
            try:
                _, body = post_json(f"{self.server}{SYNC_PATH}", {"path": str(out), "version": want},
                                    timeout=self.timeout, api_key=self.api_key, retries=0, headers=self.control)
            except WeightSyncError as e:
                if e.status == 403:
                    raise refused_control(str(e), self.secret_given) from None
                raise
            version = parse_reload_response(body, SYNC_PATH)
            if version != want:
                raise WeightSyncError(f"the proxy answered weight_version {version!r}, not {want!r}")
        elif self.mode == "fleet":  # server: the Ray cluster's address (auto | HOST:PORT)
            want = out.name
            version = fleet_sync(self.server, str(out), want, timeout=self.timeout)["weight_version"]
            if version != want:
                raise WeightSyncError(f"the fleet answered weight_version {version!r}, not {want!r}")
        elif self.mode == "polar":
            _, body = post_json(f"{self.server}{SERVE_RELOAD_PATH}", {"model": str(out)}, timeout=self.timeout,
                                api_key=self.api_key)
            version = parse_reload_response(body)
        else:
            post_json(f"{self.server}/v1/load_lora_adapter",
                      {"lora_name": self.lora_name, "lora_path": str(out), "load_inplace": True},
                      timeout=self.timeout, api_key=self.api_key)
            version = str(len(self.syncs) + 1)
        if self.source is not None:
            self.source.set_current_version(version)
        self.syncs.append({"step": step, "dir": str(out), "weight_version": version,
                           "seconds": time.perf_counter() - t0})
        log.info("weights of step %d synced to %s: weight_version %s", step, self.server, version)
        self._prune(keep_also=out)
        return version

    def _prune(self, keep_also: Path) -> None:
        dirs = sorted(p for p in self.save_dir.glob("step-*") if p.is_dir())
        for old in dirs[:-self.keep]:
            if old != keep_also:
                shutil.rmtree(old, ignore_errors=True)
