"""The benchmark's peers: diffusers' own context parallelism and xDiT, driven on our weights and inputs.

Peer drivers are the one place outside ``ditmesh.models`` that names model classes: each peer supports what
it supports (xDiT's wrapper exists for FLUX only). The library never imports this module; ``ditmesh bench``
workers do, for ``diffusers-*`` and ``xdit-*`` rows.
"""

from __future__ import annotations

import torch


def enable_diffusers(model, method: str, degrees: dict) -> None:
    from diffusers import ContextParallelConfig

    if degrees.get("ring", 1) > 1:
        model.set_attention_backend("_native_cudnn")  # diffusers' ring needs an LSE-returning backend
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degrees.get("ulysses", 1) or None,
                                                          ring_degree=degrees.get("ring", 1) or None))


def enable_torchao_fp8(model) -> None:
    """diffusers with torchao's fp8 recipe, as flux-fast applies it (without its FA3 attention): every ``nn.Linear``
    of the transformer in fp8 with dynamic per-row scales of activations and weights
    (``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``). The worker then compiles the blocks as it
    compiles every peer's (regional compile). torchao is imported here only: without it the row records the error."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))


def enable_xdit(model, config: dict, spec: dict, text_len: int):
    """xDiT (xfuser 0.7) as a peer, driven as in shared/ANCHORS.md: its FLUX wrapper on our weights.

    Returns the wrapper, to be called instead of ``model``: it takes full-length inputs, splits them over
    the ranks itself and all-gathers the full-length output. It is built on the meta device from the same
    ``config`` and takes ``model``'s tensors (``assign=True``), so the weights are not held twice. xfuser is
    imported here only: without it (or on a machine it does not support) the row records the error.
    """
    if type(model).__name__ != "FluxTransformer2DModel":
        raise NotImplementedError(f"xdit rows exist for FLUX only, not {type(model).__name__}")
    from xfuser import xFuserArgs
    from xfuser.core.distributed import get_runtime_state, init_distributed_environment, initialize_runtime_state
    from xfuser.model_executor.models.transformers.transformer_flux import xFuserFlux1Transformer2DWrapper

    degrees = spec["degrees"]
    init_distributed_environment()  # takes over the process group that is already up
    engine_config, _ = xFuserArgs(model="synthetic", ulysses_degree=degrees.get("ulysses", 1),
                                  ring_degree=degrees.get("ring", 1)).create_config()
    with torch.device("meta"):
        wrapper = xFuserFlux1Transformer2DWrapper(**config)
    wrapper.load_state_dict(model.state_dict(), strict=True, assign=True)
    wrapper.eval()

    class FluxStub:  # what initialize_runtime_state reads of a pipeline (a "Flux" class name doubles the factor)
        transformer = wrapper
        vae_scale_factor = 8

    initialize_runtime_state(FluxStub(), engine_config)
    get_runtime_state().set_input_parameters(height=spec["height"], width=spec["width"], batch_size=spec.get("batch", 1),
                                             num_inference_steps=28, max_condition_sequence_length=text_len,
                                             split_text_embed_in_sp=True)
    if spec["compile"] and degrees.get("ring", 1) > 1:
        # xDiT's ring attention checks torch's version on every call; compiled, torch 2.11's Dynamo fails inside
        # packaging.version ("'UserDefinedExceptionObjectVariable' object has no attribute 'call_setattr'").
        # Answer that check before tracing; the attention itself is untouched.
        from xfuser.model_executor.layers import usp

        check, known = usp.version_at_least, {(torch.__version__, "2.6.0"): usp.version_at_least(torch.__version__, "2.6.0")}

        def answered(installed: str, floor: str) -> bool:
            return known[(installed, floor)] if (installed, floor) in known else check(installed, floor)

        usp.version_at_least = answered
    return wrapper
