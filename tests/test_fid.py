"""The Fréchet distance against closed forms and scipy's sqrtm; FID's whole path (data -> Inception features ->
cached reference statistics -> distance) with a randomly initialised Inception on small generated images; the
weights come from a local file or a checked download into the torch hub cache (the network replaced here), and
offline their absence is one clear message."""
from __future__ import annotations


from unittest import mock

import numpy as np
import pytest
import scipy.linalg
import torch

from ffcv_ddpm import fid
from ffcv_ddpm.frechet import frechet_distance, frechet_distance_from_stats, frechet_distance_to_stats, gaussian_stats


def random_spd(rng, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


def reference_fd(mu_a, s_a, mu_b, s_b) -> float:
    """The symmetric form Tr((S_a^½ S_b S_a^½)^½), through scipy's sqrtm twice (not the code under test's product)."""
    root_a = scipy.linalg.sqrtm(s_a).real
    cross = scipy.linalg.sqrtm(root_a @ s_b @ root_a).real
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(s_a) + np.trace(s_b) - 2 * np.trace(cross))


def test_distance_of_a_set_to_itself_is_zero():
    feats = np.random.default_rng(0).normal(size=(300, 16)) * np.linspace(0.5, 3, 16) + 7
    assert abs(frechet_distance(feats, feats)) < 1e-8 * np.trace(np.cov(feats, rowvar=False))
    assert frechet_distance(feats, feats + 0.5) == pytest.approx(16 * 0.25, rel=1e-6)  # shifted: only the means move


def test_known_gaussians_match_scipy_sqrtm_and_closed_forms():
    rng = np.random.default_rng(1)
    d = 12
    mu_a, mu_b = rng.normal(size=d), rng.normal(size=d)
    s_a, s_b = random_spd(rng, d), random_spd(rng, d)
    exact = reference_fd(mu_a, s_a, mu_b, s_b)
    assert exact > 1.0
    assert frechet_distance_from_stats(mu_a, s_a, mu_b, s_b) == pytest.approx(exact, rel=1e-8)
    # Diagonal covariances: Σ (√a - √b)², no matrix function at all.
    va, vb = rng.uniform(0.2, 3, d), rng.uniform(0.2, 3, d)
    diag = np.sum((mu_a - mu_b) ** 2) + np.sum((np.sqrt(va) - np.sqrt(vb)) ** 2)
    assert frechet_distance_from_stats(mu_a, np.diag(va), mu_b, np.diag(vb)) == pytest.approx(diag, rel=1e-9)
    # From samples: converges to the exact value (sampling error of the covariances ~ d / sqrt(N)).
    n = 200_000
    xa = rng.multivariate_normal(mu_a, s_a, size=n)
    xb = rng.multivariate_normal(mu_b, s_b, size=n)
    assert frechet_distance(xa, xb) == pytest.approx(exact, rel=0.02)


_SQRTM = scipy.linalg.sqrtm


def _sqrtm_with_disp(m, disp=True):
    """pytorch-fid 0.3.0 calls scipy.linalg.sqrtm(m, disp=False) for (root, error estimate); SciPy 1.18 (the GPU
    machine's) removed `disp`. The same root, in the form it expects."""
    return _SQRTM(m), 0.0


def test_matches_pytorch_fid_and_survives_a_singular_product():
    fid.pytorch_fid_inception()  # imports torchvision the way that works beside a CPU-only torch
    from pytorch_fid.fid_score import calculate_frechet_distance

    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(50, 8)), rng.normal(size=(60, 8)) * 1.5 + 0.3
    ours = frechet_distance(a, b)
    with mock.patch("pytorch_fid.fid_score.linalg.sqrtm", _sqrtm_with_disp):
        theirs = calculate_frechet_distance(*gaussian_stats(a), *gaussian_stats(b))
    assert ours == pytest.approx(theirs, rel=1e-9)
    # Fewer samples than dimensions: singular covariances, where the sqrtm of the product is least accurate.
    few_a, few_b = rng.normal(size=(5, 20)), rng.normal(size=(6, 20)) + 1
    s_a, s_b = np.cov(few_a, rowvar=False), np.cov(few_b, rowvar=False)
    assert frechet_distance(few_a, few_b) == pytest.approx(
        reference_fd(few_a.mean(0), s_a, few_b.mean(0), s_b), rel=1e-6)
    assert abs(frechet_distance(few_a, few_a)) < 1e-6 * np.trace(s_a)  # √ of round-off-sized eigenvalues
    with pytest.raises(ValueError, match="N >= 2"):
        gaussian_stats(np.zeros((1, 4)))
    with pytest.raises(ValueError, match="different dimensions"):
        frechet_distance(a, b[:, :4])


