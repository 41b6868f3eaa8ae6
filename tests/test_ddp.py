"""DDP on CPU: torchrun with the gloo backend, 2 processes, the tiny preset."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ffcv_ddpm.step import TrainingError
from ffcv_ddpm import train as train_module
from ffcv_ddpm.train import NO_MULTICAST, check_ranks_agree, init_distributed
from conftest import REPO, write_beton


def train_two_ranks(tmp_path, *overrides) -> Path:
    """The trainer under torchrun, 2 gloo ranks, 6 steps of the tiny preset; returns its run folder."""
    beton = write_beton(tmp_path / "train.beton", 64)
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "ffcv_ddpm.train", "--preset", "tiny", "--data", str(beton), "data.batch_size=8",
           "data.num_workers=1", "train.device=cpu", "train.precision=fp32", "train.progress=False",
           "train.sample_every=0", f"train.out_dir={tmp_path / 'runs'}", "train.steps=6", "train.log_every=2",
           "train.ckpt_every=2", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


# The runs that compare the two reductions read the dataset into memory: FFCV's pipeline compiles for seconds in every
# rank on a CPU, and the reduction is what they check. test_two_nodes_of_one_process_each trains DDP through FFCV's
# loader (its distributed order by global rank).
MEMORY = "data.loader=torch-memory"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return train_two_ranks(tmp_path_factory.mktemp("ddp"), MEMORY, "train.ddp_reduce=ddp")


def test_two_ranks_train_in_lockstep(ddp_run):
    run_dir = ddp_run
    stats = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [2, 4, 6]  # one writer (rank 0), not two
    # A checkpoint is only written after every rank's weights checksum equal (check_ranks_agree).
    ckpt = torch.load(run_dir / "ckpt-00000006.pt", weights_only=False)
    assert ckpt["world_size"] == 2
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["world_size"] == 2 and environment["multicast_env"] == NO_MULTICAST


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("auto", "nccl"), ("cuda", "nccl")])
def test_the_backend_follows_train_device_not_the_machine(monkeypatch, device, backend):
    """On a GPU host, ranks told train.device=cpu join gloo (NCCL cannot all-reduce CPU tensors; found on 4 H100s,
    where the CPU tests of this file failed with 'No backend type associated with device type cpu')."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "init_process_group", lambda b: calls.append(("init", b)))
    monkeypatch.setattr(train_module, "_GLOO", False)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "FFCV_DDPM_ALLOW_NVLS": "1"}.items():
        monkeypatch.setenv(k, v)
    ddp = init_distributed(device)
    assert (ddp.rank, ddp.local_rank, ddp.world_size) == (1, 1, 2)
    assert calls == ([("set_device", 1)] if backend == "nccl" else []) + [("init", backend)]
    assert train_module._GLOO == (backend == "gloo")


def test_two_nodes_of_one_process_each(tmp_path):
    """Multi-node as torchrun runs it (--nnodes 2, --node_rank, a c10d rendezvous), both "nodes" on this machine:
    global ranks 0 and 1 both have LOCAL_RANK 0. Node 1 gets its own out_dir, as on a host without a shared
    filesystem: rank 1 must write nothing there."""
    beton = write_beton(tmp_path / "train.beton", 64)
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", "two-nodes", "-m", "ffcv_ddpm.train", "--preset", "tiny", "--data", str(beton),
               "data.batch_size=8", "data.num_workers=1", "train.device=cpu", "train.precision=fp32",
               "train.progress=False", "train.sample_every=0", f"train.out_dir={tmp_path / f'node{node}'}",
               "train.steps=4", "train.log_every=2", "train.ckpt_every=2"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    (run_dir,) = (tmp_path / "node0").iterdir()
    assert json.loads((run_dir / "environment.json").read_text())["world_size"] == 2
    assert torch.load(run_dir / "ckpt-00000004.pt", weights_only=False)["world_size"] == 2
    assert not (tmp_path / "node1").exists()


def test_the_flat_all_reduce_trains_as_ddp_does(ddp_run, tmp_path):
    """train.ddp_reduce=flat (the default) against DDP's wrapper, same seeds and data: the same losses and, after 6
    steps, the same weights bit for bit (an average of two ranks is exact in either order: DDP halves then sums, flat
    sums then halves), and its checkpoints pass the ranks' agreement check."""
    flat = train_two_ranks(tmp_path, MEMORY)  # the default reduction
    losses = [[json.loads(line)["loss"] for line in (d / "stats.jsonl").read_text().splitlines()]
              for d in (ddp_run, flat)]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    a, b = (torch.load(d / "ckpt-00000006.pt", weights_only=False) for d in (ddp_run, flat))
    assert b["config"]["train"]["ddp_reduce"] == "flat"
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert any(not torch.equal(a["model"][k], v) for k, v in
               torch.load(ddp_run / "ckpt-00000002.pt", weights_only=False)["model"].items())  # it trained
    # Per interval, every rank's collection pauses, and with flat its all-reduces' mean and shortest time.
    for d, flat_run in ((ddp_run, False), (flat, True)):
        for line in (d / "stats.jsonl").read_text().splitlines():
            st = json.loads(line)
            assert len(st["rank_gc_ms"]) == 2 and st["gc_ms"] == st["rank_gc_ms"][0] >= 0 and len(st["gc_collections"]) == 3
            assert ("rank_allreduce_ms_mean" in st) == flat_run
            if flat_run:
                assert all(0 < lo <= m for lo, m in zip(st["rank_allreduce_ms_min"], st["rank_allreduce_ms_mean"]))


