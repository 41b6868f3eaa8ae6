"""FID: Fréchet distance of Inception-v3 pool features, as the published CIFAR-10 numbers compute it.

    model = load_inception(weights=None, device="cuda")     # pytorch-fid's port of the TF FID network
    ref = reference_stats("data/cifar10_train_raw.beton", model, device)   # cached beside the data
    fid = fid_of_images(model, samples_u8, ref)             # samples: uint8 (N, 3, H, W), on any device

The network and its preprocessing are pytorch-fid's (the package DDPM-family papers report): uint8 -> [0, 1] as
its ToTensor gives, then inside the network a bilinear resize to 299x299 and [0, 1] -> [-1, 1]; the 2048-d features
after the last average pool. Its weights come from a path given (--weights), or from the torch hub cache, where
pytorch-fid itself would put them: fetched there once when missing (fetch_weights: pytorch-fid's URL, the file's
full SHA-256 checked before it takes its final name). Offline, or with FFCV_DDPM_OFFLINE=1,
this fails with one message naming the file and where to put it. The model constructor never downloads: pytorch-fid
would otherwise fetch the file from inside it, unchecked.
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.request
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch import nn

from ffcv_ddpm.checkpoint import staged_file
from ffcv_ddpm.frechet import frechet_distance_to_stats, gaussian_stats

WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"  # pytorch-fid's port of the TF Inception of FID
WEIGHTS_URL = f"https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/{WEIGHTS_NAME}"  # its source's
# The file's whole SHA-256. Its name carries the first 8 hex digits only (torch.hub's convention; pytorch-fid does
# not check even those): 32 bits, which a substituted file can be brute-forced to match. The digest as independent
# public projects pin it for this file (and for torch-fidelity's copy of it); the tests check that it begins with
# the name's digits.
WEIGHTS_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
OFFLINE_ENV = "FFCV_DDPM_OFFLINE"  # =1: never download (the tests set it; so can a machine without network)
_urlopen = urllib.request.urlopen  # the network, in one place (tests replace it)
FEATURE_DIM = 2048
STATS_VERSION = 1  # bump when the cached statistics change for the same data and network
_torchvision_ops_stub = []  # keeps the stub library alive (a Library's definitions go with it)


class FIDError(ValueError):
    """A problem the user fixes (missing weights, unreadable data); the message says how. A ValueError, so the
    trainer reports it as one line like its other configuration errors."""


def default_weights_path() -> Path:
    """Where pytorch-fid's own download would land: the torch hub cache ($TORCH_HOME/hub/checkpoints)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_NAME


def resolve_weights(path: str | os.PathLike | None = None) -> Path:
    """The weights file: `path` as given (never downloaded), else the hub cache's, fetched there first if missing."""
    if path:
        if not Path(path).is_file():
            raise FIDError(f"Inception weights {path} not found (--weights); {_where_to_put_them()}")
        return Path(path)
    p = default_weights_path()
    return p if p.is_file() else fetch_weights(p)


def _where_to_put_them() -> str:
    return (f"fetch {WEIGHTS_URL} on a machine with network and put it at {default_weights_path()}, or pass its "
            f"path (--weights)")


def fetch_weights(dest: Path) -> Path:
    """pytorch-fid's weights downloaded to `dest`, once: streamed to a temp name beside it and renamed only after its
    SHA-256 matched WEIGHTS_SHA256, so `dest` never holds a partial or a wrong file. FIDError (one line) offline,
    with FFCV_DDPM_OFFLINE=1, or when the hash differs."""
    if os.environ.get(OFFLINE_ENV) == "1":
        raise FIDError(f"Inception weights {dest} not found ({OFFLINE_ENV}=1: no download); {_where_to_put_them()}")
    print(f"fid: downloading the Inception weights (once) from {WEIGHTS_URL} to {dest}", file=sys.stderr, flush=True)
    digest = hashlib.sha256()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with staged_file(dest) as f, _urlopen(WEIGHTS_URL, timeout=60) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
            if digest.hexdigest() != WEIGHTS_SHA256:
                raise FIDError(f"the file downloaded from {WEIGHTS_URL} has SHA-256 {digest.hexdigest()}, not "
                               f"{WEIGHTS_SHA256}: not kept; {_where_to_put_them()}")
    except OSError as e:  # no network (URLError), a timeout, an HTTP error, an unwritable cache
        raise FIDError(f"Inception weights {dest} not found and the download failed ({getattr(e, 'reason', e)}); "
                       f"{_where_to_put_them()}") from None
    return dest


