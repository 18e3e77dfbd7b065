"""The planner's entry points (:func:`plan`, :func:`recommend`, :class:`PlanResult`), imported by ``ditmesh.planner``
on first use (the package itself imports nothing heavy, so ``ditmesh plan``'s parser and its refusals stay fast)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..config import AXIS_ORDER, ParallelConfig
from .closed_forms import ring_attention_cost, tensor_parallel_cost, ulysses_attention_cost
from .cost import Calibration, Hardware, Prediction, Workload, enumerate_configs, predict, rank, spearman
from .hardware import DEVICES, LINKS, get_device, get_link
from .stats import ModelStats, PlannerError, model_stats, resolve_model
from .vae import VaeDecode, vae_decode

__all__ = [
    "ring_attention_cost", "ulysses_attention_cost", "tensor_parallel_cost", "plan", "recommend",
    "recommend_prediction", "PlanResult",
    "PlannerError", "model_stats", "resolve_model", "predict", "enumerate_configs", "Hardware", "Workload",
    "Calibration", "DEVICES", "LINKS", "spearman",
]



@dataclass
class PlanResult:
    """Ranked predictions for every valid configuration, and the recommendation."""

    stats: ModelStats
    hardware: Hardware
    workload: Workload
    predictions: list[Prediction]  # ranked, best first
    baseline: Prediction  # one GPU, everything off
    vae: VaeDecode | None = None
    #: what the model's family refuses (``options.RunOptions.check_family``, a missing tensor plan), each reason once,
    #: with the configurations it left out of the ranking
    refused: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def reason(self) -> str:
        """One sentence on why the recommendation wins."""
        best, hw = self.best, self.hardware
        gib = hw.usable_gib
        if best.fits == "no":
            return (f"no configuration fits in {gib:.1f} GiB per GPU, even with weights offloaded; "
                    f"{best.describe()} comes closest at {best.memory['total']:.1f} GiB")
        faster = [p for p in self.predictions if p.step_ms < best.step_ms and p.fits != "yes"]
        comm = best.comm_bytes["total"] / 1e6
        head = (f"{best.describe()} is predicted fastest at {best.effective_ms:.1f} ms/step "
                f"({best.speedup:.2f}x one GPU{', which must offload' if self.baseline.fits != 'yes' else ''}) in {best.memory['total']:.1f} of {gib:.1f} GiB per GPU")
        if best.fits == "offload":
            return head + ", streaming the weights that do not fit from host memory every step"
        if faster:
            f = min(faster, key=lambda p: p.step_ms)
            return (head + f"; {f.describe()} would compute faster ({f.step_ms:.1f} ms) but needs "
                    f"{f.memory['total']:.1f} GiB per GPU")
        if best.config.world_size == 1:
            return head
        link = hw.intra.name
        return head + (f", moving {comm:.0f} MB per GPU per step over {link} "
                       f"({best.comm_ms:.1f} ms of it not hidden behind compute)")

    def largest(self, prediction: Prediction | None = None) -> dict:
        """About the largest size ``prediction`` (default: the recommendation) holds: the square picture (sides in
        multiples of 64) or, for a video, the frame count at this size (the family's 4k+1), with the memory of
        the transformer step and of the VAE decode there. Activations and the decode grow in proportion to the
        tokens (pixels x latent frames; the attention runs without a score matrix), the weights stay: the size
        is the requested one scaled to the memory left; the requested size itself is predicted from its trace."""
        p = prediction or self.best
        cal_reserve = Calibration().reserve_gib
        room = self.hardware.usable_gib - cal_reserve
        fixed_step = p.memory["weights"]
        grow_step = p.memory["total"] - fixed_step
        fixed_decode = fixed_step + (self.vae.weight_bytes / 2**30 if self.vae else 0.0)
        grow_decode = p.memory.get("decode", fixed_decode) - fixed_decode
        ratios = [(room - fixed) / grow for fixed, grow in ((fixed_step, grow_step), (fixed_decode, grow_decode))
                  if grow > 0]
        ratio = max(0.0, min(ratios)) if ratios else float("inf")
        s = self.stats
        out = {"config": p.describe()}
        if s.frames > 1:
            latent = (s.frames - 1) // 4 + 1
            frames = 4 * int(latent * ratio - 1) + 1 if ratio != float("inf") else None
            out.update(height=s.height, width=s.width, frames=frames if frames and frames > 0 else 0)
        else:
            side = int((s.height * s.width * ratio) ** 0.5) // 64 * 64 if ratio != float("inf") else None
            out.update(height=side, width=side, frames=1)
        out.update(step_gib=round(fixed_step + grow_step * min(ratio, 1e9), 1) if ratios else None,
                   decode_gib=round(fixed_decode + grow_decode * min(ratio, 1e9), 1) if ratios else None)
        return out

    def as_dict(self) -> dict:
        return {
            "model": self.stats.summary(),
            "hardware": {"device": self.hardware.device.name, "link": self.hardware.intra.name,
                         "inter_link": self.hardware.inter.name if self.hardware.inter else None,
                         "gpus": self.hardware.gpus, "nodes": self.hardware.nodes,
                         "memory_gib": self.hardware.usable_gib, "matmul_tflops": self.hardware.device.matmul_tflops},
            "workload": {"height": self.stats.height, "width": self.stats.width, "frames": self.stats.frames,
                         "batch": self.workload.batch, "cfg": self.workload.cfg_on, "mode": self.workload.mode,
                         "cuda_graph": self.workload.cuda_graph},
            "recommendation": {"config": self.best.describe(), "degrees": self.best.config.as_dict(),
                               "displaced": self.best.displaced,
                               "reason": self.reason(), "largest": self.largest()},
            "vae": None if self.vae is None else {"class": self.vae.class_name, "mode": self.workload.vae_parallel,
                                                  "vae_chunk": self.workload.vae_chunk},
            "baseline_step_ms": round(self.baseline.step_ms, 2),
            "configs": [p.as_dict() for p in self.predictions],
            "refused": self.refused,
        }


def build_hardware(gpus: int, device: str | None = None, link: str | None = None, nodes: int = 1,
                   inter_link: str | None = None, memory_gib: float | None = None, link_gbps: float | None = None,
                   link_latency_us: float | None = None, tflops: float | None = None) -> Hardware:
    """A :class:`Hardware` from preset names and optional numbers; the device defaults to the link's card."""
    if not isinstance(gpus, int) or gpus < 1:
        raise PlannerError(f"gpus={gpus!r} must be a positive integer such as 1, 2, 4 or 8")
    if not isinstance(nodes, int) or nodes < 1 or gpus % nodes:
        raise PlannerError(f"nodes={nodes!r} must be a positive divisor of gpus={gpus}")
    if device is None:
        suffix = (link or "").split("-", 1)[-1]
        device = suffix if link and link.startswith("nvlink-") and suffix in DEVICES else "h100"
    try:
        dev = get_device(device, matmul_tflops=tflops)
        intra = get_link(link or dev.default_link, link_gbps, link_latency_us)
        inter = get_link(inter_link) if inter_link else (get_link("infiniband-ndr") if nodes > 1 else None)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None
    if memory_gib is not None and memory_gib <= 0:
        raise PlannerError(f"memory_gib={memory_gib} must be positive (GiB per GPU, e.g. 16 or 80)")
    for name, value, example in (("link_gbps", link_gbps, "e.g. 450 for NVLink, 25 for PCIe 4"),
                                 ("link_latency_us", link_latency_us, "e.g. 5"), ("tflops", tflops, "e.g. 790 for H200 bf16")):
        if value is not None and value <= 0:
            raise PlannerError(f"{name}={value} must be positive ({example})")
    return Hardware(dev, intra, inter, gpus_per_node=gpus // nodes, nodes=nodes, memory_gib=memory_gib)


def plan(model: str, height: int, width: int, gpus: int, *, frames: int = 1, batch: int = 1, cfg: bool = False,
         device: str | None = None, link: str | None = None, nodes: int = 1, inter_link: str | None = None,
         memory_gib: float | None = None, link_gbps: float | None = None, link_latency_us: float | None = None,
         tflops: float | None = None, mode: str = "compiled", steps: int = 28, supported: set[str] | None = None,
         calibration: Calibration | None = None, cuda_graph: bool = False, chunk: int | None = None,
         vae_parallel: str = "auto", vae_chunk: int | None = None, displaced: bool = False,
         pp_patches: int | None = None, options=None) -> PlanResult:
    """Predict every valid configuration of ``gpus`` GPUs for ``model`` at ``height`` x ``width`` and rank them.

    ``supported`` restricts the search to configurations whose active axes are all in the set (``generate --plan
    auto`` leaves pp out unless stale modes are allowed). ``cuda_graph``: every transformer call
    replays from a CUDA graph (no host time), which rules out dp and cfg (``parallel.graph``) and pp (PipeFusion
    refuses graphs). ``chunk``,
    ``vae_parallel`` and ``vae_chunk``: the run's ``parallelize`` settings of those names, whose memory is counted
    (the transformer traced with its pieces; the VAE decode in that mode, :mod:`.vae`). ``displaced``: also predict
    displaced attention (stale K/V, approximate) on every configuration it runs on (ulysses > 1 without ring or pp;
    with CUDA graphs, two sets of its K/V buffers). ``pp_patches``: the patches PipeFusion cuts the image into
    (``parallelize(pp_patches=...)``; None: the runtime's default, ``pp``); pp configurations with more stages than
    patches are left out. ``options``: a :class:`~ditmesh.options.RunOptions` whose settings replace ``mode``
    (compile), ``cuda_graph``, ``chunk``, ``vae_parallel``, ``vae_chunk`` and ``pp_patches`` (``"auto"`` pieces are
    sized at run time and counted whole); each prediction's :meth:`Prediction.options` writes one back.
    """
    if options is not None:
        mode, cuda_graph, vae_parallel, pp_patches = ("compiled" if options.compile else "eager", options.cuda_graph,
                                                      options.vae_parallel, options.pp_patches)
        chunk, vae_chunk = (None if v == "auto" else v for v in (options.chunk_tokens, options.vae_chunk))
    if mode not in ("compiled", "eager"):
        raise PlannerError(f"mode={mode!r} is not known; use 'compiled' or 'eager'")
    if not isinstance(batch, int) or batch < 1:
        raise PlannerError(f"batch={batch!r} must be a positive integer")
    for name, value in (("frames", frames), ("steps", steps)):
        if not isinstance(value, int) or value < 1:
            raise PlannerError(f"{name}={value!r} must be a positive integer")
    if supported is not None:
        unknown = set(supported) - set(AXIS_ORDER)
        if unknown:
            raise PlannerError(f"unknown axes {sorted(unknown)} in supported; known: {', '.join(AXIS_ORDER)}")
    if pp_patches is not None and (not isinstance(pp_patches, int) or pp_patches < 2):
        raise PlannerError(f"pp_patches={pp_patches!r} must be an integer >= 2 (at least the pp degree)")
    for name, value in (("chunk", chunk), ("vae_chunk", vae_chunk)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise PlannerError(f"{name}={value!r} must be a positive integer (tokens for chunk, rows for vae_chunk)")
    if vae_parallel not in ("auto", "on", "tiled", "off"):
        raise PlannerError(f"vae_parallel={vae_parallel!r} is not a mode; use auto, on, tiled or off")
    hw = build_hardware(gpus, device, link, nodes, inter_link, memory_gib, link_gbps, link_latency_us, tflops)
    spec = resolve_model(model)
    stats = model_stats(spec, height, width, frames)
    if chunk:  # the pieces change the activation peak; time and traffic come from the whole trace
        pieces = model_stats(spec, height, width, frames, 1, chunk)
        stats = dataclasses.replace(stats, act_peak_bytes=pieces.act_peak_bytes,
                                    act_peak_sharded_bytes=pieces.act_peak_sharded_bytes)
    vae = vae_decode(spec, height, width, frames, batch, vae_chunk)
    workload = Workload(batch=batch, cfg_on=cfg, steps=steps, mode=mode, cuda_graph=cuda_graph,
                        vae_parallel=vae_parallel, vae_chunk=vae_chunk, pp_patches=pp_patches)
    cal = calibration or Calibration()
    configs = enumerate_configs(gpus, stats, workload)
    refused: dict[str, list[str]] = {}
    configs = [c for c in configs if not _refused(spec.transformer_class, c, refused)]
    if supported is not None:
        configs = [c for c in configs if set(c.active_axes()) <= set(supported)]
    if cuda_graph:  # the batch hooks decide per call what runs, which a graph cannot replay; PipeFusion refuses graphs
        configs = [c for c in configs if c.dp == 1 and c.cfg == 1 and c.pp == 1]
    eight_bit = options is not None and options.attention != "default"
    if eight_bit:  # an 8-bit attention runs on one process or under ulysses (and tp) alone: options.validate
        configs = [c for c in configs if c.ring == 1 and c.pp == 1]
        displaced = False
    if not configs:
        raise PlannerError(f"no valid configuration of {gpus} GPUs for {model}"
                           + (f" using only {sorted(supported)}" if supported is not None else "")
                           + (" without dp/cfg (CUDA graphs)" if cuda_graph else "")
                           + (f" that its family runs ({'; '.join(refused)})" if refused else "")
                           + "; try a GPU count that divides the attention heads")
    single_hw = Hardware(hw.device, hw.intra, None, 1, 1, hw.memory_gib)
    baseline = predict(ParallelConfig(), stats, single_hw, workload, cal, vae)
    predictions = [predict(c, stats, hw, workload, cal, vae) for c in configs]
    if displaced:
        predictions += [predict(c, stats, hw, workload, cal, vae, displaced=True) for c in configs
                        if c.ulysses > 1 and c.ring == 1 and c.pp == 1
                        and not _refused(spec.transformer_class, c, refused, displaced=True)]
    if options is not None and options.quant != "off":  # the quantized rows beside the model's dtype
        eight = dataclasses.replace(workload, quant=options.quant, quant_modulation=options.quantized_modulation)
        for p in [predict(c, stats, hw, eight, cal, vae) for c in configs]:
            p.quant = options.quant
            predictions.append(p)
    if options is not None and options.attention == "fp8":  # its rows beside the exact attention's
        rows = dataclasses.replace(workload, attention="fp8")
        for quant in ["off"] + ([options.quant] if options.quant != "off" else []):
            eight = dataclasses.replace(rows, quant=quant, quant_modulation=options.quantized_modulation)
            for p in [predict(c, stats, hw, eight, cal, vae) for c in configs]:
                p.quant, p.attention = quant, "fp8"
                predictions.append(p)
    for p in predictions:
        p.speedup = baseline.effective_ms / p.effective_ms
    return PlanResult(stats, hw, workload, rank(predictions), baseline, vae, refused)


def _refused(class_name: str, config: ParallelConfig, refused: dict[str, list[str]], displaced: bool = False) -> bool:
    """Whether the family of ``class_name`` refuses ``config`` before any weight is read (as ``generate`` would:
    ``RunOptions.check_family``, and tp without a tensor-parallel plan); the reason and the configuration are added
    to ``refused``."""
    from ..options import ConfigError, RunOptions
    from .stats import adapter_of

    adapter = adapter_of(class_name)
    why = None
    if config.tp > 1 and adapter.tensor_plan is None:
        why = f"tp > 1: {class_name} has no tensor-parallel plan"
    else:
        try:
            RunOptions(config=config, displaced=displaced).check_family(adapter)
        except (ConfigError, NotImplementedError) as exc:
            why = re.sub(r"^ring=\d+ ", "ring > 1 ", str(exc))  # one reason for every ring degree
    if why:
        refused.setdefault(why, []).append(config.describe() + (" displaced" if displaced else ""))
    return why is not None


def recommend(model: str, height: int, width: int, gpus: int, **kwargs) -> ParallelConfig:
    """The degrees of :func:`recommend_prediction` (see there)."""
    return recommend_prediction(model, height, width, gpus, **kwargs).config


def recommend_prediction(model: str, height: int, width: int, gpus: int, *, supported: set[str] | None = None,
                         require_fit: bool = False, **kwargs) -> Prediction:
    """The prediction of the configuration ``ditmesh generate --plan auto`` should run (see :func:`plan` for the
    arguments; its ``displaced`` says whether to run it with displaced attention): the best ranked one.
    ``require_fit``: only one predicted to fit in memory, step and VAE decode alike (the runtime does not offload
    weights); PlannerError naming the closest one and the largest size it holds otherwise."""
    result = plan(model, height, width, gpus, supported=supported, **kwargs)
    best = result.predictions[0]
    if require_fit and best.fits != "yes":
        big = result.largest(best)
        size = (f"{big['height']}x{big['width']}" + (f"x{big['frames']}f" if big["frames"] > 1 else "")
                if big["height"] else "nothing")
        raise PlannerError(
            f"no configuration of {gpus} GPU(s) fits {height}x{width}" + (f"x{kwargs.get('frames')}f" if
                                                                          kwargs.get("frames", 1) > 1 else "")
            + f" in {result.hardware.usable_gib:.0f} GiB per GPU: {best.config.describe()} needs "
            f"{best.memory['total']:.1f} GiB for a step and {best.memory.get('decode', 0):.1f} GiB for the VAE decode; "
            f"it holds about {size}; use more GPUs, a smaller size, --chunk, or --vae-chunk / --vae-parallel tiled")
    return best
