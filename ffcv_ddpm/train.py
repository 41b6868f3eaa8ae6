"""Train a diffusion model (DDPM, or a VE-SDE with diffusion.process=ve) on an FFCV .beton, one readable function.

    python -m ffcv_ddpm.train --preset ddpm-cifar10 --data data data.batch_size=256   # data/cifar10_train_raw.beton
    python -m ffcv_ddpm.train --resume runs/00003-ddpm-cifar10        # continue from the newest complete checkpoint
    torchrun --nproc_per_node 4 -m ffcv_ddpm.train --preset ddpm-cifar10 --data ...   # DDP, batch_size per GPU

Every run writes runs/<id>-<preset>[-desc]/: config.json, environment.json, stats.jsonl (one line per log interval),
samples-*.png and ckpt-*.pt (atomic, newest K kept); with train.tensorboard=True also tensorboard/ (ffcv_ddpm.tblog).
Two speeds per stats line: img_per_s, the interval's images over its timed steps (CUDA events, data wait included),
and img_per_s_wall, the same images over the wall time since the previous line, which adds what runs between the
steps: the log interval's syncs and all-gathers, checkpoints, sample grids, evaluations.
A run folder has one trainer at a time (its .lock: ffcv_ddpm.folder_lock). --resume refuses, in one line and before it
writes anything, what cannot continue the run: another preset, data or model weights' shape, train.steps below its
newest checkpoint, a run whose checkpoints all fail to load (a damaged one is set aside as *.corrupt).
"""

import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from ffcv_ddpm import stopping

# Before the imports below (seconds of torch): a signal while they run gets its line (`python -m ffcv_ddpm.train`).
if __name__ == "__main__":
    stopping.catch_early("train", "start-up, before step 1")

import numpy as np
import torch
import torch.distributed as dist

from ffcv_ddpm.checks import Parser, check_out_dir, fail
from ffcv_ddpm.checkpoint import CheckpointError, list_checkpoints, load_latest, save_checkpoint
from ffcv_ddpm.config import RunConfig, apply_override, check_config, load_config
from ffcv_ddpm.data import check_dataset, dataset_info, endless, make_loader, train_beton
from ffcv_ddpm.diffusion import save_grid
from ffcv_ddpm.env import compile_cache, environment
from ffcv_ddpm.evaluate import Evaluator
from ffcv_ddpm.folder_lock import FolderInUse, lock_folder, unlock_folder
from ffcv_ddpm.sampling import compile_denoiser
from ffcv_ddpm.sde_sampling import sample
from ffcv_ddpm.step import (AMP_DTYPES, Dist, Trainer, TrainingError, build, make_step, noise_seed, resolve_device,
                            set_precision)
from ffcv_ddpm.stopping import Interrupted, Stop
from ffcv_ddpm.tblog import TensorBoardLog, missing_package
from ffcv_ddpm.telemetry import GpuTelemetry, plot_telemetry
from ffcv_ddpm.timing import GcPauses, freeze_garbage, timed_steps, unfreeze_garbage
from ffcv_ddpm.unet import ModelConfig, build_model

