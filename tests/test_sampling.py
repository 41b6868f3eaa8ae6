"""Compiled sampling (ffcv_ddpm.sampling) on the CPU: the same images as the eager model from the same seed, through
every caller's interface, without changing the model's mode or weights."""

import pytest
import torch

from ffcv_ddpm.config import load_config
from ffcv_ddpm.diffusion import GaussianDiffusion
from ffcv_ddpm.sampling import CompiledDenoiser, compile_denoiser
from ffcv_ddpm.unet import build_model


def test_compiled_sampling_draws_the_eager_images():
    # Class-conditional, so that guidance is covered too: one image guided is a batch of 2 (conditional and null
    # label), the unguided samplers' shape, so one compiled graph serves all three (y=None is given the null label
    # before the graph). Few timesteps keep ancestral DDPM (all T steps) short; the graph does not depend on T.
    cfg = load_config("tiny", ["model.num_classes=3", "diffusion.timesteps=20", "train.sample_every=0"])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    diffusion = GaussianDiffusion(cfg.diffusion)
    net = compile_denoiser(model, "default")
    assert isinstance(net, CompiledDenoiser) and net.num_classes == 3 and not net.training
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n, kwargs in ((2, {"sampler": "ddim", "steps": 5}), (2, {"sampler": "ddpm"}),
                      (1, {"sampler": "ddim", "steps": 5, "y": torch.tensor([1]), "guidance_scale": 2.0})):
        eager = diffusion.sample(model, n, seed=3, **kwargs)
        compiled = diffusion.sample(net, n, seed=3, **kwargs)
        # Inductor's CPU kernels reorder float sums; after rounding to uint8 at most one level may differ.
        assert (eager.int() - compiled.int()).abs().max() <= 1, kwargs
        assert eager.float().std() > 0  # the check is not on blank images
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiles == 1
    assert not model.training  # the sampler's eval()/train() round trip left the model as it was
    assert list(net.state_dict()) == [f"model.{k}" for k in model.state_dict()]  # no _orig_mod. duplicates
    assert [p.data_ptr() for p in net.parameters()] == [p.data_ptr() for p in model.parameters()]

    # An in-place weight update (as the EMA makes) is sampled without recompiling: the graph reads the model's weights.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    eager = diffusion.sample(model, 2, sampler="ddim", steps=5, seed=3)
    assert (eager.int() - diffusion.sample(net, 2, sampler="ddim", steps=5, seed=3).int()).abs().max() <= 1


def test_off_is_the_model_itself_and_a_bad_mode_is_one_line():
    model = torch.nn.Linear(2, 2)
    assert compile_denoiser(model, "off") is model
    with pytest.raises(ValueError, match="sample compile mode 'fast': use one of off, default, reduce-overhead"):
        compile_denoiser(model, "fast")


def test_train_sample_compile_is_checked_with_the_config():
    assert load_config("tiny", ["train.sample_compile=reduce-overhead"]).train.sample_compile == "reduce-overhead"
    with pytest.raises(ValueError, match="train.sample_compile=fast: expected one of off, default"):
        load_config("tiny", ["train.sample_compile=fast"])