def _gloo_worker(rank, store, results):
    """This file's checks of two gloo ranks, in one process group (a spawned process costs ~5 s of imports): the
    replicas' agreement check, then the flat all-reduce against DDP's."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    _agree_part(rank, results)
    _flat_part(rank, results)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory) -> dict:
    """What _gloo_worker's two ranks recorded."""
    results = mp.Manager().dict()
    mp.spawn(_gloo_worker, args=(str(tmp_path_factory.mktemp("gloo") / "store"), results), nprocs=2)
    return dict(results)


def _agree_part(rank, results):
    """Both cases in one process group: replicas equal, then rank 1's nudged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    for perturb in (False, True):
        if perturb and rank == 1:
            with torch.no_grad():
                model.bias[0] += 1e-6
        try:
            check_ranks_agree(model, step=7)
            results[perturb, rank] = "agree"
        except TrainingError as e:
            results[perturb, rank] = str(e)


def test_check_ranks_agree_detects_a_diverged_replica(gloo_ranks):
    results = gloo_ranks
    assert [results[False, r] for r in (0, 1)] == ["agree", "agree"]
    assert all("step 7: model replicas differ" in results[True, r] for r in (0, 1))


class _Net(torch.nn.Module):
    """A 3x3 conv, a 1x1 conv's weight applied as a matrix (as the UNet's attention does: its gradient comes back
    with contiguous strides, (8, 1, 1, 1), against the channels_last weight's (8, 1, 8, 8): the same memory order),
    GroupNorm, Linear: the parameter layouts of the UNet."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.skip = torch.nn.Conv2d(8, 8, 1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):
        h = self.conv(x)
        h = torch.nn.functional.linear(h.permute(0, 2, 3, 1), self.skip.weight.flatten(1), self.skip.bias)
        return self.head(self.norm(h.permute(0, 3, 1, 2)).mean((2, 3)))


def _net_and_ddp_twin(rank: int, device: torch.device):
    """(model, its parameters, a DDP-wrapped twin with the same weights, this rank's input): the weights drawn per
    rank, then broadcast from rank 0 (the flat path's start), DDP's buckets tiny so that there are several."""
    from torch.nn.parallel import DistributedDataParallel

    from ffcv_ddpm.flat_allreduce import broadcast_parameters

    torch.manual_seed(rank)  # different weights per rank: the broadcast must make them rank 0's
    model = _Net().to(device, memory_format=torch.channels_last)
    params = list(model.parameters())
    broadcast_parameters(params)
    twin = _Net().to(device, memory_format=torch.channels_last)
    twin.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(twin, device_ids=[rank] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True, bucket_cap_mb=0.0001)
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(10 + rank)).to(
        device, memory_format=torch.channels_last)
    return model, params, ddp, x


def _flat_part(rank, results):
    from ffcv_ddpm.flat_allreduce import FlatGradReducer

    model, params, ddp, x = _net_and_ddp_twin(rank, torch.device("cpu"))
    twin = ddp.module
    reducer = FlatGradReducer(params)
    for _ in range(2):  # twice: the second step reuses the buffer, with .grad set to None in between
        model.zero_grad(set_to_none=True)
        ddp.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        ddp(x).square().sum().backward()
        reducer()
    times = reducer.take_ms()
    results[rank] = {
        "times": (len(times), all(t > 0 for t in times), len(reducer.take_ms())),
        "weights": [p.detach().clone() for p in params],
        "grads": [p.grad.clone() for p in params], "ddp_grads": [p.grad.clone() for p in twin.parameters()],
        "strides_kept": all(p.grad.stride() == p.stride() for p in params),
        "skip_channels_last": model.skip.weight.stride() == (8, 1, 8, 8),  # the case the layout check must accept
        "views": all(p.grad.untyped_storage().data_ptr() == reducer.flat.untyped_storage().data_ptr()
                     for p in params)}
    results[rank] |= _flat_in_place(model, ddp, x, reducer)
    for name, spoil in (("missing", lambda: setattr(model.conv.weight, "grad", None)),  # checked on every call
                        ("misplaced", lambda: setattr(model.norm.bias, "grad", model.norm.weight.grad))):
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        reducer()
        spoil()
        try:
            reducer()
        except RuntimeError as e:
            results[f"{name}{rank}"] = str(e)


