"""The floor of each op class of one training step, measured on this device (issue 25's "what stands in the way").

    python -m benchmarks.speed.floors --out /tmp/floors data.batch_size=1024          # ddpm-cifar10, the step's shapes
    python -m benchmarks.speed.floors --out /tmp/floors data.batch_size=512 --profile PROFILE_DIR   # beside a profile
    python -m benchmarks.speed.floors --preset tiny --out /tmp/f data.batch_size=4 model.image_size=8   # CPU, seconds

One forward of the preset's model (as configured by the overrides) is recorded at a small batch: every convolution,
transposed convolution, linear layer and scaled-dot-product attention it calls, with its arguments' shapes, and
the input of every GroupNorm (the model rebuilt with model.norm_impl=torch, so that each site is an F.group_norm
call). Each compute class is then replayed alone at the step's batch: its calls in order, in bf16 (fp32 on CPU),
every tensor in the memory layout the call saw (channels_last as the step has it), convolutions without their bias
(as inductor calls cuDNN: the bias add is pointwise work), forward, then forward + backward
(the gradients the step takes: weights, and inputs where the step needs them), all of a class's calls captured as
one CUDA graph and replayed (clocks.graph_ms: no host launches, clocks settled). That is the class's measured
floor: the same library kernels with nothing between them. The memory-bound classes have a floor in bytes: the
GroupNorm sites' activations moved 5 times a step (forward read + write, backward read x, read dy, write dx: the
least any kernel can do) and 8 times (the statistics in separate reads, what the kernels do today), each site's
passes at the copy rate of its own size measured here (benchmarks.speed.copy_rate: the rate depends on the size);
the optimizer (fused AdamW: read p, g, m, v, write p, m, v in fp32) and the EMA (read p and ema, write ema) likewise.
With --profile (a benchmarks.speed.profile folder at the same batch), each class's time in the step stands beside
its floor. The residual adds, casts and other pointwise work (profile class elementwise/activation) have no floor
here: what they move depends on what is fused with what (benchmarks/NOTES.md item 13).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import BenchError, commit_text, md_table, results_out, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option

RECORD_BATCH = 5  # the recorded forward's batch: a size no weight dimension of these models has (it is scaled)


@dataclass
class Call:
    cls: str            # "convolution", "matmul (gemm)" or "attention": the profile's class names
    name: str           # the torch function, e.g. conv2d
    args: list          # tensors as TensorSpec, the rest as given
    kwargs: dict


@dataclass
class TensorSpec:
    shape: tuple
    param: bool          # a weight or bias: its shape does not scale with the batch
    requires_grad: bool  # the step's backward wants its gradient
    order: tuple = ()    # the dims from the largest stride to the smallest: the memory layout (channels_last, a
                         # transposed attention input) the call saw, reproduced in the replay


def record(model, inputs) -> tuple[list[Call], list[tuple]]:
    """(the compute calls of one forward, the shapes of the GroupNorm inputs) of `model(*inputs)`."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    compute = {F.conv2d: "convolution", F.conv_transpose2d: "convolution", F.linear: "matmul (gemm)",
               F.scaled_dot_product_attention: "attention"}
    params = {id(p) for p in model.parameters()}

    def spec(v):
        if isinstance(v, torch.Tensor):
            order = tuple(sorted(range(v.dim()), key=lambda d: (-v.stride(d), d)))
            return TensorSpec(tuple(v.shape), id(v) in params, v.requires_grad, order)
        if isinstance(v, (list, tuple)):
            return type(v)(spec(x) for x in v)
        return v

    calls, norms = [], []

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in compute:
                calls.append(Call(compute[func], func.__name__, [spec(a) for a in args],
                                  {k: spec(v) for k, v in kwargs.items()}))
            elif func is F.group_norm:
                norms.append(tuple(args[0].shape))
            return func(*args, **kwargs)

    with Recorder():
        model(*inputs)
    return calls, norms


def scaled(shape: tuple, batch: int) -> tuple:
    return (batch, *shape[1:]) if shape and shape[0] == RECORD_BATCH else shape


def without_bias(args: list, kwargs: dict) -> tuple[list, dict]:
    """A conv2d / conv_transpose2d call's arguments with its bias dropped (bias is the third argument of both).
    Inductor compiles every convolution on a GPU without its bias and adds the bias in a pointwise kernel that it
    fuses with what follows ("peel off the bias, cudnn is slower with it", torch/_inductor/kernel/conv.py), so the
    step's convolution kernels never see one and its backward takes no bias gradient there; the replay calls the
    same. With the bias, ATen adds it in a separate pass over the output and reduces the output's gradient for it:
    memory-bound work that would be counted as the convolutions' (the H100 call at 27068e1 measured the
    convolutions alone 1.7x slower than in the step; NOTES item 22)."""
    args = [None if i == 2 else a for i, a in enumerate(args)]
    return args, {k: (None if k == "bias" else v) for k, v in kwargs.items()}


