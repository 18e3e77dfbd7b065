"""``ditmesh serve``: a warm pipeline behind HTTP.

``cli`` (the command, checks before anything loads) → ``app`` (routes, queue, dispatchers, metrics, the page)
→ ``replica`` (a group of rank processes, watched and restarted) → ``worker`` (one rank: load, parallelize,
warm up, run requests). ``requests`` checks what a request may ask for. A tool: the core never imports it.
"""

from .cli import add_serve_parser, run_serve

__all__ = ["add_serve_parser", "run_serve"]
