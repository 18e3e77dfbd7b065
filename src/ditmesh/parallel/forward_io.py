"""What every ditmesh forward hook on a transformer needs: named inputs, and the output's sample tensor.

Pipelines call transformers with keyword arguments and ``return_dict=False`` (a tuple) or ``True`` (an
output object with ``.sample``); these helpers let hooks treat both the same way.
"""

from __future__ import annotations

import inspect


def bind_kwargs(forward, args: tuple, kwargs: dict) -> dict:
    """All forward inputs by name (positional ``args`` bound to ``forward``'s parameter names)."""
    if not args:
        return kwargs
    return dict(inspect.signature(forward).bind_partial(*args, **kwargs).arguments)


def output_sample(output):
    """The sample tensor of a transformer output (tuple or ``.sample`` object)."""
    return output[0] if isinstance(output, tuple) else output.sample


def with_output_sample(output, sample):
    """``output`` with its sample tensor replaced by ``sample`` (same container kind)."""
    if isinstance(output, tuple):
        return (sample,) + tuple(output[1:])
    output.sample = sample
    return output
