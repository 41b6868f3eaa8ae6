"""DDP on CPU: torchrun with the gloo backend, 2 processes, the tiny preset."""

import json
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ffcv_ddpm.step import TrainingError
from ffcv_ddpm.train import NO_MULTICAST, check_ranks_agree
from conftest import REPO, write_beton


def test_two_ranks_train_in_lockstep(tmp_path):
    beton = write_beton(tmp_path / "train.beton", 64)
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "ffcv_ddpm.train", "--preset", "tiny", "--data", str(beton), "data.batch_size=8",
           "data.num_workers=1", "train.device=cpu", "train.precision=fp32", "train.progress=False",
           "train.sample_every=0", f"train.out_dir={tmp_path / 'runs'}", "train.steps=6", "train.log_every=2",
           "train.ckpt_every=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    stats = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [2, 4, 6]  # one writer (rank 0), not two
    # A checkpoint is only written after every rank's weights checksum equal (check_ranks_agree).
    ckpt = torch.load(run_dir / "ckpt-00000006.pt", weights_only=False)
    assert ckpt["world_size"] == 2
    environment = json.loads((run_dir / "environment.json").read_text())
    assert environment["world_size"] == 2 and environment["multicast_env"] == NO_MULTICAST


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


def _agree_worker(rank, store, perturb, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    if perturb and rank == 1:
        with torch.no_grad():
            model.bias[0] += 1e-6
    try:
        check_ranks_agree(model, step=7)
        results[rank] = "agree"
    except TrainingError as e:
        results[rank] = str(e)
    dist.destroy_process_group()


def test_check_ranks_agree_detects_a_diverged_replica(tmp_path):
    for perturb in (False, True):
        results = mp.Manager().dict()
        mp.spawn(_agree_worker, args=(str(tmp_path / f"store{perturb}"), perturb, results), nprocs=2)
        if perturb:
            assert all("step 7: model replicas differ" in results[r] for r in (0, 1))
        else:
            assert dict(results) == {0: "agree", 1: "agree"}