class Replay:
    """A class's calls at `batch`: tensors made once (random, seeded), outputs' gradients made once; fwd() and
    fwd_bwd() run every call in order."""

    def __init__(self, calls: list[Call], batch: int, device, dtype):
        import torch
        import torch.nn.functional as F

        gen = torch.Generator(device=device).manual_seed(0)  # drawn on the device: GBs of activations at 1024
        self.funcs, self.args, self.kwargs, self.grads, self.wrt = [], [], [], [], []

        def make(v):
            if isinstance(v, TensorSpec):
                shape = v.shape if v.param else scaled(v.shape, batch)
                order = v.order or tuple(range(len(shape)))
                t = torch.randn([shape[d] for d in order], generator=gen, device=device, dtype=dtype) * 0.5
                t = t.permute([order.index(d) for d in range(len(shape))])  # made in memory order, seen as the call's
                return t.requires_grad_(v.requires_grad)
            if isinstance(v, (list, tuple)):
                return type(v)(make(x) for x in v)
            return v

        for c in calls:
            func = getattr(F, c.name)
            args, kwargs = [make(a) for a in c.args], {k: make(v) for k, v in c.kwargs.items()}
            if c.cls == "convolution":  # the step's convolutions have no bias: without_bias
                args, kwargs = without_bias(args, kwargs)
            out = func(*args, **kwargs)
            self.funcs.append(func)
            self.args.append(args)
            self.kwargs.append(kwargs)
            self.grads.append(torch.randn_like(out))
            self.wrt.append([t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor) and t.requires_grad])
            del out

    def fwd(self):
        import torch

        with torch.no_grad():
            for f, a, k in zip(self.funcs, self.args, self.kwargs):
                f(*a, **k)

    def fwd_bwd(self):
        import torch

        for f, a, k, g, wrt in zip(self.funcs, self.args, self.kwargs, self.grads, self.wrt):
            out = f(*a, **k)
            if wrt:
                torch.autograd.grad(out, wrt, g)


def model_differences(profiled: dict, model) -> list[str]:
    """The overrides that make `model` the profiled one, as key=value (norm_impl and norm_plan aside: they change no
    compute call and the normalization's floor is counted from the sites' shapes)."""
    import dataclasses

    mine = dataclasses.asdict(model)
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731  (JSON has lists)
    return [f"model.{k}={tuple(v) if isinstance(v, list) else v}".replace(" ", "") for k, v in profiled.items()
            if k in mine and k not in ("norm_impl", "norm_plan") and norm(mine[k]) != v]


def profile_classes(folder: Path) -> tuple[dict, dict]:
    """(ms per step by class, the profile's summary) of a benchmarks.speed.profile folder."""
    summary = json.loads((folder / "summary.json").read_text())
    return {c["class"]: c["ms_per_step"] for c in summary["profile"]["classes"]}, summary


