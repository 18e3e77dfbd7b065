"""Enumerate parallel configurations and predict memory, communication and latency for each.

The prediction for one configuration on one GPU of the mesh:

* compute: every GEMM the trace recorded, scaled to the GPU's share (1/sp of the tokens, 1/tp of a
  sharded linear, its pp stage's blocks, its share of the batch), timed at the device's matrix rate times an
  efficiency that falls for small GEMMs; attention the same at a lower efficiency; memory-bound ops by
  their traffic over HBM (compiled graphs fuse most of it away); plus a fixed cost per kernel; PipeFusion as a
  pipeline of its stages over its patches, filled and drained every call (docs/planner.md section 4);
* communication: the closed forms of :mod:`.closed_forms` per attention call (Ulysses all-to-alls, ring
  K/V passes) and per row-parallel linear (TP all-reduces), over the link level the axis spans;
  ring passes hide behind the attention of the previous chunk, the others are exposed;
* memory: weights after sharding + the traced activation peak, scaled + attention and comm buffers; and, apart
  from the step (the decode runs after it, the transformer's weights still in place), the VAE decode in the mode
  the runtime would run (:mod:`.vae`). A configuration fits when the larger of the two does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..attention.fp8 import MIN_KEYS as FP8_MIN_KEYS
from ..comm import split_sizes
from ..config import AXIS_ORDER, PP_CHUNK_BYTES, ParallelConfig
from ..options import quant_layer_mode
from ..parallel.pipefusion import split_stages
from .hardware import Device, Link
from .stats import ModelStats, adapter_of
from .vae import VaeDecode

GIB = 2**30


@dataclass(frozen=True)
class Calibration:
    """Constants of the cost model. The kernel-rate and launch constants were fitted to the FLUX-dev rows of
    ANCHORS.md (peers' implementations, 4x H200) and left unchanged by a refit to ditmesh's own bench rows;
    ``ring_attention_efficiency`` is fitted to ditmesh's own rows (``calibrate.fit``). See docs/planner.md
    section 6 and ``ditmesh plan --validate``."""

    gemm_half_flops: float = 2.0e10  # a GEMM of this many FLOPs runs at half the large-GEMM rate
    attention_efficiency: float = 0.70  # fused SDPA (flash/cuDNN) vs the matrix rate
    # ring attention calls the LSE-returning flash kernel (aten._scaled_dot_product_flash_attention) once per
    # ring round: slower per FLOP than the SDPA backend the unsplit and Ulysses attention dispatch to. Fitted
    # to our rows: only usp4 at 2048² is GPU-bound enough to show it (1024² ring rows are launch-bound)
    ring_attention_efficiency: float = 0.40
    # ``attention="fp8"``: cuDNN's fp8 kernel with its quantization against the exact kernel, measured on one H200
    # (docs/quantization.md): 38.3-39.6 / 29.9 ms at Wan 480p on one GPU, 9.76 / 7.46 ms on a ulysses-4 rank's heads;
    # calls with fewer keys than attention.fp8.MIN_KEYS attend exactly
    fp8_attention_speedup: float = 1.3
    hbm_efficiency: float = 0.85
    fused_traffic: dict = field(default_factory=lambda: {"compiled": 0.20, "eager": 1.0})
    kernel_us: dict = field(default_factory=lambda: {"compiled": 1.5, "eager": 2.0})  # GPU-side cost per kernel
    # host (Python + launch) time per traced op: eager runs are launch-bound once the GPU share is small;
    # compiled blocks launch a few fused kernels per block
    host_us_per_op: dict = field(default_factory=lambda: {"compiled": 1.5, "eager": 16.0})
    collective_host_us: dict = field(default_factory=lambda: {"compiled": 10.0, "eager": 60.0})
    # a CUDA graph replays the whole call: the host launches nothing per kernel, and the gaps between kernels
    # shrink. Fitted to ditmesh's 1-GPU compiled + graph row at 1024^2; the other graph rows
    # are held out (docs/planner.md section 6)
    graph_kernel_us: float = 0.3
    # host ops one ring round adds (src/ditmesh/attention/ring.py: 2 receive buffers, the p2p batch, the
    # LSE attention call with its transposes and LSE normalisation, the fp32 log-sum-exp merge, the wait)
    ring_round_ops: int = 22
    reserve_gib: float = 1.0  # CUDA context, NCCL buffers and allocator slack, outside torch's peak


@dataclass(frozen=True)
class Hardware:
    """The machine: one device kind, the link inside a node and (for several nodes) between nodes."""

    device: Device
    intra: Link
    inter: Link | None = None
    gpus_per_node: int = 1
    nodes: int = 1
    memory_gib: float | None = None  # overrides the device's memory

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_gib(self) -> float:
        return self.memory_gib if self.memory_gib is not None else self.device.memory_gib


@dataclass(frozen=True)
class Workload:
    """What is generated: resolution is in the stats; here the batch, CFG and the number of steps."""

    batch: int = 1
    cfg_on: bool = False
    steps: int = 28
    mode: str = "compiled"  # or "eager"
    #: each transformer call replayed from a CUDA graph (``parallelize(cuda_graph=True)``): no host time
    cuda_graph: bool = False
    #: how the VAE decodes (``parallelize(vae_parallel=...)``): auto/on split over the ranks, tiled, off (whole)
    vae_parallel: str = "auto"
    #: ``parallelize(vae_chunk=...)`` rows, or None: a decode that runs whole runs in pieces
    vae_chunk: int | None = None
    #: ``parallelize(pp_patches=...)``: the patches PipeFusion cuts the image into (None: the runtime's default, pp)
    pp_patches: int | None = None
    #: ``parallelize(quant=..., quant_modulation=...)``: the block linears in 8 bits
    quant: str = "off"
    quant_modulation: bool = True
    #: ``parallelize(attention=...)``: ``fp8`` counts its self-attention calls of at least ``MIN_KEYS`` keys faster
    attention: str = "default"

    def vae_mode(self, world: int) -> str:
        """The :meth:`VaeDecode.peak` mode of a decode on ``world`` ranks."""
        if self.vae_parallel == "tiled":
            return "tiled"
        if self.vae_parallel in ("auto", "on") and world > 1:
            return "split"
        return "chunked" if self.vae_chunk else "whole"


@dataclass
class Prediction:
    config: ParallelConfig
    step_ms: float
    compute_ms: float
    comm_ms: float  # exposed communication
    overhead_ms: float
    memory: dict  # GiB by part, and "total"
    comm_bytes: dict  # bytes per step sent by one GPU, by collective and by link level
    fits: str  # "yes" | "offload" | "no"
    offload_step_ms: float | None = None
    speedup: float = 1.0
    gpu_ms: float = 0.0  # GPU-side time (compute + exposed comm + per-kernel cost)
    host_ms: float = 0.0  # host-side time (Python + kernel launches + collective calls)
    displaced: bool = False  # displaced attention over the ulysses axis (stale K/V; ``parallel.displaced``)
    #: PipeFusion: an exact call (warm-up: one patch, stage after stage); ``step_ms`` is a stale (pipelined) call
    exact_step_ms: float | None = None
    #: the block linears' 8-bit mode (``off``: the model's dtype)
    quant: str = "off"
    #: the attention kernel this row counts (``fp8``), or None: the run's own (``base``'s in :meth:`options`)
    attention: str | None = None

    def options(self, base=None):
        """The :class:`~ditmesh.options.RunOptions` that runs this prediction: ``base`` (default: the defaults) with
        its degrees, displaced attention, 8-bit linears and, where the row counts one, attention."""
        from ..options import RunOptions

        extra = {"attention": self.attention} if self.attention else {}
        return (base or RunOptions()).replace(config=self.config, displaced=self.displaced, quant=self.quant, **extra)

    def describe(self) -> str:
        """The configuration as the tables write it, e.g. ``ulysses4 displaced``."""
        return (self.config.describe() + (" displaced" if self.displaced else "")
                + (f" {self.quant}" if self.quant != "off" else "")
                + (f" attention {self.attention}" if self.attention else ""))

    @property
    def effective_ms(self) -> float:
        return self.offload_step_ms if self.fits == "offload" else self.step_ms

    def as_dict(self) -> dict:
        return {
            "config": self.describe(), "degrees": self.config.as_dict(), "displaced": self.displaced, "quant": self.quant,
            "attention": self.attention or "default",
            "step_ms": round(self.step_ms, 2), "compute_ms": round(self.compute_ms, 2),
            "comm_ms": round(self.comm_ms, 2), "overhead_ms": round(self.overhead_ms, 2),
            "speedup": round(self.speedup, 3), "memory_gib": {k: round(v, 3) for k, v in self.memory.items()},
            "comm_bytes": self.comm_bytes, "fits": self.fits,
            "offload_step_ms": None if self.offload_step_ms is None else round(self.offload_step_ms, 2),
            "exact_step_ms": None if self.exact_step_ms is None else round(self.exact_step_ms, 2),
        }


# ---------------------------------------------------------------------------------------------------
# enumeration
# ---------------------------------------------------------------------------------------------------
def _factorizations(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, k - 1):
                yield (d,) + rest


def invalid_reason(config: ParallelConfig, stats: ModelStats, workload: Workload) -> str | None:
    """Why ``config`` cannot run this model and workload, or None when it can."""
    if config.cfg > 1 and not workload.cfg_on:
        return "cfg=2 needs classifier-free guidance on (--cfg)"
    if workload.batch % config.dp:
        return f"dp={config.dp} does not divide the batch of {workload.batch}"
    for size in stats.tp_divisible:
        if size % config.tp:
            return f"tp={config.tp} does not divide {size} (heads or a sharded linear's width)"
    if (stats.num_heads // config.tp) % config.ulysses:
        return f"ulysses={config.ulysses} does not divide the {stats.num_heads // config.tp} heads per tensor-parallel rank"
    if config.sp > min(stats.layout.image_tokens, stats.layout.split_tokens):
        return f"ring x ulysses = {config.sp} exceeds the {stats.layout.image_tokens} image tokens"
    if config.pp > 1 and config.pp > stats.num_blocks:  # a family without block lists (Z-Image) counts none
        return f"pp={config.pp} exceeds the {stats.num_blocks} transformer blocks"
    if config.pp > 1 and workload.pp_patches is not None:
        if workload.pp_patches < config.pp:
            return f"pp={config.pp} needs at least {config.pp} patches, not pp_patches={workload.pp_patches}"
        if workload.pp_patches > stats.layout.image_tokens:
            return f"pp_patches={workload.pp_patches} exceeds the {stats.layout.image_tokens} image tokens"
    return None


def enumerate_configs(gpus: int, stats: ModelStats, workload: Workload) -> list[ParallelConfig]:
    """Every configuration of ``gpus`` processes that can run, in a stable order."""
    configs = []
    for degrees in _factorizations(gpus, len(AXIS_ORDER)):
        if degrees[AXIS_ORDER.index("cfg")] > 2:
            continue
        config = ParallelConfig(**dict(zip(AXIS_ORDER, degrees)))
        if invalid_reason(config, stats, workload) is None:
            configs.append(config)
    return configs


# ---------------------------------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------------------------------
def _axis_links(config: ParallelConfig, hw: Hardware) -> dict[str, Link]:
    """The link each axis's collectives use: the inter-node link when its group spans nodes."""
    links, stride = {}, 1
    for axis in reversed(AXIS_ORDER):  # innermost (tp) first: consecutive ranks
        degree = getattr(config, axis)
        spans = hw.nodes > 1 and stride * degree > hw.gpus_per_node
        links[axis] = (hw.inter or hw.intra) if spans else hw.intra
        stride *= degree
    return links


def _level(link: Link, hw: Hardware) -> str:
    return "inter" if hw.nodes > 1 and link is (hw.inter or hw.intra) and link is not hw.intra else "intra"


def predict(config: ParallelConfig, stats: ModelStats, hw: Hardware, workload: Workload,
            cal: Calibration = Calibration(), vae: VaeDecode | None = None, displaced: bool = False) -> Prediction:
    """Predicted step latency, memory and communication of ``config`` on ``hw``; with ``vae``, the VAE decode's
    memory too (``memory["decode"]``: the transformer's weights, the VAE's and the decode's peak). ``displaced``:
    the ulysses ranks run displaced attention (a stale step: one all-gather of K/V per self-attention layer,
    hidden behind the step's compute; the buffers of :func:`displaced_kv_bytes`)."""
    dev = hw.device
    rate = dev.matmul_tflops * 1e12
    mode = workload.mode
    samples = workload.batch * (2 if workload.cfg_on else 1) / (config.dp * config.cfg)
    tp, sp, pp = config.tp, config.sp, config.pp
    split = stats.layout.split_tokens
    token_frac = math.ceil(split / sp) / split  # uneven splits pad to the longest shard
    bpe = stats.bytes_per_element
    links = _axis_links(config, hw)
    # PipeFusion runs its stage's blocks once per patch: smaller GEMMs, and every op launched once per patch
    patches = (workload.pp_patches or pp) if pp > 1 else 1
    stages = pipefusion_stages(stats, pp)  # module-path prefixes of each stage's blocks; [None] without pp
    nonblock_ops = stats.op_count - sum(ops for _, _, ops in stats.blocks)
    ringed_rounds = config.ring > 1 and pp == 1  # under pp the ring all-gathers K/V into the stage's buffer

    def gemm_eff(flops: float) -> float:
        return flops / (flops + cal.gemm_half_flops)

    def quantized(lin) -> str | None:  # the 8-bit mode of a traced linear (``options.quant_layer_mode``)
        if workload.quant == "off" or not in_block(lin.name):
            return None
        return quant_layer_mode(lin.name, lin.in_features, lin.out_features, workload.quant, workload.quant_modulation)

    def in_block(name: str) -> bool:
        return name.startswith(stats.block_prefixes)

    def on_stage(name: str, stage) -> bool:  # stage None: every block (no pipeline)
        return stage is None or not in_block(name) or name.startswith(stage)

    def stage_ops(stage) -> float:  # traced ops of one pass of a stage (its blocks and the non-block modules)
        return stats.op_count if stage is None else nonblock_ops + sum(o for _, _, o in stage_blocks(stats, stage))

    # ---- compute -----------------------------------------------------------------------------------
    fp8_attention = workload.attention == "fp8"

    def stage_compute(stage, patches: int = patches) -> float:
        """GPU seconds of the GEMMs, attention and memory-bound traffic of one call over the whole sequence on one
        GPU of ``stage`` (its blocks and every non-block module, which each pp rank runs), cut into ``patches``."""
        gemm_s = 0.0
        for lin in stats.linears:
            if not on_stage(lin.name, stage):
                continue
            per_call = lin.flops * samples * (token_frac if lin.tokenwise else 1) / (tp if lin.tp_sharded else 1)
            per_kernel = per_call / (patches if lin.tokenwise and in_block(lin.name) else 1)
            eight = quantized(lin)
            # fp8 products run at twice the bf16 rate (Hopper, Ada) after a pass quantizing the activations (read,
            # write one byte, per row); weight-only modes read 8-bit weights and widen them every call
            gemm_s += per_call / (rate * (2 if eight == "fp8" else 1) * gemm_eff(per_kernel))
            if eight:
                weight = lin.in_features * lin.out_features / (tp if lin.tp_sharded else 1)
                act = per_call / (2 * lin.out_features) if eight == "fp8" else 0.0  # rows x in_features
                gemm_s += (weight * (1 + bpe) * (eight != "fp8") + act * (bpe + 1)) / (dev.hbm_gbps * 1e9
                                                                                      * cal.hbm_efficiency)
        attn_s = 0.0
        for att in stats.attentions:
            if not on_stage(att.name, stage):
                continue
            chunk = att.flops * samples * token_frac / tp
            ringed = att.self_attention and ringed_rounds
            per_kernel = chunk / (config.ring if ringed else 1) / patches
            eff = cal.ring_attention_efficiency if ringed else cal.attention_efficiency
            if fp8_attention and att.self_attention and att.kv_len >= FP8_MIN_KEYS:
                eff *= cal.fp8_attention_speedup
            attn_s += chunk / (rate * eff * gemm_eff(per_kernel))
        traffic = ((stats.mem_bytes_sharded / tp + stats.mem_bytes_replicated) * token_frac * samples
                   + stats.mem_bytes_fixed)
        # the traffic is not traced per module: a stage's share is its share of the traced ops
        traffic *= cal.fused_traffic[mode] * stage_ops(stage) / stats.op_count
        return gemm_s + attn_s + traffic / (dev.hbm_gbps * 1e9 * cal.hbm_efficiency)

    compute_s = stage_compute(None) if pp == 1 else 0.0
    kernels = stage_ops(None)
    # ring attention merges partial outputs with their log-sum-exp (merge_partial, in fp32): each round
    # after the first reads the running fp32 output and the bf16 block, upcasts it, weights both and adds:
    # ~10 fp32 reads/writes per output element; the first round upcasts (6 B) and the end casts back (6 B)
    if ringed_rounds:
        ring_merge = 0.0
        ring_rounds = 0
        for att in stats.attentions:
            if att.self_attention:
                elems = att.q_len * att.batch * att.heads * att.head_dim * token_frac * samples / tp
                ring_merge += ((config.ring - 1) * 40 + 12) * elems
                ring_rounds += config.ring
        compute_s += ring_merge / (dev.hbm_gbps * 1e9 * cal.hbm_efficiency)
        kernels += ring_rounds * cal.ring_round_ops

    # ---- communication -----------------------------------------------------------------------------
    by_collective: dict[str, float] = {}
    by_level: dict[str, float] = {}
    comm_s = 0.0
    calls = 0.0

    def send(kind: str, axis: str, nbytes: float, count: float = 1, exposed: float | None = None):
        nonlocal comm_s, calls
        link = links[axis]
        by_collective[kind] = by_collective.get(kind, 0) + nbytes
        level = _level(link, hw)
        by_level[level] = by_level.get(level, 0) + nbytes
        calls += count
        t = count * link.latency_us * 1e-6 + nbytes / (link.gbps * 1e9)
        comm_s += t if exposed is None else exposed

    # per layer: bytes and calls of one call on one GPU; under pp a stage's share (1/pp of the layers, the average
    # stage), each layer's collective once per patch
    per_layer = patches / pp
    gathers_s = 0.0  # displaced: the step's K/V all-gathers, which run beside its compute
    for att in stats.attentions:
        if not att.self_attention or sp == 1:
            continue
        local_tokens = math.ceil(att.q_len / sp) * att.batch * samples
        width = att.heads * att.head_dim / tp
        if displaced:  # each rank receives the other ranks' K and V chunks (padded to the longest)
            nbytes = 2 * displaced_tokens(att.q_len, stats.layout, sp) * att.batch * samples * width * bpe * (sp - 1)
            link = links["ulysses"]
            gathers_s += link.latency_us * 1e-6 + nbytes / (link.gbps * 1e9)
            send("kv_async", "ulysses", nbytes, exposed=0.0)
        elif config.ulysses > 1:
            u = config.ulysses
            send("all_to_all", "ulysses", 4 * local_tokens * width * bpe * (u - 1) / u / pp, count=2 * per_layer)
        if config.ring > 1:
            r = config.ring
            chunk_bytes = 2 * local_tokens * config.ulysses * (width / config.ulysses) * bpe  # K+V after a2a
            if pp > 1:  # PipeFusion: one all-gather of the ring ranks' K/V into the buffer, exposed
                send("all_gather", "ring", (r - 1) * chunk_bytes / pp, count=per_layer)
                continue
            step_comm = links["ring"].latency_us * 1e-6 + chunk_bytes / (links["ring"].gbps * 1e9)
            step_attn = att.flops * samples * token_frac / tp / config.ring / (rate * cal.attention_efficiency)
            exposed = (r - 1) * max(0.0, step_comm - step_attn) + links["ring"].latency_us * 1e-6
            send("ring_p2p", "ring", (r - 1) * chunk_bytes, count=r - 1, exposed=exposed)
    traffic_of = adapter_of(stats.spec.transformer_class).sequence_traffic
    if sp > 1 and traffic_of is not None:  # e.g. linear attention's key sums, a convolution's halo rows
        for kind, nbytes, count in traffic_of(stats.spec.config, stats.layout, bpe, tp):
            moved = 2 * nbytes * (sp - 1) / sp if kind == "all_reduce" else nbytes  # a ring all-reduce sends twice
            send(kind, "ring" if config.ring > 1 else "ulysses", moved * samples / pp, count=count * per_layer)
    if tp > 1:
        for lin in stats.linears:
            if lin.row_parallel:
                tensor = lin.rows * samples * (token_frac if lin.tokenwise else 1) * lin.out_features * bpe
                send("all_reduce", "tp", 2 * tensor * (tp - 1) / tp / pp, count=per_layer)
    layer_comm_s, layer_calls = comm_s, calls  # the per-layer collectives: a pipeline spreads them over its patches
    latent = math.prod(stats.layout.latent_shape)  # one sample
    if sp > 1:  # gather the model output once at the exit
        send("all_gather", "ring" if config.ring > 1 else "ulysses", latent * bpe * samples * (sp - 1) / sp)
    if config.cfg > 1:
        send("all_gather", "cfg", latent * bpe * samples)
    if pp > 1:
        # each stage passes every patch's boundary activations to the next one (pieces of at most PP_CHUNK_BYTES),
        # overlapped with the next patch's compute; the last stage broadcasts the output over the pp group
        hidden = math.ceil(split / sp) * stats.hidden_dim * bpe * samples
        sizes = pipefusion_patch_tokens(stats.layout, patches)
        patch_bytes = [hidden * n / split for n in sizes]
        p2p_calls = sum(math.ceil(b / PP_CHUNK_BYTES) for b in patch_bytes) * (2 if pp > 2 else 1)  # a middle stage: both ways
        send("pp_p2p", "pp", hidden, count=p2p_calls, exposed=0.0)
        send("broadcast", "pp", latent * bpe * samples, count=math.ceil(latent * bpe * samples / PP_CHUNK_BYTES))
    comm_s += max(0.0, gathers_s - compute_s)  # displaced: what the step's compute does not cover
    kernel_us = cal.graph_kernel_us if workload.cuda_graph else cal.kernel_us[mode]
    exact_s = None
    if pp == 1:
        gpu_s = compute_s + comm_s + kernels * kernel_us * 1e-6
        # a graph is one replay per call; otherwise the host launches every kernel and collective
        host_s = 0.0 if workload.cuda_graph else (kernels * cal.host_us_per_op[mode] + calls * cal.collective_host_us[mode]) * 1e-6
        step_s = max(gpu_s, host_s)  # the host enqueues ahead of the GPU; whichever is slower sets the pace
    else:
        # PipeFusion: each stage runs patch after patch; a patch starts on a stage when the previous stage has sent
        # it and this stage is done with the previous patch (the pipeline fills and drains every call), and ends
        # no earlier than the stage's host has launched it (eager: the stage's ops and collectives once per patch)
        link = links["pp"]
        stale_work = [stage_compute(stage) for stage in stages]
        per_patch_ops = [stage_ops(stage) for stage in stages]
        host_us, coll_us = (0.0, 0.0) if workload.cuda_graph else (cal.host_us_per_op[mode], cal.collective_host_us[mode])
        host_patch = [(ops * host_us + (layer_calls + p2p_calls) / patches * coll_us) * 1e-6 for ops in per_patch_ops]
        once_s = comm_s - layer_comm_s  # the exit's gathers and the output's broadcast, after the last patch
        host_once = (calls - layer_calls - p2p_calls) * coll_us * 1e-6

        def pipeline(fracs, with_comm=True, with_gaps=True, with_host=True, work=stale_work):
            xfer = [link.latency_us * 1e-6 + hidden * f / (link.gbps * 1e9) for f in fracs] if with_comm else [0] * len(fracs)
            finish = [[0.0] * len(fracs) for _ in stages]
            for s_, w in enumerate(work):
                for p, f in enumerate(fracs):
                    ready = max(finish[s_ - 1][p] + xfer[p] if s_ else 0.0, finish[s_][p - 1] if p else 0.0)
                    t = w * f + (layer_comm_s * f if with_comm else 0.0)  # the average stage's collectives
                    t += per_patch_ops[s_] * kernel_us * 1e-6 if with_gaps else 0.0
                    finish[s_][p] = max(ready + t, host_patch[s_] * (p + 1) if with_host else 0.0)
            return finish[-1][-1]

        fracs = [n / split for n in sizes]
        compute_s = pipeline(fracs, with_comm=False, with_gaps=False, with_host=False)
        comm_s = pipeline(fracs, with_gaps=False, with_host=False) - compute_s + once_s
        gpu_s = pipeline(fracs, with_host=False) + once_s
        step_s = pipeline(fracs) + once_s  # the host's few calls after the last patch overlap the GPU's
        host_s = sum(host_patch) / len(host_patch) * patches + host_once
        exact_s = pipeline([1.0], work=[stage_compute(stage, 1) for stage in stages]) + once_s  # stage after stage
    overhead_s = step_s - compute_s - comm_s

    # ---- memory ------------------------------------------------------------------------------------
    replicated_block = stats.params_in_blocks - stats.params_tp_sharded
    weights = ((stats.params_tp_sharded / tp + replicated_block) / pp + stats.params_total - stats.params_in_blocks) * bpe
    # 8-bit block linears: one byte a weight (and a float32 scale per output row) instead of bpe
    weights -= sum((lin.in_features * (bpe - 1) - 4) * lin.out_features / (tp if lin.tp_sharded else 1) / pp
                   for lin in {lin.name: lin for lin in stats.linears}.values() if quantized(lin))
    act_peak = ((stats.act_peak_bytes - stats.act_peak_sharded_bytes) + stats.act_peak_sharded_bytes / tp) * token_frac * samples
    largest = max(stats.attentions, key=lambda a: a.q_len, default=None)
    attn_buf = comm_buf = 0.0
    if largest is not None:
        local_tokens = math.ceil(largest.q_len / sp) * samples
        width = largest.heads * largest.head_dim / tp
        if config.ring > 1 and pp == 1:  # double-buffered K/V chunks + fp32 output accumulator + lse
            attn_buf = 2 * 2 * local_tokens * config.ulysses * (width / config.ulysses) * bpe
            attn_buf += local_tokens * config.ulysses * (width / config.ulysses) * 4 + local_tokens * largest.heads * 4
        if displaced:  # one layer at a time, whole sequence: the waited gather and (uneven chunks) its trimmed copy
            attn_buf = 2 * 2 * displaced_tokens(largest.q_len, stats.layout, sp) * sp * samples * width * bpe
        elif config.ulysses > 1:  # send and receive buffers of the fused QKV all-to-all
            comm_buf = 2 * 3 * local_tokens * width * bpe
    kv_cache = 0.0
    if pp > 1:
        # the rank that holds the most: its stage's block weights, the K/V buffers of its layers over the whole
        # sequence (kept between calls), and the boundary activations it sends (held until the call's end) and
        # receives; the activation peak is the exact warm-up call's (the whole sequence through its blocks)
        block_bytes = (stats.params_tp_sharded / tp + replicated_block) / stats.params_in_blocks * bpe
        nonblock = (stats.params_total - stats.params_in_blocks) * bpe
        held = []
        for i, stage in enumerate(stages):
            stage_weights = nonblock + block_bytes * sum(n for _, n, _ in stage_blocks(stats, stage))
            stage_kv = pipefusion_kv_bytes(stats, config, samples, stage)
            boundary = hidden * ((i < pp - 1) + (i > 0))
            held.append((stage_weights + stage_kv + boundary, stage_weights, stage_kv, boundary))
        _, weights, kv_cache, boundary = max(held)
        comm_buf += boundary
    if displaced:  # one pending gather of every rank's K/V per self-attention layer, kept between steps; two (one
        # per step parity, at fixed addresses) under CUDA graphs
        kv_cache = displaced_kv_bytes(stats, config, samples) * (2 if workload.cuda_graph else 1)
    memory = {
        "weights": weights / GIB, "activations": act_peak / GIB, "attention": attn_buf / GIB,
        "comm_buffers": comm_buf / GIB, "kv_cache": kv_cache / GIB,
    }
    memory["total"] = sum(memory.values())
    if vae is not None:
        mode = workload.vae_mode(config.world_size)
        memory["decode"] = (weights + vae.weight_bytes + vae.peak(mode, config.world_size, bool(workload.vae_chunk))
                            ) / GIB
    need = max(memory["total"], memory.get("decode", 0.0)) + cal.reserve_gib
    offload_ms = None
    if need <= hw.usable_gib:
        fits = "yes"
    elif (max(memory["total"], memory.get("decode", 0.0)) - memory["weights"] + cal.reserve_gib
          + 0.1 * memory["weights"] <= hw.usable_gib):
        fits = "offload"  # weights that do not fit stream from host memory every step
        streamed = (need - hw.usable_gib) * GIB
    else:
        fits = "no"
    if fits == "offload":
        offload_ms = (step_s + streamed / (dev.host_gbps * 1e9)) * 1e3
    return Prediction(
        config=config, step_ms=step_s * 1e3, compute_ms=compute_s * 1e3, comm_ms=comm_s * 1e3,
        overhead_ms=overhead_s * 1e3, memory=memory,
        comm_bytes={"by_collective": {k: int(v) for k, v in by_collective.items()},
                    "by_level": {k: int(v) for k, v in by_level.items()},
                    "total": int(sum(by_collective.values()))},
        fits=fits, offload_step_ms=offload_ms, gpu_ms=gpu_s * 1e3, host_ms=host_s * 1e3, displaced=displaced,
        exact_step_ms=None if exact_s is None else exact_s * 1e3,
    )


def stage_blocks(stats: ModelStats, stage: tuple) -> list:
    """The ``(name, params, ops)`` of ``stats.blocks`` in a PipeFusion stage (its module-path prefixes)."""
    return [block for block in stats.blocks if (block[0] + ".").startswith(stage)]


def pipefusion_stages(stats: ModelStats, pp: int) -> list:
    """The module-path prefixes (``"transformer_blocks.3."``, ...) of each PipeFusion stage's blocks, cut as the
    runtime cuts them (``parallel.pipefusion.split_stages`` over the blocks' parameter counts); ``[None]`` (every
    block) at pp = 1."""
    if pp == 1 or not stats.blocks:
        return [None]
    ranges = split_stages([n for _, n, _ in stats.blocks], pp)
    return [tuple(stats.blocks[i][0] + "." for i in r) for r in ranges]


def pipefusion_patch_tokens(layout, patches: int) -> list[int]:
    """Tokens of each patch of a stale PipeFusion call: the image (video) tokens cut into ``patches`` contiguous
    pieces (``comm.split_sizes``), the split text tokens of a joint-attention family with patch 0."""
    text = layout.split_tokens - layout.image_tokens
    return [n + (text if i == 0 else 0) for i, n in enumerate(split_sizes(layout.image_tokens, patches))]


def pipefusion_kv_bytes(stats: ModelStats, config: ParallelConfig, samples: float, stage: tuple | None) -> float:
    """Bytes of the K/V buffers PipeFusion keeps for the attention layers of ``stage`` (module-path prefixes, as
    :func:`pipefusion_stages` gives them; None: every layer): per layer whose keys are its own tokens, K and V over
    the whole sequence with this rank's heads (1/tp, and 1/ulysses: Ulysses inside a stage; under ring the buffer
    holds every ring rank's tokens)."""
    return sum(2 * att.kv_len * att.batch * att.heads * att.head_dim / config.tp / config.ulysses
               * stats.bytes_per_element * samples for att in stats.attentions
               if att.q_len == att.kv_len and (stage is None or att.name.startswith(stage)))


def displaced_tokens(q_len: int, layout, sp: int) -> int:
    """Tokens of the longest rank's chunk of an attention over ``q_len`` tokens split over ``sp`` ranks: each stream
    is split on its own (uneven by at most one, the larger chunks first), so rank 0 holds the ceiling of each."""
    streams = [layout.text_tokens, q_len - layout.text_tokens] if 0 < layout.text_tokens < q_len else [q_len]
    return sum(math.ceil(n / sp) for n in streams)


def displaced_kv_bytes(stats: ModelStats, config: ParallelConfig, samples: float) -> float:
    """Bytes displaced attention keeps between steps: per self-attention layer and sample, every ulysses rank's K
    and V chunk padded to the longest (one pending all-gather)."""
    sp = config.sp
    return sum(2 * sp * displaced_tokens(att.q_len, stats.layout, sp) * att.batch * att.heads * att.head_dim
               / config.tp * stats.bytes_per_element * samples for att in stats.attentions if att.self_attention)


_FITS_ORDER = {"yes": 0, "offload": 1, "no": 2}


def rank(predictions: list[Prediction]) -> list[Prediction]:
    """Fitting configurations first (fastest first), then offloading ones, then the rest."""
    return sorted(predictions, key=lambda p: (_FITS_ORDER[p.fits], p.effective_ms, len(p.config.active_axes()),
                                              [getattr(p.config, a) for a in AXIS_ORDER], p.displaced))


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman needs two sequences of the same length >= 2")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0
