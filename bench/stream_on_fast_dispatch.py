"""bench/stream_on.py plus the capture addon's fast event dispatch (addon/dispatch.py) and
nothing else: bare mitmdump as it runs under the addon, so that the benchmark can tell the
addon's own cost from what the faster dispatch saves every flow."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from addon.dispatch import FastDispatch  # noqa: E402


def responseheaders(flow):
    flow.response.stream = True


addons = [FastDispatch()]
