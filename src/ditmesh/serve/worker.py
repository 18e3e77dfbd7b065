"""One rank of a serving replica: load the pipeline once, parallelize it, warm it up, then run requests until
the front end stops the process.

Cross-rank rule: rank 0 alone reads the front end's request queue; every loop turn it broadcasts what it read
(a request, or None when nothing came within :data:`IDLE_TICK_S`) to the other ranks, so every rank enters the
same pipeline call in the same order, and an idle group still meets once a tick (no collective waits longer
than the process group's timeout). Every rank reports each finished step and a heartbeat on the replica's event
queue; rank 0 alone reports the result. After every step rank 0 broadcasts whether the front end asked to
cancel the request, so every rank stops after the same step (one small broadcast per step). A failure inside a call that every rank sees alike (a bad value the
pipeline refuses) is answered as that request's error and the loop goes on; anything else (a dead or stuck
peer) is found by the front end (``replica.py``), which restarts the group.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import traceback

#: how often an idle group meets (seconds); also the heartbeat period
IDLE_TICK_S = 1.0
#: rounds of timed calls over the batch shapes at start-up (each shape's fastest counts)
BATCH_REPEATS = 3
#: batching is used only where it makes a picture at least this much cheaper than one picture a call
BATCH_GAIN = 0.05


def rank_main(rank: int, world: int, local_rank: int, port: int, options: dict | None, requests, events,
              cancel) -> None:
    """The body of a rank process (``multiprocessing`` spawn target). ``options`` are the server's ``generate``
    options (``None``: a rank started before the front end's checks ended imports torch and diffusers first and
    then reads them from ``requests``, :meth:`Replica.prestart`); ``requests`` (read by rank 0) carries requests,
    ``events`` carries this rank's reports, ``cancel`` (an Event, read by rank 0) asks to stop the request in
    flight."""
    import signal

    # the front end answers the clients and stops the ranks: a terminal's Ctrl-C (sent to the whole process group)
    # or a SIGTERM to every process of a unit must not end a rank first (it was born with both blocked: replica.py)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    # tqdm (diffusers' loading bars) would make a multiprocessing lock, a named semaphore registered with the front
    # end's resource tracker, which a rank stopped by SIGKILL never releases ("leaked semaphore" at the front end's
    # exit): a thread lock does the same for the one process
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(world))
    from ..shared import imports_without_gc

    with imports_without_gc():  # what loading needs, before the options come (a rank started early: meanwhile)
        import diffusers  # noqa: F401
        import torch  # noqa: F401
        from diffusers import DiffusionPipeline  # noqa: F401
    if options is None:
        options = _await_options(requests)
    run_rank(rank, world, options, requests, events, cancel)


def _await_options(requests) -> dict:
    """A rank started early (it imported what loading needs while the front end checks): read the options it
    sends; leave when the front end is gone (it stops prestarted ranks it does not start)."""
    import queue

    parent = os.getppid()
    while True:
        try:
            message = requests.get(timeout=IDLE_TICK_S)
        except queue.Empty:
            if os.getppid() != parent:
                _leave(0)
            continue
        return message[1]


def run_rank(rank: int, world: int, options: dict, requests, events, cancel, leave_on_load_error: bool = True) -> None:
    """A rank's life once its group's environment is set (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK): the
    heartbeat, loading and warm-up, then requests until the front end stops it. ``requests``, ``events`` and
    ``cancel`` behave as queue.Queue / threading.Event. A rank process leaves when loading fails; a Ray actor
    (``ray_replica.py``: leave_on_load_error=False) stays until the front end has read its report and removes it."""
    parent = os.getppid()
    threading.Thread(target=_heartbeat, args=(rank, events, parent), daemon=True).start()
    try:
        state = _load(rank, world, options, events)
    except BaseException as exc:  # noqa: BLE001  (every loading failure is reported the same way)
        from ..shared import one_line

        events.put(("load_error", rank, one_line(exc), traceback.format_exc()))
        if leave_on_load_error:
            _leave(2)
        return
    state.update(cancel=cancel, world=world)
    _serve(rank, world, state, requests, events, parent)


def _heartbeat(rank: int, events, parent: int) -> None:
    """Say "alive" every tick (a stopped process says nothing); leave when the front end is gone."""
    while True:
        if os.getppid() != parent:
            _leave(0)
        events.put(("beat", rank, time.time()))
        time.sleep(IDLE_TICK_S)


def _leave(code: int) -> None:
    """End the rank without destructors (a gloo group torn down mid-collective aborts the interpreter)."""
    from ..runtime.generate import end_rank_process

    end_rank_process(code)


def _load(rank: int, world: int, options: dict, events) -> dict:
    import diffusers

    from ..mesh import default_device
    from ..runtime.generate import Rendezvous, _call_kwargs, load_pipeline, warm_up_call
    from ..runtime.models import read_defaults
    from ..shared import freeze_heap
    from .phases import instrument

    diffusers.utils.logging.disable_progress_bar()
    args = argparse.Namespace(**options)
    device = default_device()
    rendezvous = Rendezvous(device)  # the group starts while this rank checks and reads its weights (as generate's)
    run_options, model = rendezvous.validate(args, world)
    loaded = load_pipeline(args, run_options, model, device, rank, world, rendezvous)  # joins it before parallelize
    pipe = loaded.pipe
    pipe.set_progress_bar_config(disable=True)
    defaults = read_defaults(loaded.path)
    options = vars(args)  # requests update the server's options: a dict (validate returned the RunOptions)
    switch = _lora_switch(pipe, run_options.loras)
    timeline, cache = instrument(pipe, device, options.get("prompt_cache", 0),
                                 lambda: switch.chosen if switch is not None else None)
    tune_vae(pipe, options.get("vae_tune") or ())
    # one step and the pictures' decode at the defaults' size and at each --warmup-sizes bucket: their kernels are
    # compiled (or read from the compile caches) and the VAE's first-call costs paid before a client comes; every
    # adapter of the switch runs in them (chosen or at 0)
    warmed = {}
    for height, width in [(args.height, args.width), *options.get("warmup_sizes", [])]:
        sized = argparse.Namespace(**{**options, "height": height, "width": width})
        warmed[f"{width}x{height}"] = round(warm_up_call(pipe, _call_kwargs(pipe, sized, defaults), device,
                                                         decode=True), 3)
    # --batching always: every batch shape built (and timed) before the replica says it is ready; auto: measured
    # later, while the service is idle (a "calibrate" request: _calibrate), so the first picture does not wait for it
    batching = None
    if options.get("batching") == "always":
        batching = _measure_batching(pipe, args, defaults, device, options.get("max_batch", 1), every_size=True,
                                     share=_sharer(world, device))
    freeze_heap()  # the pipeline and its compiled calls serve to the end: a request's full collections skip them
    events.put(("ready", rank, round(loaded.load_s, 3), warmed, batching))
    return {"pipe": pipe, "defaults": defaults, "options": options, "device": device, "timeline": timeline,
            "switch": switch, "prompt_cache": cache}


def tune_vae(pipe, ways) -> None:
    """Speed up ``pipe``'s VAE decode in the ``ways`` of ``serve --vae-tune``: ``cudnn`` (``cudnn.benchmark``: the
    fastest convolution per shape, timed at its first call, for the process), ``channels-last`` (the VAE's weights,
    and the decoder's input by a forward pre-hook, in channels-last layout), ``compile`` (``torch.compile`` of the
    decoder, in place; compiled at the warm-up, which decodes at every warmed size). Every rank tunes alike."""
    vae = getattr(pipe, "vae", None)
    if vae is None or not ways:
        return
    import torch

    if "cudnn" in ways:
        torch.backends.cudnn.benchmark = True
    decoder = getattr(vae, "decoder", None)
    if "channels-last" in ways:
        vae.to(memory_format=torch.channels_last)
        if decoder is not None:
            decoder.register_forward_pre_hook(lambda module, inputs: tuple(
                x.contiguous(memory_format=torch.channels_last) if isinstance(x, torch.Tensor) and x.ndim == 4 else x
                for x in inputs))
    if "compile" in ways and decoder is not None:
        decoder.compile()


def _measure_batching(pipe, args, defaults, device, max_batch: int, every_size: bool = False,
                      share=lambda rounds: rounds, stop=lambda: False) -> dict | None:
    """With ``--max-batch`` N > 1: the batch sizes 2, 3, ... N of the defaults' size (a seed a picture) are tried in
    turn, each warmed up before the front end sends it (compiled and, with CUDA graphs, captured, the decode too, a
    compiled VAE's included: nothing new is built inside a request; one picture's shape was warmed, decoded, with the
    defaults' size) and timed against one picture a call in :data:`BATCH_REPEATS` interleaved rounds as a whole call
    costs (:func:`_call_seconds`: the steps and the decode). A size whose picture is not at least :data:`BATCH_GAIN`
    cheaper than the same round's lone picture in every round ends the search: the larger sizes are neither warmed nor
    timed (where one picture fills the GPU, two already cost twice one: 28 s of three shapes at 1024² on one H200),
    unless ``every_size`` (``--batching always``: the front end sends every size up to N whatever the measurement).
    Returns the seconds per call by batch size tried (each size's fastest) and ``use``: of the sizes that were cheaper,
    the one cheapest in its worst round, else 1. Every rank runs the same calls (their collectives) and decides on rank
    0's numbers (``share``: rank 0's rounds to every rank), so every rank stops the search at the same size. ``stop``
    (asked before each call, alike on every rank): True raises :class:`_Cancelled` (a request came while the service
    measured in the background; the shapes built so far stay built)."""
    if max_batch <= 1:
        return None
    import torch

    from ..runtime.generate import _call_kwargs, warm_up_call

    def call_of(size: int) -> dict:
        batch = argparse.Namespace(**{**vars(args), "prompt": [args.prompt[0]] * size})
        call = _call_kwargs(pipe, batch, defaults)
        if size > 1:  # a seed per picture, as a shared call of the front end draws them
            call["generator"] = [torch.Generator("cpu").manual_seed(seed) for seed in range(size)]
        return call

    def checked(fn, *a, **k):
        if stop():
            raise _Cancelled(0)
        return fn(*a, **k)

    lone = call_of(1)
    steps = lone.get("num_inference_steps") or 1
    times, worst = {1: []}, {}
    for size in range(2, max_batch + 1):
        call = call_of(size)
        checked(warm_up_call, pipe, call, device)
        checked(warm_up_call, pipe, call, device, decode=True)  # a compiled VAE: its decode of the batch compiled too
        # interleaved with lone calls, so that a change of the machine's load falls on both sides of a round alike
        rounds = share([(checked(_call_seconds, pipe, lone, device, steps),
                         checked(_call_seconds, pipe, call, device, steps)) for _ in range(BATCH_REPEATS)])
        times[1] += [one for one, _ in rounds]
        times[size] = [batch for _, batch in rounds]
        # cheaper only if cheaper in every round (a noisy round cannot turn batching on)
        worst[size] = max(batch / size / one for one, batch in rounds)
        if worst[size] > 1 - BATCH_GAIN and not every_size:
            break
    good = [size for size, ratio in worst.items() if ratio <= 1 - BATCH_GAIN]
    use = min(good, key=lambda size: worst[size]) if good else 1
    return {"seconds": {str(k): round(min(v), 4) for k, v in times.items()}, "use": use}


def _sharer(world: int, device):
    """What :func:`_measure_batching` calls ``share``: rank 0's object on every rank of the group."""
    if world == 1:
        return lambda obj: obj
    from ..comm import broadcast_tensors

    return lambda obj: broadcast_tensors([obj], 0, None, device)[0]


def _cancel_asked(rank: int, state: dict, share) -> bool:
    """Whether the front end asked to stop the request in flight: rank 0 reads its flag, every rank learns it
    (``share``: :func:`_sharer`), so every rank stops at the same point."""
    return bool(share(state["cancel"].is_set() if rank == 0 else None))


def _calibrate(rank: int, request: dict, state: dict, events) -> None:
    """A "calibrate" request: the front end found the service idle and asks for the measurement of ``--batching
    auto`` (:func:`_measure_batching`). A request that comes meanwhile cancels it between two of its calls (rank 0
    reads the flag, every rank learns it): answered None, and asked again at the next idle moment. Rank 0 reports
    ``("calibrated", rank, id, measurement or None)``; a failure that is not a collective's is reported as the
    measurement's ``error`` (batching stays off)."""
    from ..shared import one_line

    options = state["options"]
    args = argparse.Namespace(**options)
    args.prompt = [args.prompt] if isinstance(args.prompt, str) else args.prompt
    share = _sharer(state["world"], state["device"])
    try:
        measured = _measure_batching(state["pipe"], args, state["defaults"], state["device"],
                                     options.get("max_batch", 1), share=share,
                                     stop=lambda: _cancel_asked(rank, state, share))
    except _Cancelled:
        measured = None
    except Exception as exc:  # noqa: BLE001
        if _collective_error(exc):
            _broken(rank, request["id"], exc, events)
        measured = {"seconds": {}, "use": 1, "error": one_line(exc)}
    if rank == 0:
        events.put(("calibrated", rank, request["id"], measured))


def _call_seconds(pipe, call: dict, device, steps: int) -> float:
    """What a whole call of ``call`` costs, from two one-step calls: ``steps`` times the one-step call with latents
    out (its text encoding counted each time: a few percent of a step at most) plus what decoding adds (the decoded
    one-step call's excess). The decode counts where steps are few: the tiny pipeline's 2-step picture on the 2-core
    CPU spent about as long in its VAE as in its steps, and in one loaded run 4 pictures decoded in 6.3x one's time."""
    from ..runtime.generate import warm_up_call

    latent = warm_up_call(pipe, call, device)
    return (steps - 1) * latent + warm_up_call(pipe, call, device, decode=True)


def _lora_switch(pipe, loras):
    """With named adapters (``--lora NAME=PATH[:SCALE]``): the switch that turns one of them on per request (the
    unnamed ones stay on); None without any (every adapter stays on, as ``generate`` runs them)."""
    if not any(lora.name for lora in loras):
        return None
    from ..parallel.lora import Switch

    names = [lora.name or f"lora{i}" for i, lora in enumerate(loras)]
    return Switch(pipe, names, [lora.scale for lora in loras], {n for n, lora in zip(names, loras) if not lora.name})


def _serve(rank: int, world: int, state: dict, requests, events, parent: int) -> None:
    import queue

    from ..comm import broadcast_tensors

    while True:
        request = None
        if rank == 0:
            try:
                request = requests.get(timeout=IDLE_TICK_S)
            except queue.Empty:
                if os.getppid() != parent:
                    _leave(0)
        if world > 1:
            try:
                request = broadcast_tensors([request], 0, None, state["device"])[0]
            except Exception as exc:  # noqa: BLE001  (a peer is gone: the group is broken)
                _broken(rank, None, exc, events)
        if request is not None:
            (_calibrate if request.get("calibrate") else _run_request)(rank, request, state, events)


def _run_request(rank: int, request: dict, state: dict, events) -> None:
    from ..runtime.generate import _call_kwargs, step_callback
    from ..shared import one_line

    job = request["id"]
    steps = request["options"].get("steps", state["options"]["steps"])
    args = argparse.Namespace(**{**state["options"], **request["options"]})
    args.prompt = [args.prompt] if isinstance(args.prompt, str) else args.prompt
    seeds = args.seed if isinstance(args.seed, list) else None  # requests sharing one call: a seed per picture
    if seeds is not None:
        args.seed = seeds[0]
    timeline = state["timeline"]
    timeline.reset()
    start = timeline.mark()
    try:
        pipe = state["pipe"]
        if state["switch"] is not None:
            state["switch"].select(request["options"].get("adapter"))
            timeline.add("lora_switch", start)
        call = _call_kwargs(pipe, args, state["defaults"])
        if seeds is not None:  # each picture drawn from its own seed, as it would be alone
            import torch

            call["generator"] = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]

        share = _sharer(state["world"], state["device"])

        def on_step_end(p, i, t, kw):
            events.put(("step", rank, job, i + 1, steps))
            stop = _cancel_asked(rank, state, share)  # every rank learns it at the same step
            timeline.step_end()
            if stop:
                raise _Cancelled(i + 1)
            return kw

        with step_callback(pipe, on_step_end) as callback:
            result = pipe(**call, **callback)
        if rank == 0:
            pictures = _pictures(result)  # PNG-encoded by the front end, off the ranks' path
            phases = timeline.report(start, timeline.mark())
            events.put(("done", rank, job, True, pictures, phases["call"], phases))
    except _Cancelled as exc:
        if rank == 0:
            events.put(("cancelled", rank, job, exc.step, steps))
    except Exception as exc:  # noqa: BLE001  (the request's error; the group goes on)
        if _collective_error(exc):
            _broken(rank, job, exc, events)
        if rank == 0:
            events.put(("done", rank, job, False, one_line(exc), round(time.perf_counter() - start[0], 4), {}))


