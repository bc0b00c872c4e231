"""Where a panel's run prints: what a panel's thread writes or displays goes to that panel's Output widget.

An Output widget used as a context manager tags output with the kernel message
being handled; a run that outlives its click has none, and its output is lost
(measured in JupyterLab 4.6). So ``routed_to(output)`` wraps the kernel's
stdout/stderr and display publisher once, and sends the calls of the thread
inside it to ``output.outputs`` (which works from any thread); every other
thread's output is untouched. Used by ``helpers.widgets``.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import ipywidgets as w


_routes: dict[int, w.Output] = {}  # panel thread → the Output widget that receives what it prints or displays


def _append(output: w.Output, item: dict) -> None:
    last = output.outputs[-1] if output.outputs else None
    if item["output_type"] == "stream" and last and last["output_type"] == "stream" and last["name"] == item["name"]:
        item = {**last, "text": last["text"] + item["text"]}  # one block of text, not one per write
        output.outputs = output.outputs[:-1]
    output.outputs = output.outputs + (item,)


def _routed(original, deliver):
    """``original`` for every thread but a panel's, whose calls go to ``deliver(its Output, ...)``."""
    def call(*args, **kwargs):
        out = _routes.get(threading.get_ident())
        return original(*args, **kwargs) if out is None else deliver(out, *args, **kwargs)
    return call


def _install_routes(shell, streams) -> None:
    """Send what a panel's thread prints or displays to its Output widget; other threads' output is untouched.

    An Output widget used as a context manager tags output with the message being
    handled; a run that outlives its click has none, and its output is lost
    (measured in JupyterLab 4.6). Writing into ``outputs`` works from any thread.
    """
    for name, stream in streams:
        if not hasattr(stream, "_panel_routes"):
            stream.write = _routed(stream.write, lambda out, text, _name=name: _append(
                out, {"output_type": "stream", "name": _name, "text": text}) or len(text))
            stream._panel_routes = True
    pub = shell.display_pub
    if not hasattr(pub, "_panel_routes"):
        pub.publish = _routed(pub.publish, lambda out, data, metadata=None, *_, **__: _append(
            out, {"output_type": "display_data", "data": data, "metadata": metadata or {}}))
        pub.clear_output = _routed(pub.clear_output, lambda out, *_, **__: setattr(out, "outputs", ()))
        pub._panel_routes = True


@contextlib.contextmanager
def routed_to(output: w.Output):
    """Inside this block, what the current thread prints or displays goes to ``output``."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or not hasattr(shell, "display_pub"):  # no kernel (unit tests): nothing to route
        yield
        return
    _install_routes(shell, (("stdout", sys.stdout), ("stderr", sys.stderr)))
    _routes[threading.get_ident()] = output
    try:
        yield
    finally:
        _routes.pop(threading.get_ident(), None)
