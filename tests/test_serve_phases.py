"""The served request's phases (``serve/phases.py``): the pictures rounded on the device are diffusers' pictures
byte for byte, and only a plain PIL postprocess is taken over."""

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor

from ditmesh.hooks import add_hook
from ditmesh.serve.phases import DevicePictures


def _decoded(dtype, channels=3):
    """A VAE's output in [-1, 1] and past it, with values whose x 255 lands on .5 after denormalizing (ties)."""
    g = torch.Generator().manual_seed(0)
    image = torch.rand(2, channels, 17, 31, generator=g) * 2.4 - 1.2
    ties = torch.tensor([2 * (k + 0.5) / 255 - 1 for k in range(255)])
    image.view(-1)[: ties.numel()] = ties
    return image.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [3, 1])
def test_device_pictures_are_diffusers_pictures_byte_for_byte(dtype, channels):
    image = _decoded(dtype, channels)
    plain, hooked = VaeImageProcessor(), VaeImageProcessor()
    remove = add_hook(hooked, DevicePictures(), method="postprocess")
    want = plain.postprocess(image.clone(), output_type="pil")
    got = hooked.postprocess(image.clone(), output_type="pil")
    assert [p.mode for p in got] == [p.mode for p in want] and [p.size for p in got] == [p.size for p in want]
    for a, b in zip(got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # keyword and positional forms, and do_denormalize given
    got = hooked.postprocess(image.clone(), "pil", [False, True])
    want = plain.postprocess(image.clone(), "pil", [False, True])
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
    remove()
    assert "postprocess" not in vars(hooked)


def test_device_pictures_leave_other_outputs_to_diffusers():
    image = _decoded(torch.float32)
    hooked = VaeImageProcessor()
    add_hook(hooked, DevicePictures(), method="postprocess")
    out = hooked.postprocess(image.clone(), output_type="np")
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert np.array_equal(out, VaeImageProcessor().postprocess(image.clone(), output_type="np"))
    assert torch.equal(hooked.postprocess(image.clone(), output_type="pt"),
                       VaeImageProcessor().postprocess(image.clone(), output_type="pt"))


@pytest.mark.parametrize("count", [0, 1, 3])
def test_the_answer_with_pictures_is_json_dumps_byte_for_byte(count):
    import base64
    import json

    from ditmesh.serve.app import json_with_pictures

    pictures = [bytes(range(256)) * (k + 1) + b"\x00\xff" * k for k in range(count)]
    body = {"id": "ab12", "seconds": 1.25, "timeline": {"queue": 0.001, "steps": 3.5}, "note": 'quote " and \\ é'}
    items = [{"media_type": "image/png"} for _ in pictures]
    got = json_with_pictures(body, "images", items, "b64", pictures)
    want = json.dumps({**body, "images": [{**item, "b64": base64.b64encode(p).decode()}
                                          for item, p in zip(items, pictures)]}).encode()
    assert got == want
    assert json_with_pictures({"created": 5}, "data", [{} for _ in pictures], "b64_json", pictures) == json.dumps(
        {"created": 5, "data": [{"b64_json": base64.b64encode(p).decode()} for p in pictures]}).encode()


def test_vae_tune_cudnn_and_channels_last_decode_the_same_picture_and_compile_wraps_the_decoder(flux_tiny):
    """``serve --vae-tune``: cudnn and channels-last give the plain decode's picture (float32 on CPU, rel. err <=
    1e-5: another convolution kernel may round differently); compile compiles the decoder in place (its compiled
    run is the GPU script's: on this CPU it takes minutes)."""
    from diffusers import AutoencoderKL

    from ditmesh.serve.worker import tune_vae
    from ditmesh.testing import rel_err

    vae = AutoencoderKL.from_pretrained(flux_tiny, subfolder="vae").eval()
    pipe = type("Pipe", (), {"vae": vae})()
    latents = torch.randn(1, vae.config.latent_channels, 24, 16, generator=torch.Generator().manual_seed(0))
    cudnn = torch.backends.cudnn.benchmark
    try:
        with torch.no_grad():
            plain = vae.decode(latents).sample
            tune_vae(pipe, ("cudnn", "channels-last"))
            assert torch.backends.cudnn.benchmark is True
            assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
            tuned = vae.decode(latents).sample
        assert tuned.shape == plain.shape and rel_err(tuned, plain) <= 1e-5
        assert vae.decoder._compiled_call_impl is None
        tune_vae(pipe, ("compile",))
        assert vae.decoder._compiled_call_impl is not None
        tune_vae(type("NoVae", (), {})(), ("compile",))  # a pipeline without a VAE: nothing to tune
    finally:
        torch.backends.cudnn.benchmark = cudnn


@pytest.mark.parametrize("text, ways", [("off", ()), ("cudnn", ("cudnn",)),
                                        ("compile, cudnn,compile", ("compile", "cudnn"))])
def test_vae_tune_reads_its_ways(text, ways):
    from ditmesh.serve.cli import _vae_tunes

    assert _vae_tunes(text) == ways


@pytest.mark.parametrize("text", ["fast", "", "cudnn,off", "channels_last"])
def test_a_bad_vae_tune_is_one_line_and_exit_code_2(capsys, text):
    from ditmesh.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--vae-tune", text])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"ditmesh serve: error: argument --vae-tune: {text!r}: give off, or some of cudnn, channels-last, "
                    "compile comma-separated (e.g. cudnn,channels-last) (see ditmesh serve --help)")


