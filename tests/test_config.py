"""The config is parsed to its fields' types and range-checked when it is built: one line per bad value."""

import dataclasses
import json

import pytest

from ffcv_ddpm.checks import BadValue
from ffcv_ddpm.config import _SECTIONS, RULES, RunConfig, field_types, load_config


@pytest.mark.parametrize("override,message", [
    ("train.steps=abc", "train.steps=abc: expected an integer in [1, 99999999]"),
    ("train.lr=abc", "train.lr=abc: expected a number > 0"),
    ("train.lr=nan", "train.lr=nan: expected a number > 0"),
    ("train.log_every=0", "train.log_every=0: expected an integer >= 1"),
    ("train.ckpt_every=0", "train.ckpt_every=0: expected an integer >= 1"),
    ("train.precision=fp8", "train.precision=fp8: expected one of fp32, tf32, bf16, fp16"),
    ("train.compile=maybe", "train.compile=maybe: expected True or False"),
    ("train.device=gpu", "train.device=gpu: expected auto, cpu, cuda or cuda:N"),
    ("train.betas=(0.9,)", "train.betas=(0.9,): expected a tuple of numbers, of length 2, each in [0, 1)"),
    ("train.desc=a/b", "train.desc=a/b: expected a string without '/'"),
    ("train.sample_steps=5000", "train.sample_steps=5000: expected at most diffusion.timesteps=1000"),
    ("data.batch_size=0", "data.batch_size=0: expected an integer >= 1"),
    ("data.batch_size=1.5", "data.batch_size=1.5: expected an integer >= 1"),
    ("data.batch_size=1e30", "data.batch_size=1e30: expected an integer >= 1"),  # not 1000000000000000019884624838656
    ("train.steps=1e30", "train.steps=1e30: expected an integer in [1, 99999999]"),
    ("data.loader=nope", "data.loader=nope: expected one of ffcv, torch-files, torch-memory, gpu"),
    ("model.channel_mult=()", "model.channel_mult=(): expected a tuple of integers, non-empty, each >= 1"),
    ("model.dropout=1", "model.dropout=1: expected a number in [0, 1)"),
    ("model.norm_impl=x", "model.norm_impl=x: expected one of torch, scale-shift"),
    ("model.image_size=31", "model.image_size=31 must be divisible by"),
    ("model.depthwise_separable=maybe", "model.depthwise_separable=maybe: expected True or False"),
    ("diffusion.timesteps=0", "diffusion.timesteps=0: expected an integer >= 1"),
    ("diffusion.beta_start=0.5", "diffusion.beta_start=0.5: expected at most diffusion.beta_end=0.02"),
    ("train.ddp_reduce=nccl", "train.ddp_reduce=nccl: expected one of ddp, flat"),
    ("model.norm_plan=2048,65536,4", "model.norm_plan='2048,65536,4' is the fused GroupNorm kernels' plan, "
     "but norm_impl='scale-shift' runs no such kernels; set norm_impl=fused or norm_plan=''"),
])
def test_bad_values_are_one_clear_line(override, message):
    with pytest.raises(BadValue) as e:
        load_config("tiny", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,named", [
    (["train.ddp_split=True"], "train.ddp_split=True sets"),
    (["train.ddp_bucket_mb=50", "train.ddp_reduce=flat"], "train.ddp_bucket_mb=50.0 sets"),
    (["train.ddp_split=True", "train.ddp_bucket_mb=5"], "train.ddp_split=True and train.ddp_bucket_mb=5.0 set"),
])
def test_bucket_settings_need_ddp_buckets(overrides, named):
    """The default averaging (flat) has no buckets: a bucket setting without train.ddp_reduce=ddp would do nothing."""
    with pytest.raises(BadValue, match=f"{named} DDP's gradient buckets; .* add train.ddp_reduce=ddp"):
        load_config("tiny", overrides)
    cfg = load_config("tiny", [*overrides, "train.ddp_reduce=ddp"])
    assert cfg.train.ddp_reduce == "ddp" and load_config("tiny", []).train.ddp_reduce == "flat"


def test_deterministic_needs_cudnn_search_off():
    """A deterministic run whose convolution algorithms are picked by timing is not reproducible (NOTES item 16)."""
    with pytest.raises(BadValue, match=r"train.deterministic=True with train.cudnn_benchmark=True .* add "
                                       r"train.cudnn_benchmark=False"):
        load_config("tiny", ["train.deterministic=True"])
    cfg = load_config("tiny", ["train.deterministic=True", "train.cudnn_benchmark=False"])
    assert cfg.train.deterministic and not cfg.train.cudnn_benchmark