def _flat_in_place(model, ddp, x, reducer) -> dict:
    """After reducer(), .grad is a view of its buffer; zero_grad(set_to_none=False) zeroes it in place and a
    backward accumulates into it there: one backward, two (micro-batches), or with one gradient set to None (that
    one fresh, the others in place). Each time the result must be DDP's, whose reducer averages the same sums."""
    from contextlib import nullcontext

    out = {}
    for case, backwards, dropped in (("in_place", 1, False), ("accumulated", 2, False), ("mixed", 1, True)):
        model.zero_grad(set_to_none=False)
        ddp.zero_grad(set_to_none=False)
        if dropped:
            model.conv.weight.grad = None
            ddp.module.conv.weight.grad = None
        for b in range(backwards):
            model(x * (b + 1)).square().sum().backward()
            with ddp.no_sync() if b < backwards - 1 else nullcontext():  # DDP: one all-reduce, after the last
                ddp(x * (b + 1)).square().sum().backward()
        in_buffer = sum(p.grad is v for p, v in zip(model.parameters(), reducer.views))
        reducer()
        out[case] = (in_buffer, all(torch.allclose(p.grad, d.grad, rtol=1e-6, atol=0)
                                    for p, d in zip(model.parameters(), ddp.module.parameters())))
    return out


def test_the_flat_all_reduce_averages_gradients_as_ddp_does(gloo_ranks):
    """train.ddp_reduce=flat: weights broadcast from rank 0; after reducer() every rank holds the average of the
    ranks' gradients, equal to DDP's (an average of two: bit-equal whatever the order), with the parameters' strides
    (channels_last) as views of one buffer, also when the gradients already lie in it (zero_grad without
    set_to_none, accumulation); a missing or misplaced gradient is named on any call, not averaged as garbage."""
    results = gloo_ranks
    r0, r1 = results[0], results[1]
    assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"]))
    for r in (r0, r1):
        assert all(torch.equal(g, d) for g, d in zip(r["grads"], r["ddp_grads"]))
        assert r["strides_kept"] and r["views"] and r["skip_channels_last"]
        assert r["times"] == (2, True, 0)  # one time per all-reduce; a take empties the list
    assert all(torch.equal(a, b) for a, b in zip(r0["grads"], r1["grads"]))
    assert not all(torch.equal(g, torch.zeros_like(g)) for g in r0["grads"])
    for r in (r0, r1):  # gradients already in the buffer: all 8, or all but the one set to None
        assert (r["in_place"], r["accumulated"], r["mixed"]) == ((8, True), (8, True), (7, True))
    assert "no gradient for 1 parameter(s) (shapes [(8, 3, 3, 3)])" in results["missing0"]
    assert "1 gradient(s) (shapes [(8,)]) lie in the flat all-reduce's buffer at another parameter's place" in \
        results["misplaced1"]


def _flat_nccl_worker(rank, store, results):
    from ffcv_ddpm.flat_allreduce import FlatGradReducer

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    model, params, ddp, x = _net_and_ddp_twin(rank, torch.device("cuda", rank))
    reducers = {"fp32": FlatGradReducer(params), "bf16": FlatGradReducer(params, torch.bfloat16)}
    ddp.zero_grad(set_to_none=True)
    ddp(x).square().sum().backward()
    out = {"ddp": [p.grad.cpu() for p in ddp.module.parameters()]}
    for name, reducer in reducers.items():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        reducer()
        out[name] = [p.grad.cpu() for p in params]
        out[f"{name}_strides"] = all(p.grad.stride() == p.stride() for p in params)
        torch.cuda.synchronize()
        out[f"{name}_ms"] = reducer.take_ms()  # CUDA events around the all-reduce
    results[rank] = out
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_the_flat_all_reduce_on_two_gpus_matches_ddp(tmp_path):
    """NCCL's AVG over 2 GPUs: the fp32 average equal to DDP's, the bf16 one within bf16's rounding of it, both with
    the parameters' (channels_last) strides and the same on both ranks."""
    results = mp.Manager().dict()
    mp.spawn(_flat_nccl_worker, args=(str(tmp_path / "store"), results), nprocs=2)
    for r in (results[0], results[1]):
        assert r["fp32_strides"] and r["bf16_strides"]
        assert len(r["fp32_ms"]) == len(r["bf16_ms"]) == 1 and r["fp32_ms"][0] > 0 and r["bf16_ms"][0] > 0
        for d, f, b in zip(r["ddp"], r["fp32"], r["bf16"]):
            assert torch.allclose(f, d, rtol=1e-6, atol=1e-12)
            assert torch.allclose(b, d, rtol=2e-2, atol=1e-3 * d.abs().max().item())
    assert all(torch.equal(a, b) for a, b in zip(results[0]["bf16"], results[1]["bf16"]))
