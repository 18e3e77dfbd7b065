"""xDiT's own FLUX pipeline (xfuser 0.7) on a `ditmesh synth` folder: PipeFusion and Ulysses, one timed image.

The peer row of docs/benchmarks.md ("PipeFusion and QwenImage"): the pipeline is driven as xDiT's FLUX example
drives it (``examples/flux_example.py`` of the xDiT repository up to its removal, #641): ``xFuserArgs`` ->
``create_config()``, ``engine_config.runtime_config.dtype = bfloat16`` (the dtype of PipeFusion's receive
buffers; ``--dtype fp16`` for the dtype xDiT's runner uses), the T5 encoder loaded in that dtype and handed over,
``xFuserFluxPipeline.from_pretrained(..., torch_dtype=...)``, ``pipe.prepare_run(input_config, steps=N)`` (xDiT's own warm-up: one whole image of the
same shape), then one timed image.

One configuration per launch: xfuser keeps its process groups and runtime state in process-wide globals.
Run on the GPU machine (every rank on one host), with the wheels of .whl/ on the path (scripts/gpu.sh):

    bash scripts/gpu.sh python3 -m ditmesh synth --arch flux-dev --out /tmp/flux-dev
    bash scripts/gpu.sh timeout 150 torchrun --nproc-per-node 4 scripts/xdit_pipefusion.py \\
        --model /tmp/flux-dev --pp 4 --json $OUT/xdit-pp4-1024.json

Rank 0 prints one JSON line (``XDIT {...}``) and writes it to ``--json``: seconds of the timed image (slowest
rank), peak GiB per GPU (largest over the ranks, allocator peak of the timed image; the weights included) and
GiB after loading. If any rank fails, that rank writes the record instead, with the error's last line and the
traceback's tail, and every rank leaves (``os._exit``; torchrun ends the others). A watchdog on every rank does
the same at ``--deadline`` seconds (keep it under the outer ``timeout``), naming the stage it stopped in.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import threading
import time
import traceback

GIB = 2**30
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
#: what the run is doing; a failure or the watchdog's record names it
stage = "import"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a FluxPipeline folder (`ditmesh synth --arch flux-dev --out DIR`)")
    p.add_argument("--pp", type=int, default=4, help="xDiT's pipefusion_parallel_degree (default 4)")
    p.add_argument("--ulysses", type=int, default=1, help="xDiT's ulysses_degree (default 1)")
    p.add_argument("--patches", type=int, default=None,
                   help="xDiT's num_pipeline_patch (default: the pp degree, as xDiT's and ditmesh's defaults)")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="xDiT's warmup_steps: exact (synchronous) steps before PipeFusion's stale ones (default 1)")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--max-sequence-length", type=int, default=512,
                   help="T5 tokens (default 512, FluxPipeline's; xDiT's example passed 256)")
    p.add_argument("--prompt", default="a photo of a cat holding a sign that says hello world")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="weights, activations and PipeFusion's buffers (default bf16, as xDiT's FLUX example; xDiT's "
                        "runner, `xdit --model FLUX.1-dev`, loads its PipeFusion pipeline in fp16)")
    p.add_argument("--deadline", type=float, default=140.0,
                   help="seconds after start at which every rank records a timeout and exits (default 140)")
    p.add_argument("--json", default=None, help="where rank 0 (or the failing rank) writes the record")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for name in ("pp", "ulysses", "steps", "warmup_steps", "height", "width", "max_sequence_length"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.pp * args.ulysses != world:
        p.error(f"--pp {args.pp} x --ulysses {args.ulysses} = {args.pp * args.ulysses} processes, but WORLD_SIZE is "
                f"{world}: launch with torchrun --nproc-per-node {args.pp * args.ulysses}, or change the degrees")
    if args.patches is not None and args.patches < args.pp:
        p.error(f"--patches {args.patches}: must be at least --pp ({args.pp})")
    if args.height % 16 or args.width % 16:
        p.error(f"--height {args.height} / --width {args.width}: FLUX needs multiples of 16")
    return args


def base_record(args) -> dict:
    """The configuration every record carries, whatever happened."""
    return {"peer": "xdit-pipefusion", "pp": args.pp, "ulysses": args.ulysses,
            "patches": args.patches or args.pp, "warmup_steps": args.warmup_steps, "dtype": args.dtype,
            "height": args.height, "width": args.width, "steps": args.steps,
            "max_sequence_length": args.max_sequence_length, "world": int(os.environ.get("WORLD_SIZE", "1")),
            "model": args.model}


def emit(record: dict, path: str | None, first_only: bool) -> None:
    """Write ``record`` to ``path`` and print it as ``XDIT <json>``. ``first_only``: a failure record, written
    and printed only if no other rank wrote one first (O_EXCL), so the first failure is the one kept."""
    line = json.dumps(record)
    if path:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if first_only else os.O_TRUNC)
            with os.fdopen(os.open(path, flags, 0o644), "w") as f:
                f.write(line + "\n")
        except FileExistsError:
            return
    print("XDIT " + line, flush=True)


def fail(args, rank: int, error: str, tail: str, code: int) -> None:
    """Record a failure (this rank's) and leave at once: no teardown that could wait on another rank."""
    emit({**base_record(args), "ok": False, "stage": stage, "rank": rank, "error": error,
          "traceback_tail": tail}, args.json, first_only=True)
    sys.stderr.flush()
    os._exit(code)


def start_watchdog(args, rank: int) -> None:
    def expire():  # the record's tail is where the main thread waits
        frame = sys._current_frames().get(threading.main_thread().ident)
        where = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else ""
        fail(args, rank, f"timed out after {args.deadline:g} s", where, 124)

    timer = threading.Timer(args.deadline, expire)
    timer.daemon = True
    timer.start()


def run(args) -> dict:
    """Load xDiT's FLUX pipeline as its example does, run its warm-up image and one timed image."""
    global stage
    import torch
    import torch.distributed as dist
    from transformers import T5EncoderModel
    from xfuser import xFuserArgs, xFuserFluxPipeline
    from xfuser.core.distributed import get_world_group

    stage = "config"
    dtype = getattr(torch, DTYPES[args.dtype])
    engine_args = xFuserArgs(model=args.model, pipefusion_parallel_degree=args.pp, ulysses_degree=args.ulysses,
                             ring_degree=1, num_pipeline_patch=args.patches, warmup_steps=args.warmup_steps,
                             height=args.height, width=args.width, num_inference_steps=args.steps,
                             max_sequence_length=args.max_sequence_length, prompt=args.prompt, seed=args.seed,
                             output_type="pil")
    engine_config, input_config = engine_args.create_config()
    engine_config.runtime_config.dtype = dtype  # PipeFusion's receive buffers take this dtype
    local_rank = get_world_group().local_rank
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)

    stage = "load"
    text_encoder_2 = T5EncoderModel.from_pretrained(args.model, subfolder="text_encoder_2", torch_dtype=dtype)
    cache_args = {"use_teacache": False, "use_fbcache": False, "rel_l1_thresh": 0.12,
                  "return_hidden_states_first": False, "num_steps": args.steps}
    pipe = xFuserFluxPipeline.from_pretrained(pretrained_model_name_or_path=args.model, engine_config=engine_config,
                                              cache_args=cache_args, torch_dtype=dtype,
                                              text_encoder_2=text_encoder_2)
    pipe = pipe.to(device)
    loaded_bytes = torch.cuda.max_memory_allocated(device)

    stage = "warm-up image"
    pipe.prepare_run(input_config, steps=args.steps)

    stage = "timed image"
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    pipe(height=args.height, width=args.width, prompt=args.prompt, num_inference_steps=args.steps,
         output_type="pil", max_sequence_length=args.max_sequence_length, guidance_scale=input_config.guidance_scale,
         generator=torch.Generator(device="cuda").manual_seed(args.seed))
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start

    stage = "report"
    peak = torch.tensor([seconds, torch.cuda.max_memory_allocated(device) / GIB, loaded_bytes / GIB],
                        dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the last collective: after it every rank leaves with os._exit
    return {**base_record(args), "ok": True, "seconds_per_image": round(peak[0].item(), 3),
            "peak_gib_per_gpu": round(peak[1].item(), 2), "loaded_gib_per_gpu": round(peak[2].item(), 2),
            "device": torch.cuda.get_device_name(device), "xfuser": importlib.metadata.version("xfuser"),
            "torch": torch.__version__}


def main(argv=None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and args.json and os.path.exists(args.json):
        os.remove(args.json)  # a failure record is written only where none exists (the first failure wins)
    start_watchdog(args, rank)
    try:
        record = run(args)
    except BaseException as error:  # noqa: BLE001 - every failure becomes the record, then every rank leaves
        lines = traceback.format_exception(error)
        fail(args, rank, traceback.format_exception_only(error)[-1].strip(), "".join(lines)[-3000:], 1)
    if rank == 0:
        emit(record, args.json, first_only=False)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
