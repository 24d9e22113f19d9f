"""Which sampling defaults an upstream applies, asked of the server itself (no option needed in the
common case: the server and the proxy on one machine).

Both servers apply the served model's ``generation_config.json`` to the sampling fields a request
leaves unset (applied_sampling.py has the rules), and neither says so in an answer. What they do say
is which model they serve:

- vLLM 0.32: ``GET /v1/models`` -> ``data[i].root``, the path the server loaded the model from
  (``ModelCard.root``, entrypoints/openai/models/serving.py; the card whose ``id`` is the call's
  model name, else the first). Its default ``--generation-config auto`` reads that directory's
  generation_config.json (``ModelConfig.get_diff_sampling_param``: repetition/presence/frequency
  penalties, temperature, top_k, top_p, min_p).
- SGLang 0.5.23: ``GET /model_info`` (older ``/get_model_info``) -> ``model_path``
  (entrypoints/http_server.py ``model_info``). Its default ``--sampling-defaults model`` reads
  repetition_penalty, temperature, top_k, top_p, min_p (``ModelConfig.get_default_sampling_params``).

When that path is a directory on the proxy's machine, the proxy reads its generation_config.json
(applied_sampling.load_generation_config, the same reader as the option's) and, as with the option,
writes every unset field into the forwarded request with that value. So the row records the value
the server applied even if the server was started otherwise (``--generation-config vllm`` or a
directory, ``--override-generation-config``, ``--sampling-defaults openai``: none of which a stock
server reports): an explicit request value wins over every server default. What such a server's
harness sees then is the model's defaults instead of the server's; ``polar_generation_config``
(``none`` for a server that applies no model defaults) names them instead, and always wins.

When the path is not readable (a model on another machine, a hub name, a server that does not
answer), discovery cannot say: rows record the unset fields null and ``sampling_source`` says why
and names the fix (``unknown: ...``). A failure to reach the server is asked again after RETRY_S.

Sans-IO here: the answers' parsing (`model_path_of`) and `defaults_at`; the I/O edge is `discover`
(urllib, run on a worker thread).
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from addon.applied_sampling import GenerationConfigError, ModelDefaults, load_generation_config

TIMEOUT = 10.0  # seconds per discovery request
RETRY_S = 30.0  # a server that could not be asked is asked again after this
FIX = "set polar_generation_config to the served model's directory or its generation_config.json"
# where each dialect names its model's path: (route, the answer's field)
ROUTES = {"vllm": (("/v1/models", "root"),),
          "sglang": (("/model_info", "model_path"), ("/get_model_info", "model_path"))}


@dataclass(frozen=True)
class Discovery:
    """What discovery found: the defaults (None: it cannot say), and why not."""
    defaults: ModelDefaults | None
    why: str = ""  # when defaults is None: the reason and the fix (the rows' sampling_source)
    definite: bool = True  # False: the server could not be asked (asked again after RETRY_S)


def model_path_of(dialect: str, route: str, answer: Any, model: str | None) -> str | None:
    """The served model's path in one route's answer (module doc), None when it names none."""
    if route == "/v1/models":
        cards = answer.get("data") if isinstance(answer, dict) else None
        cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        card = next((c for c in cards if model is not None and c.get("id") == model), cards[0] if cards else None)
        root = card.get("root") if card is not None else None
        return root if isinstance(root, str) and root else None
    path = answer.get("model_path") if isinstance(answer, dict) else None
    return path if isinstance(path, str) and path else None


def defaults_at(path: str, how: str) -> Discovery:
    """The defaults of the model the server loaded from ``path`` (``how``: where the server said so)."""
    if not os.path.isdir(os.path.expanduser(path)):
        return Discovery(None, f"the server serves {path!r} ({how}), which is not a directory on the proxy's "
                               f"machine (a model on another machine, or a hub name), so its "
                               f"generation_config.json cannot be read: {FIX}")
    try:
        d = load_generation_config(path)
    except GenerationConfigError as exc:
        return Discovery(None, f"{exc} ({how}): {FIX}")
    return Discovery(d.with_origin(f"discovered: {how} -> {d.source}"))


def _get(url: str, headers: dict[str, str], timeout: float) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


def discover(base: str, dialect: str, model: str | None, headers: dict[str, str] | None = None,
             timeout: float = TIMEOUT) -> Discovery:
    """Blocking (run it on a worker thread): ask ``base`` (scheme://host:port plus any path prefix
    before /v1) which model it serves and read that model's sampling defaults. Never raises."""
    reasons = []
    for route, field in ROUTES.get(dialect, ROUTES["vllm"]):
        try:
            answer = _get(base + route, headers or {}, timeout)
        except urllib.error.HTTPError as exc:
            reasons.append(f"GET {route}: HTTP {exc.code}")
            if exc.code == 404:
                continue  # (SGLang before /model_info: the older route)
            return Discovery(None, f"the server's GET {route} answered HTTP {exc.code}: {FIX}")
        except Exception as exc:  # noqa: BLE001 - unreachable, not JSON: asked again later
            return Discovery(None, f"the server could not be asked which model it serves (GET {route}: "
                                   f"{type(exc).__name__}: {exc}): {FIX}", definite=False)
        path = model_path_of(dialect, route, answer, model)
        if path is None:
            return Discovery(None, f"the server's GET {route} names no model path ({field}): {FIX}")
        return defaults_at(path, f"{dialect} GET {route} {field}")
    return Discovery(None, f"the server names no model path ({'; '.join(reasons)}): {FIX}")
