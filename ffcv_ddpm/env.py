"""What produced a result (code version, software stack, hardware), and where compiled kernels are kept.

Every run folder and benchmark result carries environment(), so a number can be traced to the commit, card and
library versions that gave it. Each probe degrades to None instead of failing (no git, no CUDA, no FFCV).

compile_cache() points inductor's and Triton's on-disk caches at one folder that outlives the process (the project's
.compile-cache/, git-ignored): a second process compiling the same graph (the next bench row, the trainer after the
bench, tomorrow's run) loads it in seconds instead of compiling for 60-95 s.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent

CACHE_ENV = "FFCV_DDPM_CACHE"  # the user's choice of the cache folder (inductor/ and triton/ go under it)
# Each tool's own variable, when the user set it, wins over CACHE_ENV and the default: (variable, subfolder).
_CACHE_VARS = (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))
_cache: dict | None = None  # what compile_cache() decided, once per process


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict:
    """Commit hash and whether tracked files differ from it (None for both outside a git checkout).

    A copy of the tree shipped to another machine may carry no .git, or a stale one: there the sender names the
    commit it copied in FFCV_DDPM_COMMIT, which wins and is recorded as declared, not verified."""
    declared = os.environ.get("FFCV_DDPM_COMMIT")
    if declared:
        return {"commit": declared, "dirty": None, "commit_source": "declared (FFCV_DDPM_COMMIT), not verified"}
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "commit_source": "no git checkout"}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status), "commit_source": "git"}


def _version(dist: str) -> str | None:
    # Installed-package metadata, not module.__version__: ffcv 1.0.2 still says "0.0.3rc1" there, and importing
    # FFCV just to ask costs seconds.
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_count() -> int | None:
    # Cores this process may use (a container or taskset may allow fewer than the machine has).
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def umask() -> int:
    """This process's umask, read without changing it (os.umask reads only by setting, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _cache_root() -> tuple[Path, str]:
    """(folder, why that one): FFCV_DDPM_CACHE, else the project's .compile-cache/ if it can be written, else the
    user's cache folder ($XDG_CACHE_HOME or ~/.cache, /ffcv-ddpm) for a read-only checkout."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser().resolve(), CACHE_ENV
    project = _REPO / ".compile-cache"
    try:
        project.mkdir(exist_ok=True)
        if os.access(project, os.W_OK):
            return project, "project folder"
    except OSError:
        pass
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "ffcv-ddpm", "user cache folder (the checkout is not writable)"


def compile_cache() -> dict:
    """Sets TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (for this process and the processes it starts) to
    <cache folder>/inductor and /triton, unless already set; returns those folders and where each choice came from
    ({"inductor", "inductor_source", "triton", "triton_source"}).

    Call it before anything compiles: inductor writes its /tmp default into TORCHINDUCTOR_CACHE_DIR the first time
    it asks, after which that would look like the user's choice. The entry points call it first (train, bench and
    its row processes, numerics, trainer_vs_bench; their child processes inherit the variables), and so do
    step.build and sampling.compile_denoiser, where every compilation of this project starts (profile, sweeps,
    the quality reports). The first call decides; later ones return the same."""
    global _cache
    if _cache is None:
        root, source = _cache_root()
        _cache = {}
        for var, sub in _CACHE_VARS:
            if os.environ.get(var):  # the user's (or the parent process's, which made the same choice)
                _cache[sub], _cache[f"{sub}_source"] = os.environ[var], var
            else:
                _cache[sub] = os.environ[var] = str(root / sub)
                _cache[f"{sub}_source"] = source
    return dict(_cache)


def cache_size(dirs: dict) -> dict:
    """Files and bytes in the compile cache folders now: 0 files is a cold cache (the first step compiles)."""
    files = size = 0
    for sub in ("inductor", "triton"):
        for folder, _, names in os.walk(dirs[sub]):
            for name in names:
                try:
                    size += os.stat(os.path.join(folder, name)).st_size
                    files += 1
                except OSError:  # a file another process is replacing right now
                    pass
    return {"files": files, "bytes": size}


def _cuda() -> dict:
    import torch

    info = {
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,  # the CUDA version torch was built with
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu_count": 0,
        "gpus": [],
        "driver": None,
    }
    if info["cuda_available"]:
        info["gpu_count"] = torch.cuda.device_count()
        for i in range(info["gpu_count"]):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}"}
            )
        info["driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:  # no NVML library or no permission: the driver version is nice to have, not required
        return None


def environment() -> dict:
    """Commit, date (UTC), Python/torch/CUDA/cuDNN/FFCV/numpy versions, GPUs and CPU count."""
    import torch

    return {
        **git_state(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "torch": torch.__version__,
        **_cuda(),
        "cpu_count": cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "numpy": _version("numpy"),
        "ffcv": _version("ffcv"),
    }


if __name__ == "__main__":
    import json

    from ffcv_ddpm.checks import Parser

    Parser(prog="python -m ffcv_ddpm.env", doc="Print what produced a result (commit, versions, GPUs) as JSON.\n\n"
           "    python -m ffcv_ddpm.env                 # FFCV_DDPM_COMMIT=<sha> names a commit git cannot see",
           epilog="No --data and no KEY=VALUE overrides: nothing is read but this machine.").parse_args()
    print(json.dumps(environment(), indent=2))
