"""EMA math against hand-computed updates, warm-up, buffers, checkpoint round-trip, and a no-host-sync trace."""

import pytest
import torch
from torch import nn

from ffcv_ddpm.ema import EMA
from conftest import host_syncs

pytestmark = pytest.mark.usefixtures("one_thread")


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))  # BatchNorm: buffers to copy


def set_params(model: nn.Module, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return [p.detach().clone() for p in model.parameters()]


def test_update_matches_hand_computed_average():
    model = small_model()
    start = [p.detach().clone() for p in model.parameters()]
    ema = EMA(model, decay=0.9)
    first = set_params(model, 1)
    ema.update(model)
    second = set_params(model, 2)
    ema.update(model)
    for e, s, a, b in zip(ema.module.parameters(), start, first, second):
        expected = 0.9 * (0.9 * s + 0.1 * a) + 0.1 * b
        assert torch.allclose(e, expected, atol=1e-6)
    assert ema.step.item() == 2


def test_warmup_decay_ramps_from_a_tenth():
    model = small_model()
    start = [p.detach().clone() for p in model.parameters()]
    ema = EMA(model, decay=0.9999, warmup=True)
    first = set_params(model, 1)
    ema.update(model)  # n=0: decay min(0.9999, 1/10)
    second = set_params(model, 2)
    ema.update(model)  # n=1: decay 2/11
    for e, s, a, b in zip(ema.module.parameters(), start, first, second):
        after_one = 0.1 * s + 0.9 * a
        assert torch.allclose(e, 2 / 11 * after_one + 9 / 11 * b, atol=1e-6)


def test_buffers_copied_and_copy_is_independent():
    model = small_model()
    ema = EMA(model)
    assert not ema.module.training and not any(p.requires_grad for p in ema.module.parameters())
    model.train()(torch.randn(8, 3) + 2)  # moves BatchNorm running stats
    assert not torch.equal(model[1].running_mean, ema.module[1].running_mean)
    ema.update(model)
    assert torch.equal(model[1].running_mean, ema.module[1].running_mean)
    assert model[0].weight.data_ptr() != ema.module[0].weight.data_ptr()


def test_state_dict_roundtrip():
    model = small_model()
    ema = EMA(model, decay=0.5)
    set_params(model, 3)
    ema.update(model)
    restored = EMA(small_model(), decay=0.5)
    restored.load_state_dict(ema.state_dict())
    assert restored.step.item() == 1
    for a, b in zip(restored.module.state_dict().values(), ema.module.state_dict().values()):
        assert torch.equal(a, b)


def test_mismatched_model_is_a_clear_error():
    ema = EMA(small_model())
    with pytest.raises(ValueError, match="same"):
        ema.update(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="decay"):
        EMA(small_model(), decay=1.5)


@pytest.mark.parametrize("warmup", [False, True])
def test_update_has_no_host_sync(warmup):
    model = small_model()
    ema = EMA(model, decay=0.9, warmup=warmup)
    assert host_syncs(ema.update, model) == []