def pytorch_fid_inception():
    """pytorch_fid.inception, importable also where torchvision's C ops cannot load.

    PyPI's torchvision is a CUDA build; beside a CPU-only torch its C extension does not load, and torchvision 0.28
    then fails at import registering fake kernels for nms and qnms without checking for them (its other ops are
    checked). Declaring those two schemas lets the import finish; FID calls no torchvision op."""
    try:
        import torchvision  # noqa: F401
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
        lib = torch.library.Library("torchvision", "FRAGMENT")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _torchvision_ops_stub.append(lib)
        import torchvision  # noqa: F401
    from pytorch_fid import inception

    return inception


def load_inception(weights: str | os.PathLike | None = None, device: torch.device | str = "cpu",
                   random_init_seed: int | None = None) -> nn.Module:
    """pytorch-fid's InceptionV3 (2048-d pool features) in eval mode on `device`.

    random_init_seed: torchvision's initialisation instead of the FID weights, for testing the path without the
    file; its numbers are not FID."""
    inception = pytorch_fid_inception()
    if random_init_seed is not None:
        state = random_inception_state(random_init_seed)
    else:
        path = resolve_weights(weights)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file fails in many ways
            raise FIDError(f"Inception weights {path} do not load ({type(e).__name__}: {e}); "
                           f"replace the file with {WEIGHTS_URL}") from None
    # pytorch-fid loads its weights by URL inside the constructor: hand it the state read above instead.
    with mock.patch.object(inception, "load_state_dict_from_url", lambda *args, **kwargs: state):
        try:
            model = inception.InceptionV3([inception.InceptionV3.BLOCK_INDEX_BY_DIM[FEATURE_DIM]])
        except RuntimeError as e:
            raise FIDError(f"the Inception weights do not fit pytorch-fid's network ({str(e)[:200]}); "
                           f"use {WEIGHTS_NAME} from {WEIGHTS_URL}") from None
    # channels_last: oneDNN's (CPU) and cuDNN's fastest convolutions; 4.5x faster on a 2-core CPU, same features.
    return model.eval().to(device, memory_format=torch.channels_last)


def random_inception_state(seed: int) -> dict:
    """A state dict with the FID weights' names and shapes, randomly initialised (for tests: not FID)."""
    import torchvision

    pytorch_fid_inception()  # torchvision, importable
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The FID network is torchvision's Inception-v3 with blocks that differ only in forward.
        net = torchvision.models.inception_v3(num_classes=1008, aux_logits=False, weights=None, init_weights=False)
        # He init keeps activations near unit scale through ~90 conv-BN-ReLU layers whose BN, in eval mode with
        # fresh running statistics, normalises nothing (torchvision's own init gives features ~1e10).
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
        return net.state_dict()


