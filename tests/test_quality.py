"""The digits judge: trained briefly on the real digits train split it already classifies the test split well; its
FD-digits and conditional accuracy respond to what they should, and it saves and loads exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ffcv_ddpm import quality
from ffcv_ddpm.quality import (Judge, accuracy, beton_tensors, class_balanced_subset, evaluate_samples, fd_floor,
                               load_judge, save_judge, train_judge)

# 120 steps of 32 images: ~97% test accuracy already on CPU (80 steps of the default 128 gave the same at 3x the
# time); the GPU report trains 2000 steps of 128
JUDGE_STEPS, JUDGE_BATCH = 120, 32


HELD_OUT = 200


@pytest.fixture(scope="module")
def judged(digits_dataset, one_thread):
    """A judge trained with HELD_OUT images held out, and every batch it trained on (uint8, as read)."""
    seen = []
    real = quality._augment

    def augment(x, gen):  # x: the batch of float images in [-1, 1] the judge is about to train on
        seen.append(torch.round(x * 127.5 + 127.5).to(torch.uint8))
        return real(x, gen)

    quality._augment = augment
    try:
        judge = train_judge(digits_dataset / "digits_train_raw.beton", "cpu", steps=JUDGE_STEPS, seed=0,
                            batch_size=JUDGE_BATCH, hold_out=HELD_OUT)
    finally:
        quality._augment = real
    judge.seen = torch.cat(seen)
    return judge, beton_tensors(digits_dataset / "digits_test_raw.beton"), \
        beton_tensors(digits_dataset / "digits_train_raw.beton")


def test_judge_learns_the_digits(judged):
    judge, (test_x, test_y), _ = judged
    assert not judge.training and judge.info["steps"] == JUDGE_STEPS
    assert accuracy(judge, test_x, test_y) >= 0.93
    feats = judge.features(test_x)
    assert feats.shape == (len(test_x), 64) and feats.dtype == torch.float32
    assert judge.predict(test_x).dtype == torch.long
    with pytest.raises(ValueError, match="uint8"):
        judge.features(test_x.float())


def test_fd_digits_and_conditional_accuracy(judged):
    judge, (test_x, test_y), (train_x, train_y) = judged
    itself = evaluate_samples(judge, test_x, test_y, test_x)
    assert abs(itself["fd_digits"]) < 1e-6 and itself["cond_acc"] == accuracy(judge, test_x, test_y)
    idx = class_balanced_subset(train_y, len(test_x))
    floor = evaluate_samples(judge, train_x[idx], None, test_x)
    assert floor["cond_acc"] is None and floor["n"] == len(test_x) and floor["fd_digits"] > 0
    # Wrong labels: accuracy near chance; noise: far from the digits.
    wrong = evaluate_samples(judge, test_x, (test_y + 1) % 10, test_x)
    assert wrong["cond_acc"] < 0.1
    noise = torch.randint(0, 256, test_x.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert evaluate_samples(judge, noise, None, test_x)["fd_digits"] > 20 * floor["fd_digits"]
    # One class only (a collapsed generator): far worse than the floor although every image is a real digit.
    sevens = train_x[train_y == 7][:300]
    assert evaluate_samples(judge, sevens, None, test_x)["fd_digits"] > 5 * floor["fd_digits"]


def test_the_reference_set_is_embedded_once_per_judge_state(monkeypatch):
    """evaluate_samples keeps the reference set's features (a study scores every row against the same set) and
    embeds the set again when the judge's weights, its mode or the set change."""
    judge = Judge().eval()
    gen = torch.Generator().manual_seed(0)
    ref = torch.randint(0, 256, (100, 3, 32, 32), dtype=torch.uint8, generator=gen)
    samples = torch.randint(0, 256, (80, 3, 32, 32), dtype=torch.uint8, generator=gen)
    embedded, real = [], Judge.features
    monkeypatch.setattr(Judge, "features", lambda self, x, **k: embedded.append(len(x)) or real(self, x, **k))
    first = evaluate_samples(judge, samples, None, ref)
    assert evaluate_samples(judge, samples, None, ref) == first and embedded == [80, 100, 80]
    with torch.no_grad():
        judge.body[0][0].weight.mul_(0.5)  # an in-place update (an optimiser step) of a feature weight
    changed = evaluate_samples(judge, samples, None, ref)
    assert embedded[-2:] == [80, 100] and changed["fd_digits"] != first["fd_digits"]
    evaluate_samples(judge, samples, None, ref.clone())  # another tensor, same values: embedded again
    ref[0] = 0  # the set changed in place
    evaluate_samples(judge, samples, None, ref)
    assert embedded[-4:] == [80, 100, 80, 100]
    judge.train()
    evaluate_samples(judge, samples, None, ref)
    assert embedded[-2:] == [80, 100] and len(embedded) == 11


def test_the_floor_comes_from_images_the_judge_never_trained_on(judged):
    """The held-out images are class-balanced and never in a training batch (unless a copy of one is among the kept
    images); fd_floor scores a class-balanced share of them, and a judge that held none out has no floor."""
    judge, (test_x, _), (train_x, train_y) = judged
    held = np.array(judge.info["held_out"])
    assert len(held) == HELD_OUT and judge.info["train_images"] == len(train_y) - HELD_OUT
    assert np.bincount(train_y[held].numpy(), minlength=10).tolist() == [20] * 10
    key = lambda images: {bytes(x.numpy().tobytes()) for x in images}  # noqa: E731
    kept = np.setdiff1d(np.arange(len(train_y)), held)
    only_held = key(train_x[held]) - key(train_x[kept])  # digits that exist only among the held-out images
    assert len(only_held) > 0.9 * HELD_OUT and not only_held & key(judge.seen)
    floor = fd_floor(judge, train_x, train_y, test_x, 100)
    assert floor["n"] == 100 and floor["fd_digits"] > 0
    assert fd_floor(judge, train_x, train_y, test_x, 500)["n"] == HELD_OUT  # asked for more than it held out
    picked = class_balanced_subset(train_y[held], 100)
    assert floor["fd_digits"] == evaluate_samples(judge, train_x[held[picked]], None, test_x)["fd_digits"]
    plain = Judge()
    plain.info = {"held_out": []}
    assert fd_floor(plain, train_x, train_y, test_x, 100) is None
    with pytest.raises(ValueError, match="can hold out 0 to 719"):
        train_judge(judge.info["train_beton"], "cpu", steps=1, hold_out=800)


def test_save_and_load_round_trip(judged, tmp_path):
    judge, (test_x, _), _ = judged
    save_judge(judge, tmp_path / "judge.pt")
    again = load_judge(tmp_path / "judge.pt", "cpu")
    assert isinstance(again, Judge) and not again.training and again.info == judge.info
    torch.testing.assert_close(again.features(test_x), judge.features(test_x), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="train one"):
        load_judge(tmp_path / "missing.pt", "cpu")


def test_class_balanced_subset():
    labels = np.repeat(np.arange(10), [5, 9, 9, 9, 9, 9, 9, 9, 9, 9])
    idx = class_balanced_subset(labels, 25)
    assert len(np.unique(idx)) == 25 and np.bincount(labels[idx], minlength=10).tolist() == [3] * 5 + [2] * 5
    with pytest.raises(ValueError, match="class-balanced"):
        class_balanced_subset(labels, 80)