def test_features_against_statistics_take_the_few_samples_route_to_the_same_number():
    """frechet_distance_to_stats: with N <= D the N x N route, with N > D the general one; both the distance of the
    features' own statistics (rank-deficient, as 10 samples in 2048 dimensions are), and bad features named."""
    rng = np.random.default_rng(3)
    d = 40
    mu, sigma = rng.normal(size=d), random_spd(rng, d)
    for n in (2, 10, d, 3 * d):
        f = rng.normal(size=(n, d)) * np.linspace(0.2, 4, d) + 5
        want = frechet_distance_from_stats(*gaussian_stats(f), mu, sigma)
        # The general route takes √ of the rank-deficient product's round-off-sized eigenvalues (~1e-5 in all here)
        assert frechet_distance_to_stats(f, mu, sigma) == pytest.approx(want, rel=1e-7), n
    with pytest.raises(ValueError, match="N >= 2"):
        frechet_distance_to_stats(np.zeros((1, d)), mu, sigma)
    with pytest.raises(ValueError, match="NaN or inf"):
        frechet_distance_to_stats(np.full((3, d), np.nan), mu, sigma)
    with pytest.raises(ValueError, match="different dimensions"):
        frechet_distance_to_stats(f[:5, :8], mu, sigma)


# ---------------------------------------------------------------------------------------------------------------
# The Inception path

@pytest.fixture(scope="module")
def inception():
    return fid.load_inception(random_init_seed=0)


def test_random_inception_features_are_the_package_preprocessing(inception, small_dataset_arrays):
    images = torch.from_numpy(small_dataset_arrays.test.images[:4]).permute(0, 3, 1, 2)
    feats = fid.inception_features(inception, images, batch_size=3)
    assert feats.shape == (4, fid.FEATURE_DIM) and feats.dtype == np.float64 and np.isfinite(feats).all()
    assert feats.std(axis=0).mean() > 1e-3  # different images, different features (the network is not dead)
    # pytorch-fid's own route: ToTensor ([0, 1]) then the network's resize and rescale.
    with torch.no_grad():
        direct = inception(images.float() / 255)[0].flatten(1).double().numpy()
    np.testing.assert_allclose(feats, direct, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="uint8"):
        fid.inception_features(inception, images.float())


def test_reference_stats_are_cached_by_content_beside_the_data(inception, small_dataset, small_dataset_arrays,
                                                               tmp_path):
    from PIL import Image

    beton = small_dataset / "cifar10_test_raw.beton"
    tag = fid.network_tag(random_init_seed=0)
    first = fid.reference_stats(beton, inception, tag, batch_size=16, max_images=6)
    assert not first["cached"] and first["n"] == 6
    cache = fid.stats_cache_path(beton, first["content_sha256"], 6, tag)
    assert first["cache"] == str(cache) and cache.parent == small_dataset and cache.is_file()
    again = fid.reference_stats(beton, inception, tag, max_images=6)
    assert again["cached"]
    np.testing.assert_array_equal(again["sigma"], first["sigma"])
    # The same pixels as a PNG folder: the same content hash (the statistics key is the pixels, not the file).
    png = tmp_path / "test_png"
    png.mkdir()
    for i, im in enumerate(small_dataset_arrays.test.images[:6]):
        Image.fromarray(im).save(png / f"{i + 1}.png")
    assert fid.content_sha256(fid.read_images(png)) == first["content_sha256"]
    # A set against its own statistics is ~0; another set of the same kind is farther; noise farther still.
    same = torch.from_numpy(small_dataset_arrays.test.images[:6]).permute(0, 3, 1, 2)
    other = torch.from_numpy(small_dataset_arrays.train.images[:6]).permute(0, 3, 1, 2)
    noise = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    d_same, d_other, d_noise = (fid.fid_of_images(inception, x, first) for x in (same, other, noise))
    # 6 samples in 2048 dimensions: ~2043 zero eigenvalues, each contributing a √(round-off) of ~1e-8.
    assert abs(d_same) < 1e-5 * np.trace(first["sigma"])
    assert 0 < d_other < d_noise