def test_cudnn_benchmark_limit_needs_the_search_and_reaches_torch():
    """The limit is how many engines cuDNN's search times (NOTES item 43); with the search off it would do nothing."""
    import torch

    from ffcv_ddpm.step import build

    with pytest.raises(BadValue, match=r"train.cudnn_benchmark_limit=0 .* add train.cudnn_benchmark=True"):
        load_config("tiny", ["train.cudnn_benchmark_limit=0", "train.cudnn_benchmark=False"])
    before = torch.backends.cudnn.benchmark_limit
    try:
        for limit in (0, 3):
            over = ["train.device=cpu", "train.compile=False", f"train.cudnn_benchmark_limit={limit}"]
            build(load_config("tiny", over), torch.device("cpu"))
            assert torch.backends.cudnn.benchmark_limit == limit
    finally:
        torch.backends.cudnn.benchmark_limit = before


def test_depthwise_separable_needs_dense_conv_groups():
    with pytest.raises(BadValue, match="model.depthwise_separable=True with conv_groups=2: .* set conv_groups=1"):
        load_config("tiny", ["model.depthwise_separable=True", "model.conv_groups=2"])


def test_values_parse_to_the_field_type():
    cfg = load_config("tiny", ["train.steps=1e3", "train.lr=1", "train.compile=false", "data.png_dir=None",
                               "model.attn_resolutions=16", "train.betas=[0.5, 0.9]", "train.desc=123"])
    assert cfg.train.steps == 1000 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.compile is False and cfg.data.png_dir is None
    assert cfg.model.attn_resolutions == (16,) and cfg.train.betas == (0.5, 0.9) and cfg.train.desc == "123"


def test_a_saved_config_is_checked_too():
    d = load_config("tiny").to_dict()
    d["train"]["log_every"] = 0
    with pytest.raises(BadValue, match="train.log_every=0: expected an integer >= 1"):
        RunConfig.from_dict(json.loads(json.dumps(d)))
    d["train"]["log_every"], d["train"]["bogus"] = 1, 1
    with pytest.raises(BadValue, match="train has no field"):
        RunConfig.from_dict(d)


def test_every_number_tuple_and_choice_field_has_a_rule():
    """A new int/float/tuple field needs its allowed range in RULES (bool and free text are checked by type)."""
    missing = []
    for section, typ in _SECTIONS.items():
        for name, annotation in field_types(typ).items():
            if annotation not in (bool, str, str | None) and f"{section}.{name}" not in RULES:
                missing.append(f"{section}.{name}")
    assert missing == [], f"add these to ffcv_ddpm.config.RULES: {missing}"
    assert all(key.split(".")[1] in {f.name for f in dataclasses.fields(_SECTIONS[key.split(".")[0]])}
               for key in RULES), "RULES names a field that does not exist"


@pytest.mark.parametrize("plan,message", [
    ("2048,65536", "model.norm_plan='2048,65536': expected three or four comma-separated integers "
                   "TILE,CHUNK,WARPS[,STAGES], e.g. '1024,16384,4' or '2048,65536,4,3', or '' for the default "
                   "2048,65536,4"),
    ("(2048,65536,4)", "model.norm_plan='(2048,65536,4)': expected three or four comma-separated integers"),
    ("2048,65536,6", "model.norm_plan='2048,65536,6': WARPS=6 is not one of 1, 2, 4, 8, 16; write TILE,CHUNK,WARPS"),
    ("2048,65536,4,5", "model.norm_plan='2048,65536,4,5': STAGES=5 is not one of 0, 2, 3, 4; write "
                       "TILE,CHUNK,WARPS[,STAGES]"),
    ("2048,1024,4", "model.norm_plan='2048,1024,4': CHUNK=1024 is below TILE=2048"),
    ("3000,65536,4", "model.norm_plan='3000,65536,4': TILE=3000 is not a power of two"),
])
def test_a_bad_norm_plan_is_one_clear_line(plan, message):
    with pytest.raises(BadValue) as e:
        load_config("tiny", ["model.norm_impl=fused", f"model.norm_plan={plan}"])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_norm_plan_is_a_recorded_setting():
    """model.norm_plan=TILE,CHUNK,WARPS from the command line lands in the config that bench rows and checkpoints
    record (to_dict), and comes back from it; a config saved before the field existed loads with the default plan."""
    cfg = load_config("ddpm-cifar10", ["model.norm_plan=1024,16384,4"])
    assert cfg.model.norm_plan == "1024,16384,4" and cfg.model.fused_norm_plan() == (1024, 16384, 4)
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert saved["model"]["norm_plan"] == "1024,16384,4"
    assert RunConfig.from_dict(saved).model.norm_plan == "1024,16384,4"
    del saved["model"]["norm_plan"]  # a run or checkpoint written before model.norm_plan
    old = RunConfig.from_dict(saved)
    assert old.model.norm_plan == "" and old.model.fused_norm_plan() is None
    assert load_config("ddpm-cifar10").model.norm_plan == ""