# NVLink multicast (NVLS) can take a shared multi-GPU host's GPUs out of service: keep it off in NCCL, PyTorch's
# symmetric memory and NVSHMEM, in this process and every child. FFCV_DDPM_ALLOW_NVLS=1 leaves the environment alone.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_distributed(device: str = "auto") -> Dist:
    """Join torchrun's process group (NCCL for ranks on GPUs, gloo for ranks on the CPU, as train.device says);
    a plain single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Dist()
    if os.environ.get("FFCV_DDPM_ALLOW_NVLS") != "1":
        os.environ.update(NO_MULTICAST)
    ddp = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), world_size)
    # The device's type, not whether the machine has a GPU: train.device=cpu on a GPU host needs gloo (NCCL
    # cannot all-reduce CPU tensors).
    backend = "nccl" if resolve_device(device, ddp).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(ddp.local_rank)
    dist.init_process_group(backend)
    global _GLOO
    _GLOO = backend == "gloo"
    return ddp


_GLOO = False  # this process joined a gloo group (see the end of the file)


def largest_fitting_batch(step: Callable, device: torch.device, batch_size: int, image_size: int) -> int | None:
    """Halve the batch until one training step fits; None if even 1 does not."""
    bs = batch_size // 2
    while bs >= 1:
        try:
            images = torch.randint(0, 256, (bs, 3, image_size, image_size), dtype=torch.uint8, device=device)
            labels = torch.randint(0, 10, (bs,), device=device)
            step(images, labels, 0.0)
            return bs
        except torch.cuda.OutOfMemoryError:
            bs //= 2
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return None


def lr_at(step: int, cfg) -> float:
    return cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup_steps))


def new_run_dir(cfg: RunConfig) -> Path:
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    while True:
        ids = [int(m.group(1)) for p in out.iterdir() if (m := re.match(r"^(\d{5})-", p.name))]
        name = f"{max(ids, default=-1) + 1:05d}-{cfg.preset}" + (f"-{cfg.train.desc}" if cfg.train.desc else "")
        run_dir = out / name
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:  # another trainer took this number between our listing and our mkdir
            continue


def lock_run(run_dir: Path) -> None:
    """The run folder is this trainer's alone (ffcv_ddpm.folder_lock): a second trainer, a resume of a run still
    training included, stops with one line naming the first's pid."""
    try:
        lock_folder(run_dir)
    except FolderInUse as e:
        raise TrainingError(str(e)) from None


def saved_config(run_dir: Path) -> RunConfig:
    """The config.json of a run folder (the config its newest checkpoint was trained with)."""
    saved = Path(run_dir) / "config.json"
    if not saved.is_file():
        raise TrainingError(f"--resume {run_dir}: no config.json there; give a run folder made by train")
    return RunConfig.from_dict(json.loads(saved.read_text()))


def write_run_files(run_dir: Path, cfg: RunConfig, ddp: Dist) -> None:
    """config.json and environment.json: at a new run's start; on resume only once the checkpoint has loaded with
    cfg, so that a config that cannot continue the run never replaces the one that can."""
    write_json(run_dir / "config.json", cfg.to_dict())
    dataset = dataset_info(cfg.data.path) if cfg.data.loader != "torch-files" else {"png_dir": cfg.data.png_dir}
    write_json(run_dir / "environment.json", {**environment(), "world_size": ddp.world_size,
                                              "multicast_env": {k: os.environ.get(k) for k in NO_MULTICAST},
                                              "dataset": dataset})


def resume_point(cfg: RunConfig, run_dir: Path, main: bool) -> dict:
    """{"state", "path"} of the checkpoint the run continues from (state None: none yet, start at step 0), read on
    the CPU once cfg is known to continue that run: the same preset, data, model weights and process as the
    checkpoint's own config (config.json's without a checkpoint), and train.steps not below its step. TrainingError
    naming what differs otherwise. `main`: the folder's writer, who sets damaged checkpoints aside."""
    try:
        state, path = load_latest(run_dir, map_location="cpu", set_aside=main)
    except CheckpointError as e:
        raise TrainingError(f"{e}; a run that has trained is not started again from step 0: start a new run, or "
                            "put a good checkpoint back") from None
    run = RunConfig.from_dict(state["config"]) if state is not None else saved_config(run_dir)
    where = path or run_dir / "config.json"
    if cfg.preset != run.preset:
        raise TrainingError(f"preset {cfg.preset!r}: {run_dir} is a {run.preset!r} run ({where.name}); a resumed run "
                            "keeps its preset: drop --preset, or start a new run")
    if not same_data(run_dir, run.data.path, cfg.data.path):
        raise TrainingError(f"data.path={cfg.data.path}: {run_dir} trained on {run.data.path} ({where.name}); a "
                            "resumed run keeps its data: drop --data, or start a new run")
    if why := weights_change(run.model, cfg.model):
        raise TrainingError(f"{why} ({where.name}); a resumed run keeps its model: drop the override, or start a new "
                            "run")
    for field in ("process", "param", "sigma_data"):  # what the network's output means: a resume cannot change it
        was, now = getattr(run.diffusion, field), getattr(cfg.diffusion, field)
        if was != now:
            raise TrainingError(f"{where} was trained with diffusion.{field}={was!r}; a run cannot continue as "
                                f"{now!r}: drop the override or start a new run")
    if state is not None:
        if state["step"] > cfg.train.steps:
            raise TrainingError(f"train.steps={cfg.train.steps} is below step {state['step']} of {path}, the run's "
                                f"newest checkpoint; a run does not go back: give train.steps >= {state['step']}, "
                                "or start a new run")
        if cfg.train.ema_decay > 0 and state.get("ema") is None:
            raise TrainingError(f"train.ema_decay={cfg.train.ema_decay}: {path} holds no EMA weights (the run has "
                                "train.ema_decay=0); drop the override, or start a new run")
    return {"state": state, "path": path}


