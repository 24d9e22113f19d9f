"""bench/stream_on.py plus the capture addon's fast event dispatch (addon/mitmproxy_patches.py) and
nothing else: bare mitmdump as it runs under the addon, so that the benchmark can tell the
addon's own cost from what the faster dispatch saves every flow."""
from addon.mitmproxy_patches import FastDispatch


def responseheaders(flow):
    flow.response.stream = True


addons = [FastDispatch()]
