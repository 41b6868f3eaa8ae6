"""A digits judge: a small CNN classifier whose features give FD-digits and whose predictions give conditional accuracy.

    judge = train_judge("data/digits/digits_train_raw.beton", device, hold_out=500)   # seconds on a GPU
    accuracy(judge, *beton_tensors("data/digits/digits_test_raw.beton"))    # expect >= 0.97
    save_judge(judge, "judge.pt"); judge = load_judge("judge.pt", device)
    evaluate_samples(judge, samples_u8, labels, test_u8)   # {"fd_digits": ..., "cond_acc": ..., "n": ...}
    fd_floor(judge, train_u8, train_labels, test_u8, 500)  # {"n": 500, "fd_digits": ...} from the held-out images

FD-digits is the Fréchet distance (ffcv_ddpm.frechet) between Gaussians fitted to the judge's penultimate features
(the 64-d global average pool of its last conv block, as FID uses Inception's pool) of two image sets. Its floor
for a given sample count is FD-digits between that many real images and the test set: a generator that matched the
data exactly would score about that. The real images must be ones the judge never trained on: its features of its
own training images are tighter than of any other digit, which raised the floor (on the CPU: 0.29-0.38 from
images it trained on, 0.22 from held-out ones). So the judge holds out a class-balanced set of train images
(`hold_out`, listed in its saved info) and the floor is taken from those. Conditional accuracy is the share of
samples generated for class c that the judge classifies as c.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ffcv_ddpm.checkpoint import atomic_torch_save
from ffcv_ddpm.frechet import frechet_distance

__all__ = ["Judge", "accuracy", "beton_tensors", "class_balanced_subset", "evaluate_samples", "fd_floor",
           "frechet_distance", "load_judge", "save_judge", "train_judge"]


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Judge(nn.Module):
    """conv-BN-ReLU x2, pool, x2, pool, x1 at 8x8, global average pool -> features (D), linear -> 10 logits."""

    def __init__(self, num_classes: int = 10, width: int = 32, feature_dim: int = 64):
        super().__init__()
        self.config = {"num_classes": num_classes, "width": width, "feature_dim": feature_dim}  # saved with weights
        self.body = nn.Sequential(
            _block(3, width), _block(width, width), nn.MaxPool2d(2),  # 32 -> 16
            _block(width, 2 * width), _block(2 * width, 2 * width), nn.MaxPool2d(2),  # 16 -> 8
            _block(2 * width, feature_dim))
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(feature_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Float images in [-1, 1] (N, 3, 32, 32) -> penultimate features (N, D)."""
        return self.body(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embed(x)))

    @torch.no_grad()
    def features(self, images_u8: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
        """uint8 (N, 3, 32, 32) -> float32 features (N, D) on the judge's device (call in eval mode)."""
        return torch.cat([self.embed(self._prepare(c)) for c in images_u8.split(batch_size)])

    @torch.no_grad()
    def predict(self, images_u8: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
        """uint8 (N, 3, 32, 32) -> predicted class (N,) int64 on the judge's device (call in eval mode)."""
        return torch.cat([self(self._prepare(c)).argmax(dim=1) for c in images_u8.split(batch_size)])

    def _prepare(self, images_u8: torch.Tensor) -> torch.Tensor:
        if images_u8.dtype != torch.uint8 or images_u8.dim() != 4 or images_u8.shape[1] != 3:
            raise ValueError(f"the judge takes uint8 images (N, 3, H, W), got {images_u8.dtype} "
                             f"{tuple(images_u8.shape)}")
        device = self.head.weight.device
        return (images_u8.to(device, non_blocking=True).float() - 127.5) / 127.5


def beton_tensors(path: str | Path, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """All images uint8 (N, 3, H, W) and labels int64 (N,) of a .beton, on `device`."""
    from ffcv_ddpm.data import read_beton

    images, labels = read_beton(path)
    return (torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device),
            torch.from_numpy(labels).to(device))


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Small random affine maps per image (rotation ±10°, scale 0.9-1.1, shift ±2 px): a judge that does not hinge
    on the exact placement of the training digits."""
    n = x.shape[0]
    u = torch.rand(n, 4, generator=gen, device=x.device) * 2 - 1  # (N, 4) in [-1, 1]
    angle, scale, shift = u[:, 0] * math.radians(10), 1 + 0.1 * u[:, 1], u[:, 2:] * (2 / 16)  # 2 px of 32 = 2/16
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)  # (N, H, W, 2)
    return F.grid_sample(x, grid, padding_mode="border", align_corners=False)  # border: the background is black


def train_judge(train_beton: str | Path, device: torch.device | str, steps: int = 2000, seed: int = 0,
                batch_size: int = 128, lr: float = 2e-3, hold_out: int = 0) -> Judge:
    """A Judge trained on the images of `train_beton` (AdamW, cosine decay, augmented), returned in eval mode.

    hold_out: that many class-balanced images (a seeded choice) are left out of its training, for fd_floor; their
    indices are judge.info["held_out"]. At most half the images, so the judge still sees most of each class."""
    device = torch.device(device)
    images, labels = beton_tensors(train_beton, device)
    if not 0 <= hold_out <= len(labels) // 2:
        raise ValueError(f"the judge can hold out 0 to {len(labels) // 2} of the {len(labels)} images of "
                         f"{train_beton}, not {hold_out}: ask for fewer samples per row")
    held = class_balanced_subset(labels, hold_out, seed) if hold_out else np.zeros(0, np.int64)
    seen = np.setdiff1d(np.arange(len(labels)), held)
    seen_idx = torch.from_numpy(seen).to(device)
    num_classes = int(labels.max()) + 1
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        judge = Judge(num_classes=num_classes).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    opt = torch.optim.AdamW(judge.parameters(), lr=lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    judge.train()
    for _ in range(steps):
        idx = seen_idx[torch.randint(0, len(seen_idx), (batch_size,), generator=gen, device=device)]
        x = _augment((images[idx].float() - 127.5) / 127.5, gen)
        loss = F.cross_entropy(judge(x), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    judge.info = {"train_beton": str(train_beton), "train_images": len(seen), "steps": steps, "seed": seed,
                  "batch_size": batch_size, "lr": lr, "final_loss": float(loss.detach()),
                  "held_out": held.tolist()}
    return judge.eval()


@torch.no_grad()
def accuracy(judge: Judge, images_u8: torch.Tensor, labels: torch.Tensor) -> float:
    return float((judge.predict(images_u8) == labels.to(judge.head.weight.device)).float().mean())


def save_judge(judge: Judge, path: str | Path) -> None:
    """Weights, architecture and training record, written atomically."""
    atomic_torch_save({"config": judge.config, "state_dict": judge.state_dict(), "info": getattr(judge, "info", {})},
                      Path(path))


def load_judge(path: str | Path, device: torch.device | str) -> Judge:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"judge {path} not found; train one with `python -m benchmarks.quality.digits` or "
                                f"ffcv_ddpm.quality.train_judge + save_judge")
    state = torch.load(path, map_location="cpu", weights_only=True)
    judge = Judge(**state["config"])
    judge.load_state_dict(state["state_dict"])
    judge.info = state["info"]
    return judge.to(device).eval()


@torch.no_grad()
def evaluate_samples(judge: Judge, images_u8: torch.Tensor, labels: torch.Tensor | None,
                     reference_images_u8: torch.Tensor) -> dict:
    """FD-digits of the samples to the reference set, and the share of samples the judge puts in their own class.

    labels: the class each sample was generated for (None for unconditional samples: cond_acc is None then)."""
    feats = judge.features(images_u8).double().cpu().numpy()
    ref = _reference_features(judge, reference_images_u8)
    cond_acc = None
    if labels is not None:
        cond_acc = accuracy(judge, images_u8, labels)
    return {"fd_digits": frechet_distance(feats, ref), "cond_acc": cond_acc, "n": len(images_u8)}


def _reference_features(judge: Judge, reference_images_u8: torch.Tensor) -> np.ndarray:
    """The judge's features of the reference set, computed once per (judge state, reference tensor): a study scores
    every row against the same set (the digits test split), and recomputing its features each time cost ~0.45 s a
    row on a CPU, most of a toy study's scoring. The key holds the tensors' identities, storage and version counters
    (an in-place update, a .to() or a train() step changes one), so a changed judge or set is embedded again."""
    state = [*judge.parameters(), *judge.buffers()]
    key = (reference_images_u8._version, reference_images_u8.data_ptr(), judge.training,
           tuple((t.data_ptr(), t._version) for t in state))
    cached = judge.__dict__.get("_reference_features")
    if cached is not None and cached[0] is reference_images_u8 and cached[1] == key:
        return cached[2]
    ref = judge.features(reference_images_u8).double().cpu().numpy()
    judge.__dict__["_reference_features"] = (reference_images_u8, key, ref)
    return ref


@torch.no_grad()
def fd_floor(judge: Judge, train_u8: torch.Tensor, train_labels: torch.Tensor, test_u8: torch.Tensor,
             n: int) -> dict | None:
    """FD-digits to the test set of n of the train images the judge held out (a class-balanced choice; all of them
    if it held out fewer, and "n" says how many), or None for a judge that held none out: the floor of images it
    trained on would be biased upwards (module docstring)."""
    held = np.asarray((getattr(judge, "info", None) or {}).get("held_out") or [], np.int64)
    if not len(held):
        return None
    if n < len(held):
        held = held[class_balanced_subset(train_labels[torch.from_numpy(held).to(train_labels.device)], n)]
    idx = torch.from_numpy(held).to(train_u8.device)
    return {"n": len(idx), "fd_digits": evaluate_samples(judge, train_u8[idx], None, test_u8)["fd_digits"]}


def class_balanced_subset(labels: np.ndarray | torch.Tensor, n: int, seed: int = 0) -> np.ndarray:
    """Indices of n images with the classes as equal as possible (a seeded choice within each class)."""
    labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    per_class = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    take = [n // len(classes) + (i < n % len(classes)) for i in range(len(classes))]
    if any(t > len(p) for t, p in zip(take, per_class)):
        raise ValueError(f"cannot take {n} class-balanced images from {len(labels)}")
    return np.sort(np.concatenate([p[:t] for p, t in zip(per_class, take)]))