def same_data(run_dir: Path, before: str, now: str) -> bool:
    """The same .beton, by path, or moved: the same file (sha256) as the manifests record it, the run's as its
    environment.json has it (train.write_run_files)."""
    if Path(before).resolve() == Path(now).resolve():
        return True
    env = run_dir / "environment.json"
    recorded = json.loads(env.read_text()).get("dataset") if env.is_file() else None
    manifest = Path(now).parent / "manifest.json"
    if not recorded or not recorded.get("manifest") or not manifest.is_file():
        return False
    sha = lambda m, path: m.get("files", {}).get(Path(path).name, {}).get("sha256")  # noqa: E731
    recorded_sha = sha(recorded["manifest"], recorded["path"])
    return recorded_sha is not None and recorded_sha == sha(json.loads(manifest.read_text()), now)


def weights_change(before: ModelConfig, now: ModelConfig) -> str | None:
    """What a change of the model config does to its weights' names and shapes (models built on the meta device:
    no memory, no time), in words; None if it changes neither."""
    changed = [f.name for f in dataclasses.fields(now) if getattr(now, f.name) != getattr(before, f.name)]
    if not changed:
        return None
    with torch.device("meta"):
        shapes = [{k: tuple(v.shape) for k, v in build_model(m).state_dict().items()} for m in (before, now)]
    if shapes[0] == shapes[1]:
        return None
    key = next(k for k in sorted(shapes[0].keys() | shapes[1].keys()) if shapes[0].get(k) != shapes[1].get(k))
    shape = lambda s: "x".join(map(str, s)) if s is not None else "absent"  # noqa: E731
    fields = ", ".join(f"model.{n}={getattr(now, n)} (the run's: {getattr(before, n)})" for n in changed)
    return (f"{fields} change{'s' if len(changed) == 1 else ''} the model's weights ({key}: "
            f"{shape(shapes[0].get(key))} in the run, {shape(shapes[1].get(key))} now)")


def read_stats(run_dir: Path) -> list[dict]:
    """A run folder's stats.jsonl: one dict per log interval, oldest first."""
    return [json.loads(line) for line in (Path(run_dir) / "stats.jsonl").read_text().splitlines() if line.strip()]