def measure(cfg, batch: int, cuda: bool, iters: int, copy_mib: int) -> dict:
    import dataclasses

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.speed.clocks import clock_ms
    from benchmarks.speed.copy_rate import copy_gb_per_s
    from benchmarks.speed.flops import _inputs
    from ffcv_ddpm.step import set_sdpa_backend
    from ffcv_ddpm.unet import FUSED_SWITCHES, build_model

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark  # the step's algorithm choice (searched in warm-up)
    set_sdpa_backend(cfg.train.sdpa_backend, device)  # the step's attention kernels
    layout = torch.channels_last if cfg.train.channels_last else torch.contiguous_format  # the step's layout
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device, memory_format=layout)
    n_params = sum(p.numel() for p in model.parameters())
    x, t, y = _inputs(cfg.model, RECORD_BATCH, device)
    inputs = (x.contiguous(memory_format=layout), t, *([y] if y is not None else []))
    calls, _ = record(model.train(), inputs)
    # The fused kernels' switches go with them (ModelConfig.validate): the F.group_norm twin reads the concatenation
    # and the residual sums computed, and takes F.silu.
    ref = build_model(dataclasses.replace(cfg.model, norm_impl="torch", norm_plan="",
                                          **dict.fromkeys(FUSED_SWITCHES, False)))
    ref = ref.to(device, memory_format=layout)
    _, norms = record(ref.train(), inputs)
    del model, ref

    classes = {}
    for cls in ("convolution", "matmul (gemm)", "attention"):
        mine = [c for c in calls if c.cls == cls]
        if not mine:
            continue
        replay = Replay(mine, batch, device, dtype)
        fwd = clock_ms(replay.fwd, cuda, iters)
        both = clock_ms(replay.fwd_bwd, cuda, iters)
        flops = {}
        for name, fn in (("fwd", replay.fwd), ("fwd_bwd", replay.fwd_bwd)):  # what the replay executes, counted
            with FlopCounterMode(display=False) as counter:
                fn()
            flops[name] = counter.get_total_flops()
        classes[cls] = {"calls": len(mine), "fwd_ms": fwd, "fwd_bwd_ms": both, "bwd_ms": both - fwd,
                        "fwd_flops": flops["fwd"], "bwd_flops": flops["fwd_bwd"] - flops["fwd"],
                        "fwd_tflops": flops["fwd"] / fwd / 1e9, "fwd_bwd_tflops": flops["fwd_bwd"] / both / 1e9}
        del replay
        if cuda:
            torch.cuda.empty_cache()
    # Each pass priced at the copy rate of its own size (one H200: 4.2 TB/s at 128-268 MB, 2.77 at 1 GiB; NOTES 36),
    # or with --copy-mib at that one size's rate (how floors priced them before 2026-11-28: 1 GiB)
    elem = torch.finfo(dtype).bits // 8
    site_bytes = [scaled(s, batch)[0] * int(torch.Size(s[1:]).numel()) * elem for s in norms]  # one pass a site
    opt_bytes = 4 * n_params  # one fp32 tensor of the parameters' size
    sizes = sorted(set(site_bytes) | {opt_bytes})
    fixed = copy_gb_per_s(copy_mib << 20, device.type) if copy_mib else None
    rates = {b: fixed or copy_gb_per_s(b, device.type) for b in sizes}
    ms = lambda nbytes, size: nbytes / (rates[size] * 1e9) * 1e3  # noqa: E731
    norm_pass_ms = sum(ms(b, b) for b in site_bytes)
    norm_bytes = sum(site_bytes)
    memory = {"normalization": {"sites": len(norms), "bytes_per_pass": norm_bytes,
                                "floor_ms_5_passes": 5 * norm_pass_ms, "floor_ms_8_passes": 8 * norm_pass_ms},
              "optimizer": {"params": n_params, "floor_ms": ms(10 * opt_bytes, opt_bytes)}}  # 7 AdamW + 3 EMA passes
    return {"batch": batch, "dtype": str(dtype).removeprefix("torch."),
            "copy_gb_per_s": norm_bytes / norm_pass_ms / 1e6,  # the normalization's pass, over its sites
            "copy_mib": copy_mib or None, "copy_rates": {str(b): r for b, r in rates.items()},
            "cudnn_benchmark": cfg.train.cudnn_benchmark, "compute": classes,
            "memory": memory}


def table(result: dict) -> list[list[str]]:
    """One row per profile class: the step's ms (if a profile was given), the floor, the gap."""
    m, step = result["measured"], result.get("profile_ms") or {}
    conv, mm, att = (m["compute"].get(k, {}) for k in ("convolution", "matmul (gemm)", "attention"))
    norm, opt = m["memory"]["normalization"], m["memory"]["optimizer"]
    peak = result.get("peak_tflops")
    per_site = " of each one's size" if m.get("copy_rates") and not m.get("copy_mib") else ""  # older files: one rate

    def rate(flops, ms):  # a compute floor's rate, and its share of the card's dense peak
        if not ms or flops is None:
            return ""
        tflops = flops / ms / 1e9
        return f" at {tflops:.3g} TFLOP/s" + (f" ({tflops / peak:.0%} of peak)" if peak else "")

    rows = [("convolution fwd", conv.get("fwd_ms"),
             f"{conv.get('calls', 0)} calls alone, forward{rate(conv.get('fwd_flops'), conv.get('fwd_ms'))}"),
            ("convolution bwd", conv.get("bwd_ms"),
             f"the same, data + weight gradients{rate(conv.get('bwd_flops'), conv.get('bwd_ms'))}"),
            ("matmul (gemm)", mm.get("fwd_bwd_ms"), f"{mm.get('calls', 0)} linear layers alone, fwd + bwd"
             + rate((mm.get("fwd_flops") or 0) + (mm.get("bwd_flops") or 0), mm.get("fwd_bwd_ms"))),
            ("attention", att.get("fwd_bwd_ms"), f"{att.get('calls', 0)} SDPA calls alone, fwd + bwd"
             + rate((att.get("fwd_flops") or 0) + (att.get("bwd_flops") or 0), att.get("fwd_bwd_ms"))),
            ("normalization", norm["floor_ms_5_passes"],
             f"{norm['sites']} sites x 5 passes at the copy rate{per_site} ({norm['floor_ms_8_passes']:.2f} ms at 8)"),
            ("optimizer", opt["floor_ms"], "fused AdamW + EMA bytes at the copy rate"),
            ("elementwise/activation", None, "no floor: depends on what is fused with what"),
            # Inductor's generated GroupNorm kernels (scale-shift) are classed elementwise by their names, the fused
            # ones normalization: the two together are the memory-bound work whatever the kernels are called.
            ("normalization + elementwise/activation", norm["floor_ms_5_passes"],
             "the memory-bound work together, against the normalization's 5-pass floor")]
    both = ("normalization", "elementwise/activation")
    step = {**step, both[0] + " + " + both[1]: sum(step[c] for c in both)} if all(c in step for c in both) else step
    out = []
    for cls, floor, how in rows:
        have = step.get(cls)
        gap = f"{have - floor:.2f}" if have is not None and floor is not None else "-"
        out.append([cls, f"{have:.2f}" if have is not None else "-", f"{floor:.2f}" if floor is not None else "-",
                    gap, how])
    return out


