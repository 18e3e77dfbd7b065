"""SkyReels-V2 cases run on every rank of a gloo worker pool (module-level for the workers)."""

from __future__ import annotations

import types

from cases_models import pipeline_generate


def without_ftfy() -> None:
    """diffusers' SkyReels-V2 pipelines clean prompts with ``ftfy`` whether it is installed or not; where it is not (this
    test environment), give their modules an ``ftfy`` that leaves text as it is, as WanPipeline does without it."""
    from diffusers.pipelines.skyreels_v2 import (pipeline_skyreels_v2, pipeline_skyreels_v2_diffusion_forcing,
                                                 pipeline_skyreels_v2_diffusion_forcing_i2v,
                                                 pipeline_skyreels_v2_diffusion_forcing_v2v, pipeline_skyreels_v2_i2v)
    from diffusers.utils import is_ftfy_available

    if is_ftfy_available():
        return
    for module in (pipeline_skyreels_v2, pipeline_skyreels_v2_diffusion_forcing, pipeline_skyreels_v2_i2v,
                   pipeline_skyreels_v2_diffusion_forcing_i2v, pipeline_skyreels_v2_diffusion_forcing_v2v):
        if not hasattr(module, "ftfy"):
            module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)


def skyreels_generate(path: str, config: dict, **kwargs):
    """:func:`cases_models.pipeline_generate` of a SkyReels-V2 pipeline folder."""
    without_ftfy()
    return pipeline_generate(path, config, **kwargs)


def skyreels_pp_run(path: str, config: dict, **kwargs):
    """:func:`cases_pipefusion.pipeline_run` of a SkyReels-V2 pipeline folder."""
    from cases_pipefusion import pipeline_run

    without_ftfy()
    return pipeline_run(path, config, **kwargs)