def drop_stats_after(path: Path, step: int) -> None:
    """On resume: stats.jsonl keeps only the lines up to the checkpoint's step, so it stays one history (the lines
    a killed run logged after its last checkpoint are logged again by the resumed one)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(keep) != len(lines):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def rng_state(device: torch.device) -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


class StopRequest(Stop):
    """SIGTERM/SIGINT, by phase of the run (ffcv_ddpm.stopping: the handler only records the signal).

    start-up: nothing to save yet, so the next safe point (stop.check() between the sections of start-up) stops the
    run: Interrupted, exit 128 + signum. running: the loop looks at the signal between steps (checkpoint, exit 0); a
    second signal stops at once. stopping (the final checkpoint is being written, or the run is complete): further
    signals are ignored, so what is under way completes.
    """

    def __init__(self):
        super().__init__("train", where="start-up, before step 1")
        self.say = os.environ.get("RANK", "0") == "0"  # under torchrun one line that the stop is pending, not N
        self.run_dir = None  # the run folder once train() has it: a study that stops removes an unfinished one


def train(cfg: RunConfig, ddp: Dist = Dist(), stop: "StopRequest | None" = None,
          evaluator: "Callable[[torch.nn.Module, object], dict] | None" = None) -> Path:
    """Runs `cfg`; returns the run folder. `stop`: the caller's signal handling (else one is set up for the call).
    `evaluator`: called every train.eval_every steps instead of Evaluator(cfg), (sampling network, process) -> the
    stats it adds; a true "stop" among them ends the run there, with its checkpoint (one process only: the other
    ranks would not know; benchmarks.quality.race stops a run at its time budget so).

    Everything that can be checked is checked before the run folder exists; a new folder whose run stops before
    its first stats line or checkpoint is removed again, and the message says so.
    """
    # ---- set-up ---------------------------------------------------------------------------------------------
    check_config(cfg)
    if ddp.main and not cfg.train.resume:  # the new run folder's parent (a resumed run writes in its own folder)
        check_out_dir(cfg.train.out_dir, "train.out_dir")
    if cfg.train.tensorboard and (why := missing_package()):
        raise TrainingError(why)
    device = resolve_device(cfg.train.device, ddp)
    set_precision(cfg.train.precision, device)  # fp16 without CUDA refused here, before any folder exists
    # The data against the model, before any model is built or compiled or any folder made.
    check_dataset(cfg.data, (cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size), ddp.world_size)
    if ddp.world_size > 1 and cfg.train.ddp_grad_dtype == "bf16" and device.type != "cuda":
        raise TrainingError("train.ddp_grad_dtype=bf16 needs NCCL (ranks on CUDA GPUs); gloo all-reduces fp32 only: "
                            "drop the override on CPU")
    if cfg.train.compile and device.type != "cuda" and ddp.main:
        print("train: torch.compile is used on CUDA only; running eagerly on CPU")
    cfg.train.ckpt_every = math.ceil(cfg.train.ckpt_every / cfg.train.log_every) * cfg.train.log_every
    cfg.train.eval_every = math.ceil(cfg.train.eval_every / cfg.train.log_every) * cfg.train.log_every
    # Sampling and scoring run on rank 0 only, at log intervals; a missing judge or weights file fails here.
    if evaluator is not None and (ddp.world_size > 1 or cfg.train.eval_every < 1):
        raise TrainingError("train(evaluator=...) runs in one process (its stop would reach rank 0 alone), every "
                            "train.eval_every > 0 steps")
    if evaluator is None and cfg.train.eval_every > 0 and ddp.main:
        evaluator = Evaluator(cfg, device, AMP_DTYPES[cfg.train.precision])
    own_stop = stop is None
    stop = stop or StopRequest()
    run_dir = None  # once the run has started in it: a failure then says what is left there
    locked = None  # the folder this process locked (rank 0)
    try:
        stop.check()  # the safe points of start-up: here, before the run folder exists, and between _run's sections
        resumed = None
        if cfg.train.resume:
            # The run folder as it was until the checkpoint has loaded with this config: a refusal changes nothing.
            saved_config(cfg.train.resume)
            if ddp.main:
                lock_run(locked := Path(cfg.train.resume))
            resumed = resume_point(cfg, Path(cfg.train.resume), ddp.main)
            at = resumed["state"]["step"] if resumed["state"] is not None else 0
            if at == cfg.train.steps:
                log(ddp, f"train: {cfg.train.resume} is complete: its newest checkpoint, {resumed['path'].name}, is "
                         f"at train.steps={at}; nothing to do (a larger train.steps trains on)")
                return Path(cfg.train.resume)
        if ddp.main:
            if not cfg.train.resume:
                lock_run(locked := new_run_dir(cfg))
            run_dir = stop.run_dir = locked
            print(f"train: run folder {run_dir}, {ddp.world_size} process(es)\n{cfg.summary()}")
            if not cfg.train.resume:
                write_run_files(run_dir, cfg, ddp)
        if ddp.world_size > 1:
            shared = [str(run_dir) if run_dir else None]
            dist.broadcast_object_list(shared, src=0)
            run_dir = Path(shared[0])
        return _run(cfg, ddp, device, run_dir, stop, evaluator, resumed)
    except BaseException as e:
        if ddp.main and run_dir is not None:
            note = _after_failure(run_dir, fresh=not cfg.train.resume)
            if isinstance(e, Interrupted):
                e.args = (f"{e.args[0]}; {note}",)
            else:
                print(f"train: {note}", file=sys.stderr, flush=True)
        raise
    finally:
        if locked is not None:
            unlock_folder(locked)
        if own_stop:
            stop.restore()


def _after_failure(run_dir: Path, fresh: bool) -> str:
    """Removes a new run folder that holds nothing to keep; says what is left."""
    ckpts = list_checkpoints(run_dir)
    if fresh and not ckpts and not (run_dir / "stats.jsonl").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        return f"removed the run folder {run_dir}: the run stopped before its first stats line or checkpoint"
    if not ckpts:
        return f"{run_dir} has no checkpoint; a new run starts from step 0"
    return f"continue with --resume {run_dir} (newest checkpoint: step {int(ckpts[-1].stem.split('-')[1])})"


def _run(cfg: RunConfig, ddp: Dist, device: torch.device, run_dir: Path, stop: "StopRequest",
         evaluator: "Evaluator | None", resumed: dict | None) -> Path:
    # ---- data -----------------------------------------------------------------------------------------------
    stop.check()
    loader = make_loader(cfg.data, device, rank=ddp.rank, world_size=ddp.world_size)
    steps_per_epoch = len(loader)
    stop.check()
    global_batch = cfg.data.batch_size * ddp.world_size

    # ---- model, optimizer -----------------------------------------------------------------------------------
    t = build(cfg, device, ddp)
    # The EMA weights for sample grids and evaluations; with train.sample_compile compiled at its first use and kept
    # (the EMA is updated in place, so the compiled graph always reads the current weights).
    sampling_net = compile_denoiser(t.ema.module if t.ema is not None else t.model,
                                    cfg.train.sample_compile if device.type == "cuda" else "off")
    stop.check()
    start_step = 0
    if cfg.train.resume:
        # Taken out of `resumed`, so that the host copy of the checkpoint goes once it is loaded (resume_point
        # checked it against cfg: a failure below is a case that check does not know).
        state, path = resumed.pop("state"), resumed["path"]
        if state is not None:
            try:
                t.model.load_state_dict(state["model"])
                t.optimizer.load_state_dict(state["optimizer"])
                t.scaler.load_state_dict(state["scaler"])
                if t.ema is not None:
                    t.ema.load_state_dict(state["ema"])
            except (RuntimeError, KeyError, ValueError) as e:
                raise TrainingError(f"{path} does not load into this config ({type(e).__name__}: "
                                    f"{(str(e).splitlines() or [''])[0]}); the run folder is as it was") from None
            start_step = state["step"]
            if ddp.main:
                set_rng_state(state["rng"], device)  # bit-exact for one process; other ranks reseed below
            else:
                torch.manual_seed(noise_seed(cfg, ddp.rank) + 1_000_003 * start_step)
            log(ddp, f"train: resumed from {path} at step {start_step}")
            del state
        else:
            log(ddp, f"train: {run_dir} has no checkpoint yet; starting at step 0")
        if ddp.main:
            write_run_files(run_dir, cfg, ddp)
            drop_stats_after(run_dir / "stats.jsonl", start_step)

    def checkpoint(step: int) -> None:
        if ddp.world_size > 1:
            check_ranks_agree(t.model, step)
        if not ddp.main:
            return
        state = {"step": step, "epoch": step // steps_per_epoch, "batch_in_epoch": step % steps_per_epoch,
                 "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
                 "scaler": t.scaler.state_dict(), "ema": t.ema.state_dict() if t.ema is not None else None,
                 "rng": rng_state(device), "config": cfg.to_dict(), "world_size": ddp.world_size}
        save_checkpoint(state, run_dir, step, cfg.train.keep_ckpts)

    # ---- loop -----------------------------------------------------------------------------------------------
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # first step with a non-finite loss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    data = endless(loader, *divmod(start_step, steps_per_epoch))  # each epoch's order replays from its seed
    progress = None
    if cfg.train.progress and ddp.main:
        from tqdm import tqdm
        progress = tqdm(total=cfg.train.steps, initial=start_step, unit="step", dynamic_ncols=True)
    # NVML reads the whole GPU, so one sampler per rank's GPU would be right; rank 0 samples its own GPU only.
    telemetry = GpuTelemetry(run_dir / "telemetry.jsonl", device_index=device.index or 0,
                             enabled=cfg.train.telemetry and ddp.main and device.type == "cuda").start()
    board = TensorBoardLog(run_dir, start_step) if cfg.train.tensorboard and ddp.main else None
    pauses = GcPauses().start()  # Python's collections per interval: a long one is a slow step (NOTES item 21)
    frozen = None  # freeze_garbage's (objects set aside, the process had its own frozen) (train.gc_freeze)
    t_start = t_line = time.perf_counter()  # t_line: when the previous stats line was complete (img_per_s_wall)
    step = start_step

    def one_step(batch, i: int) -> torch.Tensor:
        try:
            return t.step(*batch, lr_at(step + i, cfg.train))
        except torch.cuda.OutOfMemoryError:
            if step + i > start_step:
                raise
            raise TrainingError(oom_message(cfg, device, t)) from None

    def after_step(i: int, loss: torch.Tensor) -> bool:
        nonlocal first_bad
        first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss), step + i, first_bad)
        if progress is not None:
            progress.update()
        # One process stops at once on a signal; ranks of a process group agree on it at the next interval.
        return stop.signum is not None and ddp.world_size == 1

    stop.check()  # the last safe point of start-up; a signal from here on stops after a step, with a checkpoint
    stop.phase = "running"
    try:
        while step < cfg.train.steps:
            # ---- one log interval of timed steps (timing.timed_steps: CUDA events, one sync at its end) ----------
            pauses.reset()  # the collections inside the interval's steps only, not the bookkeeping before them
            interval = timed_steps(one_step, lambda: next(data), min(cfg.train.log_every - step % cfg.train.log_every,
                                                                     cfg.train.steps - step), device, after_step)
            window, loss_sum, iter_ms, wait_ms = interval.steps, interval.loss_sum, interval.iter_ms, interval.wait_ms
            step += window

            # ---- log interval: the only host-device syncs ------------------------------------------------------
            flags = torch.stack([first_bad, torch.tensor(int(stop.signum is not None), device=device)])
            if ddp.world_size > 1:
                dist.all_reduce(loss_sum)
                loss_sum /= ddp.world_size
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            bad, stop_now = int(flags[0]), bool(flags[1])
            if bad >= 0:
                # Checkpoints are written only after this check, so every one on disk predates the bad step.
                ckpts = list_checkpoints(run_dir)
                there = (f"the newest checkpoint in {run_dir}, {ckpts[-1].name}, is from before it" if ckpts
                         else f"no checkpoint was written before it (train.ckpt_every={cfg.train.ckpt_every})")
                raise TrainingError(f"non-finite loss at step {bad}; stopping: {there}. Lower train.lr or check "
                                    f"the data")
            stats = {
                "step": step, "loss": float(loss_sum) / window, "lr": lr_at(step - 1, cfg.train),
                "img_per_s": window * global_batch / (sum(iter_ms) / 1e3),
                "iter_ms_median": float(np.median(iter_ms)), "iter_ms_max": float(max(iter_ms)),
                "data_wait_ms": float(np.mean(wait_ms)),
                "data_wait_share": sum(wait_ms) / sum(iter_ms),
                "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                "wall_s": time.perf_counter() - t_start,
                **pauses.take(),
            }
            if cfg.train.gc_freeze and not frozen:  # once, outside the timed steps
                frozen = freeze_garbage()
                stats["gc_frozen_objects"], stats["gc_frozen_before"] = frozen  # before > 0: they stay frozen
            if ddp.world_size > 1:
                allreduce_ms = t.reducer.take_ms() if t.reducer is not None else []
                stats.update(per_rank_times(wait_ms, iter_ms, device, stats["gc_ms"], allreduce_ms))
            if evaluator is not None and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                stats.update(evaluator(sampling_net, t.diffusion))
                stop_now = bool(stats.pop("stop", False)) or stop_now
            # Line to line: this interval's steps and bookkeeping, and the previous one's checkpoint and samples.
            now = time.perf_counter()
            stats["img_per_s_wall"], t_line = window * global_batch / (now - t_line), now
            if ddp.main:
                with open(run_dir / "stats.jsonl", "a") as f:
                    f.write(json.dumps(stats) + "\n")
            if board is not None:
                board.stats(stats)  # host numbers read above: no further sync
            if progress is not None:
                progress.set_postfix(loss=f"{stats['loss']:.4f}", img_s=f"{stats['img_per_s']:.0f}",
                                     img_s_wall=f"{stats['img_per_s_wall']:.0f}")

            # ---- checkpoint, sample ----------------------------------------------------------------------------
            if stop_now:
                stop.phase = "stopping"  # a further signal must not cut the checkpoint-and-exit short
            if step % cfg.train.ckpt_every == 0 or step == cfg.train.steps or stop_now:
                checkpoint(step)
            if ddp.main and cfg.train.sample_every and (step % cfg.train.sample_every == 0
                                                        or step == cfg.train.steps):
                sample_grid(t, cfg, run_dir / f"samples-{step:08d}.png", sampling_net)
                if board is not None:
                    board.image("samples", run_dir / f"samples-{step:08d}.png", step)
            if stop_now:
                name = signal.Signals(stop.signum).name if stop.signum else "stop"
                log(ddp, f"\ntrain: {name} received; checkpoint written at step {step}, exiting")
                break
        stop.phase = "stopping"  # complete: what follows is bookkeeping
    finally:
        data.close()  # ends the loader's epoch iterator (and its prefetch thread) before the process moves on
        pauses.stop()
        unfreeze_garbage(frozen)  # an in-process caller gets its collector back as it was
        telemetry.stop()
        if board is not None:
            board.close()
        if progress is not None:
            progress.close()
    summary = telemetry.summary(images=(step - start_step) * cfg.data.batch_size)  # this rank's GPU and images
    if ddp.main and summary.get("enabled", True):
        write_json(run_dir / "telemetry-summary.json", summary)
        plot_telemetry(run_dir / "telemetry.jsonl", run_dir / "telemetry.png")
    return run_dir


def per_rank_times(wait_ms: list[float], iter_ms: list[float], device: torch.device, gc_ms: float = 0.0,
                   allreduce_ms: list[float] = ()) -> dict:
    """Every rank's data-wait share, mean iteration time and garbage-collection pauses of this interval, and with
    train.ddp_reduce=flat its all-reduces' mean and shortest time: a rank that waits for its data or stops for a
    collection stalls the others at the next all-reduce, where they wait (their all-reduce is longer), so rank 0's
    own figures alone can hide where the time went."""
    n_ar = len(allreduce_ms)
    mine = torch.tensor([sum(wait_ms), sum(iter_ms), len(iter_ms), gc_ms, sum(allreduce_ms) / max(n_ar, 1),
                         min(allreduce_ms, default=0.0)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = [e.tolist() for e in every]
    out = {"rank_data_wait_share": [r[0] / r[1] for r in rows], "rank_iter_ms_mean": [r[1] / r[2] for r in rows],
           "rank_gc_ms": [r[3] for r in rows]}
    if n_ar:
        out |= {"rank_allreduce_ms_mean": [r[4] for r in rows], "rank_allreduce_ms_min": [r[5] for r in rows]}
    return out


def img_per_s_over(lines: list[dict], after_step: int, key: str = "img_per_s") -> float:
    """img/s over consecutive stats lines (the intervals that end at their steps, the first starting at
    `after_step`): all their images over all their seconds, each interval's seconds being its images / its rate
    `key`. Not a median or mean of the rates: an interval that stalled counts with all the time it took."""
    steps = [line["step"] - prev for prev, line in zip([after_step, *(x["step"] for x in lines)], lines)]
    return sum(steps) / sum(n / line[key] for n, line in zip(steps, lines))  # the batch cancels: steps stand for images


def log(ddp: Dist, msg: str) -> None:
    if ddp.main:
        print(msg, flush=True)


def check_ranks_agree(model: torch.nn.Module, step: int) -> None:
    """DDP keeps replicas equal by construction; a checksum per rank at each checkpoint proves it did."""
    checksum = torch.stack([torch.cat([p.detach().double().sum().view(1), p.detach().double().square().sum().view(1)])
                            for p in model.parameters()]).flatten()
    gathered = [torch.empty_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    if not all(torch.equal(g, gathered[0]) for g in gathered):
        raise TrainingError(f"step {step}: model replicas differ between ranks; refusing to checkpoint")


def oom_message(cfg: RunConfig, device: torch.device, t: Trainer) -> str:
    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    t.optimizer.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    eager = make_step(t.model, t.model, t.diffusion, t.optimizer, t.scaler, None, cfg)
    fits = largest_fitting_batch(eager, device, cfg.data.batch_size, cfg.model.image_size)
    msg = f"batch size {cfg.data.batch_size} does not fit in this GPU's {total:.0f} GiB. "
    if fits:
        return msg + f"Batch {fits} fit (probed in eager mode; compiled steps usually need less): data.batch_size={fits}"
    return msg + "Not even batch 1 fit: use a smaller preset"


@torch.no_grad()
def sample_grid(t: Trainer, cfg: RunConfig, path: Path, model: torch.nn.Module) -> None:
    amp_dtype = AMP_DTYPES[cfg.train.precision]
    labels = (torch.arange(cfg.train.sample_n, device=t.device) % cfg.model.num_classes
              if cfg.model.num_classes > 0 else None)
    with torch.autocast(t.device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        # DDIM for DDPM; predictor-corrector for VE (Song et al.'s choice for VE-SDE models).
        sampler = "ddim" if cfg.diffusion.process == "ddpm" else "pc"
        images, _ = sample(t.diffusion, model, cfg.train.sample_n, sampler=sampler, steps=cfg.train.sample_steps,
                           seed=cfg.train.seed, y=labels, device=t.device,
                           shape=(cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size),
                           memory_format=torch.channels_last if cfg.train.channels_last else torch.contiguous_format)
    save_grid(images, path)


def parse_args(argv: list[str]) -> RunConfig:
    p = Parser(prog="python -m ffcv_ddpm.train", doc=__doc__, overrides=True)
    p.add_argument("--preset", help="model preset (ffcv_ddpm.unet.PRESETS; default ddpm-cifar10; with --resume, the "
                                    "run's own)")
    p.add_argument("--data", help="dataset folder (its one *_train_raw.beton) or a train .beton file (data.path)")
    p.add_argument("--resume", help="run folder to continue from its newest complete checkpoint")
    args, overrides = p.parse_with_overrides(argv)
    if args.resume:
        cfg = saved_config(args.resume)
        for item in overrides:
            apply_override(cfg, item)
        cfg.train.resume = args.resume
        cfg.preset = args.preset or cfg.preset  # another one is refused by train (resume_point), with the run's
    else:
        cfg = load_config(args.preset or "ddpm-cifar10", overrides)
    if args.data:
        apply_override(cfg, f"data.path={train_beton(args.data)}")
    return check_config(cfg)


def main(argv: list[str] | None = None) -> int:
    ddp = Dist()
    stop = StopRequest()  # from the first moment after the imports (a signal during them: catch_early)
    rank = lambda: f" (rank {ddp.rank})" if ddp.world_size > 1 else ""  # noqa: E731

    def stopped(e: Interrupted) -> int:
        print(f"train{rank()}: {e}", file=sys.stderr)
        return 128 + e.signum

    try:
        stop.check()
        compile_cache()  # before anything compiles: the compiled step is kept for the next run (ffcv_ddpm.env)
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        ddp = init_distributed(cfg.train.device)
        train(cfg, ddp, stop)
    except Interrupted as e:
        return stopped(e)
    except Exception as e:
        if stop.signum is not None:  # an error the signal caused (a rank whose peer stopped first): the stop
            return stopped(Interrupted(stop.signum, f"during {stop.where}" if stop.phase == "start-up"
                                       else "during training"))
        if isinstance(e, (TrainingError, ValueError, FileNotFoundError)):
            return fail("train", f"{e}{rank()}")
        raise
    except KeyboardInterrupt:
        print("train: interrupted", file=sys.stderr)
        return 130
    finally:
        stop.phase = "stopping"  # whatever happened above is complete; the exit must not be cut short
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        stop.restore()
    return 0


if __name__ == "__main__":
    rc = main()
    if _GLOO:
        # gloo's unjoined worker threads can abort a rank during interpreter shutdown (benchmarks/NOTES.md, moved
        # from the code); everything this run owns is closed and written by now, so the rank skips that shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