def test_the_timeline_reads_its_marks_on_the_gpus_clock_and_on_the_host_elsewhere():
    """A served call's phases: on the host's clock off a GPU; on a GPU every mark is its event's time counted from
    the call's first (stand-in events here: what torch.cuda.Event gives), so a phase whose kernels the host only
    launched (the text encoding, here 0.2 s on the host and 0.5 s on the GPU) gets the GPU's seconds, and nothing
    in the call waited for the GPU to time it. ``call`` stays the host's."""
    from ditmesh.serve.phases import Timeline

    class Event:
        def __init__(self, ms):
            self.ms, self.synced = ms, False

        def elapsed_time(self, other):
            return other.ms - self.ms

        def synchronize(self):
            self.synced = True

    timeline = Timeline(torch.device("cpu"))
    assert timeline.mark()[1] is None  # no event off a GPU
    host = {"start": 100.0, "enc0": 100.0, "enc1": 100.2, "first": 100.3, "steps": (100.31, 100.32, 100.33, 100.34),
            "vae0": 100.35, "vae1": 100.36, "end": 101.5}
    gpu = {"start": 0.0, "enc0": 0.0, "enc1": 500.0, "first": 520.0, "steps": (620.0, 720.0, 830.0, 930.0),
           "vae0": 930.0, "vae1": 1030.0, "end": 1050.0}
    for clock in ("host", "gpu"):
        def mark(name, i=None):
            t = host[name] if i is None else host[name][i]
            return (t, None) if clock == "host" else (t, Event(gpu[name] if i is None else gpu[name][i]))

        timeline.reset()
        start = mark("start")
        timeline.spans = [("text_encode", mark("enc0"), mark("enc1")), ("vae_decode", mark("vae0"), mark("vae1"))]
        timeline.first_call = mark("first")
        timeline.step_marks = [mark("steps", i) for i in range(4)]
        end = mark("end")
        out = timeline.report(start, end)
        if clock == "host":
            want = {"text_encode": 0.2, "prepare": 0.1, "steps": 0.04, "first_step": 0.01, "step": 0.01,
                    "step_max": 0.01, "vae_decode": 0.01, "postprocess": 1.14, "call": 1.5}
        else:
            want = {"text_encode": 0.5, "prepare": 0.02, "steps": 0.41, "first_step": 0.1, "step": 0.1,
                    "step_max": 0.11, "vae_decode": 0.1, "postprocess": 0.02, "call": 1.5}
            assert end[1].synced  # read once the call has ended
        assert out == pytest.approx(want, abs=1e-6), clock
