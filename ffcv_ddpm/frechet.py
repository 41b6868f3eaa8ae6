"""The Fréchet distance between two feature sets, each summarised as a Gaussian (mean, covariance).

    d² = ||μ_a - μ_b||² + Tr(Σ_a) + Tr(Σ_b) - 2 Tr((Σ_a Σ_b)^½)

FID is this distance on Inception-v3 pool features (ffcv_ddpm.fid); FD-digits on the digits judge's penultimate
features (ffcv_ddpm.quality). The statistics are pytorch-fid's (float64 mean, `np.cov`). Where pytorch-fid takes
`scipy.linalg.sqrtm` of the product Σ_a Σ_b, this takes the trace as Σ √λ over the eigenvalues of the symmetric
Σ_a^½ Σ_b Σ_a^½, which has the same spectrum: the same number (tests/test_fid.py checks it against pytorch-fid and
against sqrtm), two symmetric eigendecompositions instead of a Schur decomposition (several times faster at 2048
dimensions), and no complex round-off or ε retry when the covariances are singular (fewer samples than dimensions).
Features against statistics with no more samples than dimensions (an evaluation's few hundred samples against the
reference) take an N x N route instead (frechet_distance_to_stats): the same number, milliseconds instead of ~2 s.
"""

from __future__ import annotations

import numpy as np


def gaussian_stats(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean (D,), covariance (D, D)) in float64 of features (N, D), N >= 2."""
    f = np.asarray(feats, dtype=np.float64)
    if f.ndim != 2 or len(f) < 2:
        raise ValueError(f"need features of shape (N >= 2, D), got {f.shape}")
    if not np.isfinite(f).all():
        raise ValueError("features contain NaN or inf")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def trace_sqrt_product(sigma_a: np.ndarray, sigma_b: np.ndarray) -> float:
    """Tr((Σ_a Σ_b)^½) of two covariance (symmetric PSD) matrices."""
    w, v = np.linalg.eigh(sigma_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T  # Σ_a^½; eigenvalues below 0 are round-off
    lam = np.linalg.eigvalsh(root_a @ sigma_b @ root_a)
    return float(np.sqrt(np.clip(lam, 0, None)).sum())


def _check_dimensions(mu_a: np.ndarray, sigma_a_shape: tuple, mu_b: np.ndarray, sigma_b_shape: tuple) -> None:
    if mu_a.shape != mu_b.shape or sigma_a_shape != sigma_b_shape:
        raise ValueError(f"statistics of different dimensions: means {mu_a.shape} vs {mu_b.shape}, "
                         f"covariances {sigma_a_shape} vs {sigma_b_shape}")


def frechet_distance_from_stats(mu_a: np.ndarray, sigma_a: np.ndarray, mu_b: np.ndarray,
                                sigma_b: np.ndarray) -> float:
    mu_a, mu_b = np.atleast_1d(mu_a), np.atleast_1d(mu_b)
    sigma_a, sigma_b = np.atleast_2d(sigma_a), np.atleast_2d(sigma_b)
    _check_dimensions(mu_a, sigma_a.shape, mu_b, sigma_b.shape)
    diff = mu_a - mu_b
    return float(diff @ diff + np.trace(sigma_a) + np.trace(sigma_b) - 2 * trace_sqrt_product(sigma_a, sigma_b))


def frechet_distance_to_stats(feats: np.ndarray, mu: np.ndarray, sigma: np.ndarray) -> float:
    """Fréchet distance between features (N, D) and a Gaussian (mu, sigma): frechet_distance_from_stats of the
    features' statistics, computed without them where N <= D. The features' covariance is then A^T A / (N - 1) (A the
    centred features, rank < N), and Tr((Σ A^T A / (N - 1))^½) is Σ √λ over the N x N A Σ A^T / (N - 1) (XY and YX
    share their non-zero eigenvalues): an (N, D) x (D, D) product where the general route takes two D x D
    eigendecompositions (~1.7 s a distance at D = 2048 on a CPU core: an evaluation of a few hundred samples)."""
    f = np.asarray(feats, dtype=np.float64)
    if f.ndim != 2 or not 2 <= len(f) <= f.shape[1] or not np.isfinite(f).all():
        return frechet_distance_from_stats(*gaussian_stats(f), mu, sigma)  # gaussian_stats names bad features
    mu_f = f.mean(axis=0)
    mu, sigma = np.atleast_1d(mu), np.atleast_2d(sigma)
    _check_dimensions(mu_f, (len(mu_f), len(mu_f)), mu, sigma.shape)  # the features' covariance is never formed
    a = f - mu_f
    lam = np.linalg.eigvalsh(a @ sigma @ a.T / (len(f) - 1))
    diff = mu_f - mu
    return float(diff @ diff + np.sum(a * a) / (len(f) - 1) + np.trace(sigma)
                 - 2 * np.sqrt(np.clip(lam, 0, None)).sum())


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (N_a, D) and (N_b, D)."""
    return frechet_distance_from_stats(*gaussian_stats(feats_a), *gaussian_stats(feats_b))
