"""Polar capture addon: ``mitmdump -s "$(python -m addon)" --set polar_logdir=DIR`` (from a checkout
``mitmdump -s addon/polar_addon.py``; the project must be installed in mitmdump's Python).

The script users pass to mitmdump: it composes one small addon per concern, as mitmproxy's own
addons are (options with their help in ``load``, validated in ``configure``), sharing one
proxy_state.ProxyState. mitmproxy calls them in this order for every request:

- access.Access: what the request is and whether it may pass (the control secret, the episode's
  capability, the model-API allowlist, body bounds); refusals answered and logged to refused.jsonl;
- control_plane.ControlPlane: ``POST /polar/<id>/end``;
- weight_sync.WeightSync: ``/polar/@weights``, ``/hold``, ``/release``;
- model_calls.ModelCalls: the model calls, recorded into their episode's log (what each upstream
  server is: upstream.Upstreams, in the shared state);
- mitmproxy_patches.Tuning and FastDispatch: changes to mitmproxy itself.

Security: with ``polar_control_secret_file`` set, only a holder of the secret can end episodes or
sync weights, and model calls must name their episode by capability (docs/security.md). Without
it the control plane is open (a warning says so at start).
"""
from __future__ import annotations

try:
    import addon  # noqa: F401
except ImportError as exc:  # loaded by path (mitmdump -s) in a Python where the project is not installed
    raise ImportError(
        f"polar: the capture addon's package (`addon`) is not installed in the Python that runs mitmdump "
        f"({exc}). Install the project into mitmdump's environment, e.g. `pip install -e <polar checkout>` "
        f"with that environment's pip, then run `mitmdump -s $(python -m addon) ...`.") from exc

from addon.access import Access
from addon.control_plane import ControlPlane
from addon.mitmproxy_patches import FastDispatch, Tuning
from addon.model_calls import ModelCalls
from addon.proxy_state import ProxyState
from addon.weight_sync import WeightSync


def make_addons() -> list:
    """A fresh set of the proxy's addons around one shared state."""
    state = ProxyState()
    access = Access(state)
    return [access, ControlPlane(state, access), WeightSync(state, access), ModelCalls(state), Tuning(), FastDispatch()]


addons = make_addons()
