"""A do-nothing mitmproxy addon that only turns response streaming on: the fair baseline for the
capture addon (mitmdump buffers text/event-stream answers unless an addon streams them)."""


def responseheaders(flow):
    flow.response.stream = True
