"""``ditmesh bench``: per-step latency, memory and accuracy of parallel configurations, side by side.

- ``cli``: the options and the run (every configuration launched in its own local processes)
- ``worker``: one rank of one configuration
- ``peers``: the peers' drivers (diffusers' context parallelism, xDiT), imported by workers alone
- ``report``: the results schema, where runs are written, the Markdown table and the plot

The library never imports this package; ``ditmesh.cli`` does, for the ``bench`` command.
"""

from .cli import GPU_METHODS, METHODS, PEERS, add_bench_parser, run_bench

__all__ = ["add_bench_parser", "run_bench", "METHODS", "PEERS", "GPU_METHODS"]
