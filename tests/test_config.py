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