def network_tag(weights: str | os.PathLike | None = None, random_init_seed: int | None = None) -> str:
    """Names the feature network in cache keys and results: the weights file's hash, or the random seed."""
    if random_init_seed is not None:
        return f"random-inception-seed{random_init_seed}"
    h = hashlib.sha256()
    with open(resolve_weights(weights), "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return f"inception-{h.hexdigest()[:12]}"


@torch.no_grad()
def inception_features(model: nn.Module, images_u8: torch.Tensor, batch_size: int = 200) -> np.ndarray:
    """Pool features (N, 2048) float64 of uint8 images (N, 3, H, W), batched on the network's device.

    Runs in true fp32 (TF32 off, no autocast), as the published TF numbers did."""
    if images_u8.dtype != torch.uint8 or images_u8.dim() != 4 or images_u8.shape[1] != 3:
        raise ValueError(f"need uint8 images (N, 3, H, W), got {images_u8.dtype} {tuple(images_u8.shape)}")
    device = next(model.parameters()).device
    old_matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False), torch.autocast(device.type, enabled=False):
            feats = [model(chunk.to(device, non_blocking=True).float() / 255)[0].flatten(1)  # (B, 2048, 1, 1) -> (B, 2048)
                     for chunk in images_u8.split(batch_size)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_matmul
    return torch.cat(feats).double().cpu().numpy()  # one device->host copy for the whole set


# ---- reference statistics of a dataset, cached beside it ---------------------------------------------------------

def read_images(path: str | os.PathLike) -> np.ndarray:
    """All images (N, H, W, 3) uint8 of a .beton or of a folder of PNGs (file-name order, numbers numerically)."""
    p = Path(path)
    if p.is_dir():
        from PIL import Image

        files = sorted(p.glob("*.png"), key=lambda f: (not f.stem.isdigit(), int(f.stem) if f.stem.isdigit() else 0,
                                                       f.name))
        if not files:
            raise FIDError(f"{p} has no .png files")
        arrays = []
        for f in files:
            with Image.open(f) as im:
                arrays.append(np.asarray(im.convert("RGB")))
        if len({a.shape for a in arrays}) != 1:
            raise FIDError(f"{p}: the PNGs differ in size; FID statistics need one size")
        return np.stack(arrays)
    from ffcv_ddpm.data import read_beton

    try:
        return read_beton(p)[0]
    except (FileNotFoundError, ValueError) as e:
        raise FIDError(str(e)) from None


def content_sha256(images: np.ndarray) -> str:
    """Hash of the decoded pixels: the same for a .beton and its PNG export."""
    return hashlib.sha256(np.ascontiguousarray(images).data).hexdigest()


def stats_cache_path(data: Path, digest: str, n: int, tag: str) -> Path:
    data = Path(data)
    return data.parent / f"{data.stem if data.is_file() else data.name}.fid-{digest[:16]}-n{n}-{tag}.npz"


def reference_stats(data: str | os.PathLike, model: nn.Module, tag: str, batch_size: int = 200,
                    max_images: int | None = None) -> dict:
    """{"mu", "sigma", "n", "content_sha256", "cache", "cached"} of a dataset's features, from the .npz cache beside
    it when one matches (same pixels, network and image count), else computed and cached (atomic write)."""
    data = Path(data)
    images = read_images(data)[:max_images]
    digest = content_sha256(images)
    cache = stats_cache_path(data, digest, len(images), tag)
    if cache.is_file():
        with np.load(cache) as z:
            if int(z["version"]) == STATS_VERSION and str(z["content_sha256"]) == digest:
                return {"mu": z["mu"], "sigma": z["sigma"], "n": int(z["n"]), "content_sha256": digest,
                        "cache": str(cache), "cached": True}
    feats = inception_features(model, torch.from_numpy(images).permute(0, 3, 1, 2), batch_size)
    mu, sigma = gaussian_stats(feats)
    try:
        with staged_file(cache) as f:
            np.savez(f, mu=mu, sigma=sigma, n=len(images), content_sha256=digest, network=tag, version=STATS_VERSION)
    except OSError as e:  # a read-only data folder: the statistics are still right, only not kept
        print(f"fid: could not cache the reference statistics beside {data} ({e}); computing them each time")
    return {"mu": mu, "sigma": sigma, "n": len(images), "content_sha256": digest, "cache": str(cache),
            "cached": False}


def fid_of_images(model: nn.Module, images_u8: torch.Tensor, ref: dict, batch_size: int = 200) -> float:
    """FID of uint8 images (N, 3, H, W) against reference statistics from reference_stats."""
    return frechet_distance_to_stats(inception_features(model, images_u8, batch_size), ref["mu"], ref["sigma"])