class _Cancelled(Exception):
    """The front end cancelled the request in flight; every rank raises it after the same step."""

    def __init__(self, step: int):
        super().__init__(f"cancelled after step {step}")
        self.step = step


def _collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (a peer died or timed out), not out of the request itself."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or "gloo" in text or "NCCL" in text or "Connection closed" in text


def _broken(rank: int, job: str | None, exc: BaseException, events) -> None:
    """The group is broken (a collective failed): say so once and wait to be stopped (the heartbeat goes on, so
    the front end names the rank that failed first, not this one)."""
    from ..shared import one_line

    events.put(("fault", rank, job, one_line(exc)))
    while True:
        time.sleep(3600)


def _pictures(result) -> list[tuple[str, object]]:
    """The call's pictures for the front end, which encodes them as PNG: ("pixels", its ``[height, width, channels]``
    uint8 array) each of mode L, LA, RGB or RGBA (an array crosses the process boundary as one buffer; a PIL image
    is packed into bytes and unpacked again on the way: ~6 ms at 1024²), ("image", a PIL image) of another mode;
    an animated GIF per video, as (media type, bytes)."""
    if hasattr(result, "frames") and not hasattr(result, "images"):
        from ..runtime.video import gif_bytes

        return [("image/gif", gif_bytes(video)) for video in result.frames]
    from ..png import COLOUR_TYPES

    return [("pixels", pixels_of(image)) if getattr(image, "mode", None) in COLOUR_TYPES else ("image", image)
            for image in result.images]


def pixels_of(image):
    """The pixels of a PIL image of mode L, LA, RGB or RGBA as a ``[height, width, channels]`` uint8 array."""
    import numpy as np

    from ..png import COLOUR_TYPES

    return np.asarray(image, dtype=np.uint8).reshape(image.height, image.width, COLOUR_TYPES[image.mode][0])