def render(result: dict) -> str:
    m = result["measured"]
    lines = [f"# Op-class floors: {result['preset']}, batch {m['batch']}, {m['dtype']} - "
             f"{result['device_name'] or 'CPU'}", "",
             f"- commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}; command: "
             f"`{result['command']}`",
             f"- copy rate {m['copy_gb_per_s']:.0f} GB/s (read + write; "
             + ("each pass at its own size's copy rate, the normalization's averaged); " if "copy_rates" in m
                and not m.get("copy_mib") else f"measured at {m.get('copy_mib') or 1024} MiB); ")
             + {True: "cuDNN algorithms by timed search (cudnn.benchmark); ",
                False: "cuDNN algorithms by heuristic; ", None: ""}[m.get("cudnn_benchmark")]  # None: older files
             + (f"step ms from the profile {result['profile']}" if result.get("profile") else "no profile given"), "",
             *md_table(["class", "in the step, ms", "floor, ms", "gap, ms", "the floor is"], table(result))]
    step = result.get("profile_ms")
    if step:
        floor = sum(float(r[2]) for r in table(result) if r[2] != "-" and " + " not in r[0])
        lines += ["", f"Sum of the floors: {floor:.2f} ms, against {sum(step.values()):.2f} ms of kernels in the step "
                      "(elementwise and everything else at zero)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.floors", doc=__doc__, overrides=True,
               epilog="No --data: the inputs are random tensors at the step's shapes. data.batch_size is the batch "
                      "the classes are replayed at (the step's, per GPU).")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--out", type=Path,
                   help="folder for floors.json and .md (default: benchmarks/results/<card>/floors)")
    p.add_argument("--profile", type=Path, help="a benchmarks.speed.profile folder (summary.json) at the same batch")
    p.add_argument("--iters", type=option(int, at_least(1)), default=5,
                   help="calls per timing (CUDA: per graph replay)")
    p.add_argument("--copy-mib", type=option(int, at_least(0)), default=0,
                   help="price every pass at the copy rate of this many MiB (default 0: each at its own size's)")
    args, overrides = p.parse_with_overrides(argv)
    p.check_paths(inputs=[("--profile", args.profile, "folder", "give a benchmarks.speed.profile output folder")],
                  outputs=[("--out", args.out)])
    import torch

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.env import environment

    try:
        cfg = load_config(args.preset, overrides)
        prof, summary = profile_classes(args.profile) if args.profile else (None, None)
    except (ValueError, FileNotFoundError, KeyError) as e:
        return fail("floors", str(e))
    if summary and summary["config"]["data"]["batch_size"] != cfg.data.batch_size:
        return fail("floors", f"the profile ran at batch {summary['config']['data']['batch_size']}, these floors at "
                              f"{cfg.data.batch_size}: pass data.batch_size={summary['config']['data']['batch_size']}")
    if summary and (odd := model_differences(summary["config"].get("model", {}), cfg.model)):
        return fail("floors", f"the profile's model differs from this one (the shapes would not be the step's): pass "
                              f"{' '.join(odd)}")
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else None
    try:
        out = results_out(args.out, device_name, "floors")
    except BenchError as e:
        return fail("floors", str(e))
    from benchmarks.speed.peaks import lookup_peak

    result = {"preset": args.preset, "overrides": overrides, "device_name": device_name,
              "peak_tflops": lookup_peak(device_name, "bf16").tflops,
              "command": "python -m benchmarks.speed.floors " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "profile": str(args.profile) if args.profile else None,
              "profile_ms": prof,
              "measured": measure(cfg, cfg.data.batch_size, cuda, args.iters, args.copy_mib)}
    result["table"] = table(result)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "floors.json", result)
    write_text(out / "floors.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