def test_weights_from_a_local_file_and_one_line_without_them(tmp_path, monkeypatch, inception):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", _no_download)
    monkeypatch.setattr(fid.pytorch_fid_inception(), "load_state_dict_from_url", _no_download)
    expected = tmp_path / "torch" / "hub" / "checkpoints" / fid.WEIGHTS_NAME
    assert fid.default_weights_path() == expected
    with pytest.raises(fid.FIDError) as err:
        fid.load_inception()  # FFCV_DDPM_OFFLINE=1 (conftest): no download tried
    msg = str(err.value)
    assert "\n" not in msg and str(expected) in msg and fid.WEIGHTS_URL in msg and "FFCV_DDPM_OFFLINE=1" in msg
    # A file in the hub cache is used (here: the random network's weights saved under the real name).
    expected.parent.mkdir(parents=True)
    torch.save(fid.random_inception_state(0), expected)
    loaded = fid.load_inception()
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(fid.inception_features(loaded, x), fid.inception_features(inception, x))
    assert fid.network_tag().startswith("inception-")
    (tmp_path / "bad.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(fid.FIDError, match="do not load"):
        fid.load_inception(tmp_path / "bad.pth")


def _no_download(*args, **kwargs):
    raise AssertionError("FID tried to download its weights")


# ---- the download, with the network replaced -------------------------------------------------------------------

def test_the_url_and_hash_are_pytorch_fids():
    """The file pytorch-fid's own source names, and a whole SHA-256 that begins with the prefix its name carries
    (the prefix torch.hub would check)."""
    assert fid.WEIGHTS_URL == fid.pytorch_fid_inception().FID_WEIGHTS_URL
    prefix = torch.hub.HASH_REGEX.search(fid.WEIGHTS_NAME).group(1)
    assert prefix == "6726825d" and fid.WEIGHTS_URL.endswith(f"-{prefix}.pth")
    assert len(fid.WEIGHTS_SHA256) == 64 and fid.WEIGHTS_SHA256.startswith(prefix)
    int(fid.WEIGHTS_SHA256, 16)  # hex digits


class FakeNetwork:
    """urlopen for WEIGHTS_URL: serves `payload`, or raises `error`; counts the calls."""

    def __init__(self, payload: bytes = b"", error: Exception | None = None):
        self.payload, self.error, self.calls = payload, error, []

    def __call__(self, url, timeout=None):
        import io

        self.calls.append(url)
        if self.error is not None:
            raise self.error
        return io.BytesIO(self.payload)


@pytest.fixture
def online(tmp_path, monkeypatch):
    """A hub cache in tmp_path, downloads allowed, and the random network's weights as what the URL serves."""
    import hashlib
    import io

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv(fid.OFFLINE_ENV)
    buf = io.BytesIO()
    torch.save(fid.random_inception_state(0), buf)
    payload = buf.getvalue()
    network = FakeNetwork(payload)
    monkeypatch.setattr(fid, "_urlopen", network)
    # The real file's hash cannot be matched by other bytes: the test file's own hash stands in for it.
    monkeypatch.setattr(fid, "WEIGHTS_SHA256", hashlib.sha256(payload).hexdigest())
    return network


def test_weights_are_fetched_once_into_the_hub_cache(online, inception, capsys):
    loaded = fid.load_inception()
    assert online.calls == [fid.WEIGHTS_URL] and fid.default_weights_path().is_file()
    assert "downloading the Inception weights (once)" in capsys.readouterr().err
    x = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(fid.inception_features(loaded, x), fid.inception_features(inception, x))
    fid.load_inception()
    fid.network_tag()
    assert len(online.calls) == 1  # from the cache from now on
    assert [p.name for p in fid.default_weights_path().parent.iterdir()] == [fid.WEIGHTS_NAME]  # no temp file left


def test_a_download_with_another_hash_is_not_kept(online, monkeypatch):
    """The whole SHA-256 is checked: a file whose digest shares the first 8 hex digits (all the name carries) but
    not the rest is refused."""
    digest = fid.hashlib.sha256(online.payload).hexdigest()
    other = digest[:8] + ("0" if digest[8] != "0" else "1") + digest[9:]
    monkeypatch.setattr(fid, "WEIGHTS_SHA256", other)
    with pytest.raises(fid.FIDError) as err:
        fid.load_inception()
    msg = str(err.value)
    assert "\n" not in msg and f"has SHA-256 {digest}, not {other}" in msg and "not kept" in msg
    assert list(fid.default_weights_path().parent.iterdir()) == []  # neither under its name nor a temp name
    monkeypatch.setattr(fid, "WEIGHTS_SHA256", digest)
    fid.load_inception()  # the next try downloads again, and keeps the right file
    assert len(online.calls) == 2 and fid.default_weights_path().is_file()


def test_offline_is_one_line_naming_the_file_and_where_to_put_it(online, tmp_path):
    import urllib.error

    online.error = urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    with pytest.raises(fid.FIDError) as err:
        fid.load_inception()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"Inception weights {fid.default_weights_path()} not found")
    assert "name resolution" in msg and fid.WEIGHTS_URL in msg and "--weights" in msg
    assert list(fid.default_weights_path().parent.iterdir()) == []
    # --weights PATH is used as given: a missing one is never downloaded in its place.
    with pytest.raises(fid.FIDError, match="--weights"):
        fid.load_inception(tmp_path / "elsewhere.pth")
    assert len(online.calls) == 1
