"""`make profile`: where a training step's time goes (torch.profiler), and what it costs in power (NVML).

    python -m benchmarks.profile --preset ddpm-cifar10 --data data                       # bf16 + compile (defaults)
    python -m benchmarks.profile --preset ddpm-cifar10 --data data train.compile=False --out /tmp/eager
    python -m benchmarks.profile --preset tiny --data data data.batch_size=16 --steps 2   # CPU: CPU activities only

One process: build the trainer and loader (as benchmarks.bench does), run `--warmup` steps (the first compiles;
none of it is profiled), then torch.profiler over `--steps` steady-state iterations (schedule: 1 wait, 1 warm-up,
`--steps` active; CPU + CUDA activities, no shapes or stacks). Then the telemetry run: `--telemetry-rounds` rounds
of `--telemetry-steps` steps without and with GpuTelemetry sampling, alternating which goes first, each timed
with CUDA events (timing.timed_steps): the ratio of the two is the sampler's overhead, the sampled blocks give J/img.

Writes to benchmarks/results/<card>/profile-<preset>/ (or --out):
- trace.json.gz      Chrome/Perfetto trace of the active steps (open in ui.perfetto.dev or chrome://tracing)
- top_ops.md/.json/.png   the 10 most expensive ops (self CUDA time, CPU time, calls, % of step) and, on CUDA,
                          the 10 most expensive GPU kernels with the op that launched them, and which ops
                          asked for the copies (aten::copy_ under convolution_backward, autocast casts, ...)
- op_classes.md/.png      GPU time (CPU time without CUDA) by op class: convolution fwd/bwd, attention, matmul,
                          normalization, elementwise, optimizer, data/copies, other
- telemetry.jsonl/.png    the NVML samples of the telemetry run (CUDA only)
- profile.md              all of the above on one page;  summary.json  every figure + environment + config

How a kernel gets its class: by its own name where that is unambiguous (cuDNN fprop/dgrad/wgrad, flash/SDPA,
fused Adam / multi_tensor_apply, memcpy, group-norm kernels, Triton kernels by their fused op names), else by the
outermost op on the CPU stack that launched it (a cuBLAS kernel under aten::convolution is a convolution; any
kernel under Optimizer.step is the optimizer), else by generic kernel names (gemm -> matmul, elementwise).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import re
import shutil
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ffcv_ddpm.checks import Parser

REPO = Path(__file__).resolve().parent.parent
STEP_PREFIX = "ProfilerStep"  # torch.profiler's per-step events ("ProfilerStep#3", shown as "ProfilerStep*")
# Events the profiler records about itself, on the device timeline, with no kernel behind them.
PROFILER_OVERHEAD = frozenset({"Command Buffer Full", "Activity Buffer Request"})
DATA_MARK = "data: next batch"  # our record_function around the loader, so data time has a name in the trace
TRACE_LIMIT_MB = 15  # above this a trace is awkward to commit and slow to open: fewer --steps

# ---------------------------------------------------------------------------------------------------- op classes

CLASSES = ("convolution fwd", "convolution bwd", "attention", "matmul (gemm)", "normalization",
           "elementwise/activation", "optimizer", "data/copies", "other")

_ELEMENTWISE_OPS = ("add|sub|rsub|mul|div|silu|silu_backward|gelu|relu|sigmoid|tanh|exp|log|pow|sqrt|rsqrt|neg|"
                    "where|mean|sum|mse_loss|mse_loss_backward|sin|cos|fill|zero|clamp|clamp_min|abs|maximum|"
                    "minimum|lerp|addcmul|addcdiv|normal|uniform|random|randint|randn|rand|bernoulli|lt|gt|le|ge|"
                    "eq|ne|flip|isfinite|square|reciprocal|sign|threshold_backward|sigmoid_backward|arange|exp2")
_ELEMENTWISE_NODES = "silu|mul|add|sub|rsub|div|mean|sum|mseloss|pow|exp|neg|sqrt|rsqrt|where|sin|cos|clamp|flip|tanh"

# Names that say what they are wherever they appear (a kernel, an aten op, an autograd node, a user annotation).
# Order matters: cuDNN's SDPA kernels say "fprop" too, so attention comes before convolution.
_SPECIFIC = tuple((c, re.compile(p)) for c, p in (
    ("data/copies", r"^data:|memcpy|memset|direct_copy|copy_kernel|catarraybatchedcopy|nchwtonhwc|nhwctonchw"
                    r"|^aten::(copy_|to|_to_copy|contiguous|clone|cat|index_select|_pin_memory|pin_memory)$"),
    ("optimizer", r"^optimizer\.|multi_tensor_apply|adam|_foreach_"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("convolution bwd", r"dgrad|wgrad|convolution_?backward|conv2d_backward|conv_bwd"),
    ("convolution fwd", r"fprop|convolve|convolution|conv2d|winograd|implicit_gemm|conv_fwd"),
    ("normalization", r"group_?norm|layer_?norm|batch_?norm|rowwisemoments|computefusedparams|gammabeta"
                      r"|compute1d"),
))
# Names that are only a kernel family: used when neither the name nor the launching ops said more.
_GENERIC = tuple((c, re.compile(p)) for c, p in (
    ("matmul (gemm)", r"gemm|cublas|cutlass|nvjet|^aten::(mm|bmm|addmm|baddbmm|matmul|linear)$"
                      r"|\b(addmm|mm|bmm|linear)backward"),
    ("elementwise/activation", rf"elementwise|reduce_kernel|^aten::({_ELEMENTWISE_OPS})_?$"
                               rf"|\b({_ELEMENTWISE_NODES})backward"),
))
# Ops inductor fuses that only move data: a Triton kernel made of nothing else is a copy.
_COPY_OPS = re.compile(r"_to_copy|clone|copy|cat|permute|view|transpose|slice|constant_pad_nd|expand|unsqueeze"
                       r"|squeeze|convert_element_type|stack|index|select")


def _triton_class(name: str) -> str:
    """Inductor names kernels triton_<kind>_fused_<aten ops>_<n>: the ops say what the kernel does. A pointwise
    kernel named after a convolution only adds its bias or changes its layout: the convolution itself is cuDNN's."""
    m = re.match(r"triton_(?:(poi|red|per|tem|for|mm|bmm)_)?(?:fused_)?(.*)$", name)
    kind, ops = m.group(1), re.sub(r"(_\d+)+$", "", m.group(2))
    if kind in ("tem", "mm", "bmm"):  # templates: the real GEMM / convolution (max-autotune)
        if "conv" in ops:
            return "convolution bwd" if "backward" in ops else "convolution fwd"
        return "attention" if re.search("attention|softmax", ops) else "matmul (gemm)"
    if re.search(r"group_?norm|layer_?norm|batch_?norm", ops):
        return "normalization"
    if "softmax" in ops or "attention" in ops:
        return "attention"
    if re.search(r"adam|lerp|foreach", ops):
        return "optimizer"
    if not _COPY_OPS.sub("", ops).strip("_0123456789"):
        return "data/copies"
    return "elementwise/activation"


def _specific(name: str) -> str | None:
    if name.startswith("triton_"):
        return _triton_class(name)
    for cls, pattern in _SPECIFIC:
        if pattern.search(name):
            return cls
    return None


def _generic(name: str) -> str | None:
    if "triton_" in name:
        return "elementwise/activation"
    for cls, pattern in _GENERIC:
        if pattern.search(name):
            return cls
    return None


def classify(name: str, context: tuple[str, ...] | list[str] = ()) -> str:
    """Op class of a kernel or op `name`; `context` = the CPU ops around it, outermost first (for a kernel: the op
    that launched it and that op's parents). The name's own specific pattern wins; then the outermost specific op
    of the context (what the user called: Optimizer.step, aten::convolution, ...); then generic kernel families."""
    return _classify(name, tuple(context))


@functools.lru_cache(maxsize=65536)  # a profile repeats the same (kernel, op chain) pairs every step
def _classify(name: str, context: tuple[str, ...]) -> str:
    own, ctx = name.lower(), [n.lower() for n in context]
    for cls in (_specific(own), *map(_specific, ctx), *map(_generic, ctx), _generic(own)):
        if cls is not None:
            return cls
    return "other"


# ---------------------------------------------------------------------------------------------------- analysis


# Ops that only wrap a copy_: a copy is filed under the first op above these, "via" the outermost of them.
COPY_WRAPPERS = ("aten::clone", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::copy_")


def _chain(event) -> list[str]:
    """Names of `event` and its CPU parents, outermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names[::-1]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def analyse(events, top: int = 10) -> dict:
    """Per-step figures from torch.profiler's events (prof.events()) of the active steps.

    Uses only FunctionEvent attributes that have been stable for years: name, device_type, time_range, cpu_parent,
    kernels (the (name, device, duration) of each kernel an op launched itself), self_cpu_time_total,
    cpu_time_total, self_device_time_total, is_async.
    """
    from torch.autograd import DeviceType

    cpu = DeviceType.CPU
    steps = [e for e in events if e.device_type == cpu and e.name.startswith(STEP_PREFIX)]
    if not steps:
        raise RuntimeError("the profile holds no ProfilerStep events: was prof.step() called each iteration?")
    n = len(steps)
    cpu_step_us = sum(e.time_range.elapsed_us() for e in steps) / n
    ops = [e for e in events if e.device_type == cpu and not e.name.startswith(STEP_PREFIX) and not e.is_async]
    # CUPTI files its own stalls ("Command Buffer Full": the launch queue was full) as device events: not GPU work.
    kernels = [e for e in events if e.device_type != cpu and not getattr(e, "is_user_annotation", False)
               and e.name not in PROFILER_OVERHEAD]
    ops = [e for e in ops if e.name not in PROFILER_OVERHEAD]
    # Which op launched which kernel: the profiler files each kernel under the innermost op active at its launch.
    launched: dict[str, list] = defaultdict(list)  # kernel name -> [(op event, us)]
    for e in ops:
        for k in getattr(e, "kernels", ()):
            launched[k.name].append((e, k.duration))

    # ---- ops: self CPU time, and the GPU time of the kernels each launched itself ---------------------------
    rows: dict[str, dict] = {}
    cpu_by_class: dict[str, float] = defaultdict(float)
    for e in ops:
        chain = _chain(e)
        cls = classify(e.name, chain[:-1])
        r = rows.setdefault(e.name, {"name": e.name, "calls": 0, "self_cpu_us": 0.0, "cpu_total_us": 0.0,
                                     "self_cuda_us": 0.0, "_classes": defaultdict(float)})
        r["calls"] += 1
        r["self_cpu_us"] += e.self_cpu_time_total
        r["cpu_total_us"] += e.cpu_time_total
        r["self_cuda_us"] += e.self_device_time_total if kernels else 0.0
        r["_classes"][cls] += e.self_cpu_time_total + (e.self_device_time_total if kernels else 0.0)
        cpu_by_class[cls] += e.self_cpu_time_total
    cpu_total = sum(cpu_by_class.values())

    # ---- kernels: GPU time, the step's GPU span and busy time ------------------------------------------------
    gpu = None
    gpu_by_class: dict[str, float] = defaultdict(float)
    krows: dict[str, dict] = {}
    if kernels:
        spans = [(k.time_range.start, k.time_range.end) for k in kernels]
        span_us = max(e for _, e in spans) - min(s for s, _ in spans)
        busy_us = _union_us(spans)
        for k in kernels:
            r = krows.setdefault(k.name, {"name": k.name, "calls": 0, "gpu_us": 0.0,
                                          "_classes": defaultdict(float), "_launchers": defaultdict(float)})
            r["calls"] += 1
            r["gpu_us"] += k.time_range.elapsed_us()
        for name, r in krows.items():
            # Each launch is classified under its own op chain; what no op claims (a Triton kernel started from
            # inductor's Python wrapper, a copy from a loader thread) by the kernel's name alone.
            rest = r["gpu_us"]
            claims = [(op.name, classify(name, _chain(op)), us) for op, us in launched.get(name, ())]
            for op_name, cls, us in [*claims, ("-", classify(name), float("inf"))]:
                us = min(us, rest)
                rest -= us
                if us > 0:
                    r["_classes"][cls] += us
                    r["_launchers"][op_name] += us
                    gpu_by_class[cls] += us
        kernel_us = sum(gpu_by_class.values())
        gpu = {"span_ms_per_step": span_us / n / 1e3, "busy_ms_per_step": busy_us / n / 1e3,
               "kernel_ms_per_step": kernel_us / n / 1e3, "idle_share": 1 - busy_us / span_us if span_us else None}

    def per_step(us: float) -> float:
        return us / n / 1e3

    step_us = gpu["span_ms_per_step"] * n * 1e3 if gpu else cpu_step_us * n  # "% of step" denominator, all steps

    def major(d: dict) -> str:
        return max(d.items(), key=lambda kv: kv[1])[0]

    rank = "self_cuda_us" if kernels else "self_cpu_us"
    top_ops = [{
        "name": r["name"], "class": major(r["_classes"]), "calls_per_step": r["calls"] / n,
        "self_cuda_ms": per_step(r["self_cuda_us"]) if kernels else None,
        "self_cpu_ms": per_step(r["self_cpu_us"]), "cpu_total_ms": per_step(r["cpu_total_us"]),
        "pct_of_step": 100 * r[rank] / step_us,
    } for r in sorted(rows.values(), key=lambda r: -r[rank])[:top]]
    top_kernels = [{
        "name": r["name"], "class": major(r["_classes"]), "calls_per_step": r["calls"] / n,
        "gpu_ms": per_step(r["gpu_us"]), "pct_of_step": 100 * r["gpu_us"] / step_us,
        "pct_of_gpu": 100 * r["gpu_us"] / kernel_us, "launched_by": major(r["_launchers"]),
    } for r in sorted(krows.values(), key=lambda r: -r["gpu_us"])[:top]] if kernels else []

    # ---- copies: which op asked for them (a layout or dtype conversion inside aten::convolution_backward is a
    # different fix from a copy the model code makes itself) --------------------------------------------------
    copies: dict[tuple[str, str], list] = {}
    for e in ops:
        if e.name != "aten::copy_":
            continue
        chain = _chain(e)[:-1]
        via = "aten::copy_"
        while chain and chain[-1] in COPY_WRAPPERS:
            via = chain.pop()
        caller = chain[-1] if chain else "-"
        caller = "ProfilerStep*" if caller.startswith(STEP_PREFIX) else caller
        us = sum(k.duration for k in getattr(e, "kernels", ())) if kernels else e.self_cpu_time_total
        c = copies.setdefault((caller, via), [0, 0.0])
        c[0] += 1
        c[1] += us
    copy_rows = [{"caller": caller, "via": via, "calls_per_step": c / n, "ms_per_step": per_step(us)}
                 for (caller, via), (c, us) in sorted(copies.items(), key=lambda kv: -kv[1][1]) if us > 0][:top]

    by_class = gpu_by_class if kernels else cpu_by_class
    total = kernel_us if kernels else cpu_total
    classes = [{"class": c, "ms_per_step": per_step(by_class.get(c, 0.0)),
                "pct_of_total": 100 * by_class.get(c, 0.0) / total if total else 0.0,
                "pct_of_step": 100 * by_class.get(c, 0.0) / step_us} for c in CLASSES]
    return {
        "steps": n,
        "basis": "GPU kernel time" if kernels else "self CPU time",
        "cpu_step_ms": cpu_step_us / 1e3,
        "gpu": gpu,
        "top_ops": top_ops,
        "top_kernels": top_kernels,
        "copies": copy_rows,
        "classes": classes,
        "cpu_classes": [{"class": c, "ms_per_step": per_step(cpu_by_class.get(c, 0.0)),
                         "pct_of_total": 100 * cpu_by_class.get(c, 0.0) / cpu_total if cpu_total else 0.0}
                        for c in CLASSES],
    }


def events_from_trace(path: Path) -> list:
    """A saved Chrome trace (trace.json.gz) as the events analyse() reads, so a committed profile can be analysed
    again (a new table, a new class rule) on a machine without a GPU.

    CPU ops nest by time on their thread (cpu_parent); a kernel belongs to the op whose "External id" it carries,
    which is how the profiler itself links a launch to its op.
    """
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval, Kernel

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        raw = json.load(f).get("traceEvents", [])

    def event(e, device):
        start = float(e["ts"])
        return _TraceEvent(name=e["name"], device_type=device, time_range=Interval(start, start + float(e["dur"])),
                           cpu_parent=None, kernels=[], self_cpu_time_total=float(e["dur"]),
                           cpu_time_total=float(e["dur"]), self_device_time_total=0.0,
                           is_user_annotation=e.get("cat") == "gpu_user_annotation")

    ops, by_id = [], {}
    cpu = [e for e in raw if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    for group in _by_thread(cpu):
        stack = []
        for e in group:
            ev = event(e, DeviceType.CPU)
            while stack and stack[-1].time_range.end < ev.time_range.end:  # not inside the op on top
                stack.pop()
            if stack:
                ev.cpu_parent = stack[-1]
                stack[-1].self_cpu_time_total -= ev.cpu_time_total
            stack.append(ev)
            ops.append(ev)
            ext = e.get("args", {}).get("External id")
            if ext is not None and e.get("cat") == "cpu_op":
                by_id[ext] = ev
    kernels = []
    for e in raw:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            k = event(e, DeviceType.CUDA)
            kernels.append(k)
            op = by_id.get(e.get("args", {}).get("External id"))
            if op is not None:
                op.kernels.append(Kernel(k.name, 0, k.time_range.elapsed_us()))
                op.self_device_time_total += k.time_range.elapsed_us()
    return ops + kernels


@dataclass
class _TraceEvent:
    name: str
    device_type: object
    time_range: object
    cpu_parent: object
    kernels: list
    self_cpu_time_total: float
    cpu_time_total: float
    self_device_time_total: float
    is_user_annotation: bool = False
    is_async: bool = False


def _by_thread(events: list[dict]):
    """Each thread's events, sorted outermost first."""
    groups = defaultdict(list)
    for e in events:
        groups[(e.get("pid"), e.get("tid"))].append(e)
    for group in groups.values():
        yield sorted(group, key=lambda e: (float(e["ts"]), -float(e["dur"])))


# ---------------------------------------------------------------------------------------------------- rendering


def short(name: str, width: int = 70) -> str:
    """A kernel's name without its template arguments' tail, for tables and charts (JSON keeps the full name)."""
    name = re.sub(r"^void ", "", name).replace("|", "/")
    return name if len(name) <= width else name[: width - 1] + "…"


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def top_ops_lines(a: dict) -> list[str]:
    cuda = a["gpu"] is not None
    step = (f"GPU step span {a['gpu']['span_ms_per_step']:.2f} ms" if cuda else f"CPU step {a['cpu_step_ms']:.2f} ms")
    lines = [f"### Top {len(a['top_ops'])} ops by {'self CUDA' if cuda else 'self CPU'} time "
             f"(per step; % of the {step})", ""]
    lines += _md_table(["#", "op", "class", "calls", "self CUDA ms", "self CPU ms", "CPU total ms", "% of step"],
                       [[str(i), f"`{short(r['name'])}`", r["class"], f"{r['calls_per_step']:g}",
                         _ms(r["self_cuda_ms"]), _ms(r["self_cpu_ms"]), _ms(r["cpu_total_ms"]),
                         f"{r['pct_of_step']:.1f}%"]
                        for i, r in enumerate(a["top_ops"], 1)])
    if a["top_kernels"]:
        lines += ["", f"### Top {len(a['top_kernels'])} GPU kernels (per step)", ""]
        lines += _md_table(["#", "kernel", "class", "calls", "GPU ms", "% of step", "% of GPU time", "launched by"],
                           [[str(i), f"`{short(r['name'])}`", r["class"], f"{r['calls_per_step']:g}",
                             _ms(r["gpu_ms"]), f"{r['pct_of_step']:.1f}%", f"{r['pct_of_gpu']:.1f}%",
                             f"`{short(r['launched_by'], 40)}`"] for i, r in enumerate(a["top_kernels"], 1)])
    if a.get("copies"):
        unit = "GPU ms" if cuda else "self CPU ms"
        lines += ["", "### Where the copies come from (aten::copy_ by the op that asked for it, per step)", ""]
        lines += _md_table(["asked for by", "via", "calls", unit],
                           [[f"`{short(r['caller'], 60)}`", f"`{r['via']}`", f"{r['calls_per_step']:g}",
                             _ms(r["ms_per_step"])] for r in a["copies"]])
    return lines


def class_lines(a: dict) -> list[str]:
    cuda = a["gpu"] is not None
    lines = [f"### Time by op class ({a['basis']}, per step)", ""]
    rows = [[c["class"], _ms(c["ms_per_step"]), f"{c['pct_of_total']:.1f}%", f"{c['pct_of_step']:.1f}%"]
            for c in sorted(a["classes"], key=lambda c: -c["ms_per_step"]) if c["ms_per_step"] > 0]
    if cuda:
        g = a["gpu"]
        rows.append(["(GPU idle: no kernel running)", _ms(g["span_ms_per_step"] - g["busy_ms_per_step"]), "-",
                     f"{100 * g['idle_share']:.1f}%"])
    total = "% of GPU kernel time" if cuda else "% of CPU op time"
    lines += _md_table(["class", "ms", total, "% of step"], rows)
    return lines


def _bars(ax, labels: list[str], values: list[float], notes: list[str], xlabel: str) -> None:
    ys = range(len(labels))[::-1]
    bars = ax.barh(list(ys), values, color="#4c72b0")
    ax.set_yticks(list(ys), labels, fontsize=7)
    for bar, note in zip(bars, notes):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + note, va="center", fontsize=7)
    ax.set_xlim(0, max(values + [1e-9]) * 1.3)
    ax.set_xlabel(xlabel)


def plot_top(a: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cuda = a["gpu"] is not None
    panels = [("self_cuda_ms" if cuda else "self_cpu_ms", a["top_ops"],
               f"ops: {'self CUDA' if cuda else 'self CPU'} ms per step")]
    if a["top_kernels"]:
        panels.append(("gpu_ms", a["top_kernels"], "GPU kernels: ms per step"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.9 + 3.4 * len(panels)), squeeze=False)
    for ax, (key, rows, xlabel) in zip(axes[:, 0], panels):
        _bars(ax, [short(r["name"], 60) for r in rows], [r[key] for r in rows],
              [f"{r['pct_of_step']:.1f}% ({r['class']})" for r in rows], xlabel)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_classes(a: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(a["classes"], key=lambda c: -c["ms_per_step"])
    labels, values = [c["class"] for c in rows], [c["pct_of_step"] for c in rows]
    if a["gpu"] is not None:
        labels.append("(GPU idle)")
        values.append(100 * a["gpu"]["idle_share"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    _bars(ax, labels, values, [f"{v:.1f}%" for v in values], f"% of step ({a['basis']})")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- running


class ProfileError(Exception):
    """A user-facing problem (bad arguments or data); printed without a traceback."""


def profile_steps(trainer, data, lr: float, steps: int, device):
    """torch.profiler over `steps` iterations after one skipped and one profiler-warm-up iteration."""
    from ffcv_ddpm.timing import sync
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    wait, warm = 1, 1
    with warnings.catch_warnings():  # the profiler warns about its own event buffering; nothing to act on
        warnings.simplefilter("ignore")
        with profile(activities=activities, schedule=schedule(wait=wait, warmup=warm, active=steps, repeat=1),
                     record_shapes=False, with_stack=False, profile_memory=False) as prof:
            for i in range(wait + warm + steps):
                with record_function(DATA_MARK):
                    images, labels = next(data)
                trainer.step(images, labels, lr)
                if i in (wait + warm - 1, wait + warm + steps - 1):
                    # The active window starts with an empty GPU queue and ends with its last kernel recorded.
                    sync(device)
                prof.step()
    return prof


def timed_block(trainer, data, lr: float, steps: int, device) -> list[float]:
    """Per-iteration ms of `steps` training iterations (timing.timed_steps: CUDA events, data wait inside, one sync)."""
    import torch

    from ffcv_ddpm.timing import timed_steps

    timed = timed_steps(lambda batch, _i: trainer.step(*batch, lr), lambda: next(data), steps, device)
    if not torch.isfinite(timed.loss_sum):
        raise ProfileError("non-finite training loss during the telemetry run")
    return timed.iter_ms


def telemetry_run(trainer, data, lr: float, device, batch: int, steps: int, rounds: int, path: Path,
                  interval_s: float, source_factory=None) -> dict:
    """Blocks of `steps` iterations without and with GpuTelemetry, alternated (ABBA...) so drift cancels.

    Without a readable GPU only the unsampled blocks run (they still give the unprofiled step time)."""
    import numpy as np

    from ffcv_ddpm.telemetry import GpuTelemetry

    def make():
        src = source_factory() if source_factory else None
        return GpuTelemetry(path, interval_s=interval_s, device_index=device.index or 0, source=src)

    probe = make()
    if not probe.enabled:
        probe.start()  # prints the one-line notice
    off, on, summaries = [], [], []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for sampled in order:
            if sampled and not probe.enabled:
                continue
            tel = make() if sampled else None
            if tel is not None:
                tel.start()
            ms = timed_block(trainer, data, lr, steps, device)  # ends with a sync: the block's work is done
            if tel is not None:
                tel.stop()
                summaries.append(tel.summary(images=steps * batch))
                on.append(ms)
            else:
                off.append(ms)
    if probe.enabled:
        probe.source.close()  # only asked whether NVML works
    off_ms, on_ms = np.concatenate(off), np.concatenate(on) if on else None
    out = {"enabled": probe.enabled, "reason": probe.reason, "steps_per_block": steps, "rounds": rounds,
           "batch_size": batch, "interval_s": interval_s,
           "ms_per_step_off": float(off_ms.mean()), "ms_median_off": float(np.median(off_ms))}
    if on:
        def agg(key, fn):
            vals = [s[key] for s in summaries if s.get(key) is not None]
            return fn(vals) if vals else None

        energy = [s["energy_j"] for s in summaries]
        images = steps * batch * len(summaries)
        out.update({
            "ms_per_step_on": float(on_ms.mean()), "ms_median_on": float(np.median(on_ms)),
            # Sampled time over unsampled time, both summed over all their blocks: 1.0 = no measurable cost.
            "overhead_ratio": float(on_ms.sum() / off_ms.sum()),
            "overhead_ratio_per_round": [float(np.sum(b) / np.sum(a)) for a, b in zip(off, on)],
            "images": images,
            "energy_j": sum(energy) if None not in energy else None,
            "j_per_img": sum(energy) / images if None not in energy else None,
            "energy_source": summaries[0]["energy_source"],
            "mean_power_w": agg("mean_power_w", np.mean),
            "max_power_w": agg("max_power_w", max),
            "mean_gpu_util_pct": agg("mean_gpu_util_pct", np.mean),
            "max_mem_used_gib": agg("max_mem_used_gib", max),
            "device": summaries[0].get("device"), "power_kind": summaries[0].get("power_kind"),
            "blocks": summaries,
        })
    return out


def _f(x, spec: str, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def telemetry_lines(t: dict) -> list[str]:
    lines = ["### Telemetry (NVML) and its overhead", ""]
    if not t["enabled"]:
        return lines + [f"{t['reason']}. Unprofiled step: {t['ms_per_step_off']:.2f} ms (mean of "
                        f"{t['rounds']} x {t['steps_per_block']} steps)."]
    per_round = ", ".join(f"{r:.4f}" for r in t["overhead_ratio_per_round"])
    energy = (f"{t['j_per_img']:.4f} J/img ({t['energy_j']:.0f} J over {t['images']:,} images, "
              f"{t['energy_source'].replace('_', ' ')})" if t["j_per_img"] is not None else "energy n/a")
    return lines + [
        f"- {t['device']}, {t['rounds']} rounds x 2 blocks x {t['steps_per_block']} steps at batch {t['batch_size']}, "
        f"sampling every {t['interval_s']} s; power = {t['power_kind']}",
        f"- Step time without sampling {t['ms_per_step_off']:.3f} ms, with {t['ms_per_step_on']:.3f} ms: overhead "
        f"ratio **{t['overhead_ratio']:.4f}** (per round: {per_round})",
        f"- **{energy}**; mean power **{_f(t['mean_power_w'], '.0f', ' W')}** (max {_f(t['max_power_w'], '.0f', ' W')})"
        f", GPU busy {_f(t['mean_gpu_util_pct'], '.0f', '%')} of the time (NVML utilization.gpu), up to "
        f"{_f(t['max_mem_used_gib'], '.1f', ' GiB')} used on the device",
    ]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = Parser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0],
               epilog="Any other key=value overrides a config field, e.g. data.batch_size=256 "
                      "train.compile=False (see ffcv_ddpm.config).")
    p.add_argument("--preset", default="ddpm-cifar10", help="model preset (ffcv_ddpm.unet.PRESETS)")
    p.add_argument("--data", type=Path, default=Path("data"), help="dataset folder (`make dataset`) or a .beton")
    p.add_argument("--steps", type=int, help="profiled (active) iterations (default: 10 on CUDA, 2 on CPU)")
    p.add_argument("--warmup", type=int, help="iterations before profiling, the first compiles (default: 20 / 3)")
    p.add_argument("--telemetry-steps", type=int, help="iterations per telemetry block (default: 100 / 2)")
    p.add_argument("--telemetry-rounds", type=int, help="rounds of (unsampled, sampled) blocks (default: 3 / 1)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between NVML samples")
    p.add_argument("--top", type=int, default=10, help="rows in the top-ops tables")
    p.add_argument("--num-synthetic", type=int, help="images in a synthetic dataset built when none exists "
                                                     "(default: 50000 on CUDA, 1024 on CPU)")
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<card>/profile-<preset>)")
    p.add_argument("--from-trace", type=Path, metavar="TRACE",
                   help="run nothing: analyse a saved trace.json.gz again and write reanalysis.md/.json beside it "
                        "(or under --out)")
    args, rest = p.parse_known_args(argv)
    bad = [r for r in rest if "=" not in r]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are key=value)")
    return args, [r.lstrip("-") for r in rest]


def main(argv: list[str] | None = None, source_factory=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse_args(argv)
        if args.from_trace:
            reanalyse(args.from_trace, args.out or args.from_trace.parent, args.top)
        else:
            run(args, overrides, argv=argv, source_factory=source_factory)
    except (ProfileError, ValueError, FileNotFoundError) as e:
        print(f"profile: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("profile: interrupted", file=sys.stderr)
        return 130
    return 0


def reanalyse(trace: Path, out: Path, top: int) -> dict:
    """The tables of a saved trace, with this version's analysis; the numbers are the trace's own kernel times."""
    if not trace.is_file():
        raise ProfileError(f"--from-trace {trace}: no such file; give a trace.json.gz written by this command")
    try:
        a = analyse(events_from_trace(trace), top=top)
    except (json.JSONDecodeError, OSError, KeyError, RuntimeError) as e:  # RuntimeError: no ProfilerStep events
        raise ProfileError(f"--from-trace {trace}: not a readable Chrome trace of profiled steps ({e})") from None
    out.mkdir(parents=True, exist_ok=True)
    link = f"[{trace.name}]({trace.name})" if out.resolve() == trace.parent.resolve() else f"`{trace}`"
    head = [f"- Re-analysis of {link} (`python -m benchmarks.profile --from-trace {trace}`); "
            "device, config and commit are those of the run that wrote it (profile.md, summary.json)"]
    text = "\n".join([f"# Re-analysis: {trace}", "", *head, "", *top_ops_lines(a), "", *class_lines(a), ""])
    (out / "reanalysis.md").write_text(text)
    (out / "reanalysis.json").write_text(json.dumps({"trace": str(trace), **a}, indent=1, default=str) + "\n")
    print(text)
    print(f"profile: wrote {out}/reanalysis.md, reanalysis.json")
    return a


def _dataset(args, cuda: bool) -> tuple[Path, dict, bool]:
    from benchmarks.bench import BETON, BenchError, ensure_dataset
    from ffcv_ddpm.data import dataset_info

    if args.data.suffix == ".beton":
        beton, built = args.data, False
        if not beton.is_file():
            raise ProfileError(f"--data {beton} does not exist; run `make dataset` or give a dataset folder")
    else:
        beton = args.data / BETON
        try:
            built = ensure_dataset(args.data, beton, args.num_synthetic or (50_000 if cuda else 1024))
        except BenchError as e:
            raise ProfileError(str(e)) from None
    return beton, dataset_info(beton), built


def run(args: argparse.Namespace, overrides: list[str], argv: list[str], source_factory=None) -> dict:
    import torch

    from benchmarks.peaks import card_slug
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.data import endless, make_loader
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.telemetry import plot_telemetry
    from ffcv_ddpm.step import TrainingError, build, resolve_device
    from ffcv_ddpm.timing import untimed_steps

    cfg = load_config(args.preset, overrides)  # ValueError names a bad preset or override
    try:
        device = resolve_device(cfg.train.device)
    except TrainingError as e:
        raise ProfileError(str(e)) from None
    cuda = device.type == "cuda"
    steps = args.steps if args.steps is not None else (10 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (20 if cuda else 3)
    tsteps = args.telemetry_steps if args.telemetry_steps is not None else (100 if cuda else 2)
    rounds = args.telemetry_rounds if args.telemetry_rounds is not None else (3 if cuda else 1)
    if steps < 1 or warmup < 0 or tsteps < 1 or rounds < 1 or args.top < 1 or args.interval <= 0:
        raise ProfileError("--steps, --telemetry-steps, --telemetry-rounds and --top must be >= 1, --warmup >= 0 "
                           f"and --interval > 0 (got {steps}, {tsteps}, {rounds}, {args.top}, {warmup}, "
                           f"{args.interval})")
    beton, dataset, built = _dataset(args, cuda)
    cfg.data.path = str(beton)
    device_name = torch.cuda.get_device_name(device) if cuda else None
    out = args.out or REPO / "benchmarks" / "results" / card_slug(device_name) / f"profile-{args.preset}"
    out.mkdir(parents=True, exist_ok=True)
    where = f"CUDA ({device_name})" if cuda else "CPU only (CPU activities; no GPU telemetry)"
    print(f"profile: {args.preset} on {where}, batch {cfg.data.batch_size}, {cfg.train.precision}, "
          f"compile={cfg.train.compile and cuda}, attention {cfg.model.attn_impl}, loader {cfg.data.loader}; "
          f"data {beton} ({dataset['num_images']} images"
          + (", SYNTHETIC)" if dataset["synthetic"] else ")"), flush=True)

    loader = make_loader(cfg.data, device)
    trainer = build(cfg, device)
    data = endless(loader)
    lr = cfg.train.lr
    # At least one: the compiling step must never be profiled.
    warmup_s = untimed_steps(lambda batch, _i: trainer.step(*batch, lr), lambda: next(data), max(1, warmup), device)
    print(f"profile: {max(1, warmup)} warm-up steps in {warmup_s:.1f} s; profiling {steps} steps", flush=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    prof = profile_steps(trainer, data, lr, steps, device)
    a = analyse(prof.events(), top=args.top)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    trace = out / "trace.json.gz"
    _export_trace(prof, trace)
    del prof

    tjsonl = out / "telemetry.jsonl"
    tjsonl.unlink(missing_ok=True)  # GpuTelemetry appends: start this run's file afresh
    print(f"profile: telemetry run: {rounds} x (unsampled, sampled) blocks of {tsteps} steps", flush=True)
    tel = telemetry_run(trainer, data, lr, device, cfg.data.batch_size, tsteps, rounds, tjsonl, args.interval,
                        source_factory)

    # ---- write ---------------------------------------------------------------------------------------------------
    env = environment()
    title = (f"{args.preset}, batch {cfg.data.batch_size}, {cfg.train.precision}, compile={cfg.train.compile and cuda}"
             f" - {device_name or 'CPU'} - torch {env['torch']} - {(env.get('commit') or 'no git')[:10]}")
    files = {"trace": trace.name, "top_ops": "top_ops.md", "op_classes": "op_classes.md", "summary": "summary.json"}
    if tjsonl.is_file():
        plot_telemetry(tjsonl, out / "telemetry.png", title=title)
        files.update(telemetry="telemetry.jsonl", telemetry_plot="telemetry.png")
    summary = {
        "schema": 1,
        "command": ["python", "-m", "benchmarks.profile", *argv],
        "environment": env,
        "device_name": device_name,
        "config": cfg.to_dict(),
        "dataset": dataset,
        "dataset_built_now": built,
        "settings": {"steps": steps, "warmup": warmup, "telemetry_steps": tsteps, "telemetry_rounds": rounds,
                     "interval_s": args.interval, "profiler_schedule": {"wait": 1, "warmup": 1, "active": steps}},
        "warmup_s": warmup_s,
        "peak_mem_gib_profiled": peak_mem,
        "profile": a,
        "telemetry": tel,
        "files": files,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    (out / "top_ops.json").write_text(json.dumps({"top_ops": a["top_ops"], "top_kernels": a["top_kernels"]},
                                                 indent=1) + "\n")
    head = _header(summary)
    (out / "top_ops.md").write_text("\n".join([f"# Top ops: {title}", "", *head, "", *top_ops_lines(a), ""]))
    (out / "op_classes.md").write_text("\n".join([f"# Op classes: {title}", "", *head, "", *class_lines(a), ""]))
    plot_top(a, out / "top_ops.png", title)
    plot_classes(a, out / "op_classes.png", title)
    pics = ["![top ops](top_ops.png)", "", "![op classes](op_classes.png)"]
    if "telemetry_plot" in files:
        pics += ["", "![telemetry](telemetry.png)"]
    (out / "profile.md").write_text("\n".join([
        f"# Profile: {title}", "", *head, "", *top_ops_lines(a), "", *class_lines(a), "", *telemetry_lines(tel), "",
        *pics, ""]))

    best = sorted(a["classes"], key=lambda c: -c["ms_per_step"])[:3]
    print("profile: " + ", ".join(f"{c['class']} {c['pct_of_total']:.0f}%" for c in best) + f" of {a['basis']}")
    if tel["enabled"]:
        print(f"profile: telemetry overhead ratio {tel['overhead_ratio']:.4f}; "
              + (f"{tel['j_per_img']:.4f} J/img, " if tel["j_per_img"] is not None else "")
              + f"mean power {_f(tel['mean_power_w'], '.0f', ' W')}")
    print(f"profile: wrote {out}/ (profile.md, trace.json.gz, top_ops.*, op_classes.*, summary.json"
          + (", telemetry.*)" if tjsonl.is_file() else ")"))
    return summary


def _export_trace(prof, path: Path) -> None:
    """Chrome trace, gzipped (Perfetto and chrome://tracing open .json.gz); warns when too big to commit."""
    raw = path.with_suffix("")  # trace.json
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    mb = path.stat().st_size / 2**20
    if mb > TRACE_LIMIT_MB:
        print(f"profile: WARNING: {path} is {mb:.1f} MB (> {TRACE_LIMIT_MB} MB): rerun with fewer --steps "
              "before committing it", flush=True)


def _header(s: dict) -> list[str]:
    env, a, cfg = s["environment"], s["profile"], s["config"]
    commit = (env.get("commit") or "unknown")[:10] + (" (dirty)" if env.get("dirty") else "")
    ds = s["dataset"]
    step = (f"GPU step span {a['gpu']['span_ms_per_step']:.2f} ms, kernels busy {a['gpu']['busy_ms_per_step']:.2f} "
            f"ms ({100 * (1 - a['gpu']['idle_share']):.0f}%); CPU {a['cpu_step_ms']:.2f} ms per step"
            if a["gpu"] else f"CPU step {a['cpu_step_ms']:.2f} ms")
    unprof = s["telemetry"]["ms_per_step_off"]
    return [
        f"- Device: {s['device_name'] or 'CPU only'}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"cuDNN {env.get('cudnn')}, Python {env.get('python')}; commit {commit}, {env.get('date_utc')}",
        f"- Command: `{' '.join(s['command'])}`",
        f"- Config: preset {cfg['preset']}, batch {cfg['data']['batch_size']}, {cfg['train']['precision']}, "
        f"compile={cfg['train']['compile'] and bool(s['device_name'])}, attention {cfg['model']['attn_impl']}, "
        f"channels_last={cfg['train']['channels_last']}, fused AdamW={cfg['train']['fused_adam']}, loader "
        f"{cfg['data']['loader']}"
        + (f" ({cfg['data']['num_workers']} workers)" if cfg["data"]["loader"] != "gpu" else "")
        + f", flip {cfg['data']['flip']}",
        f"- Data: {ds.get('path')} ({ds.get('num_images')} images"
        + (", SYNTHETIC: speed only)" if ds.get("synthetic") else ")"),
        f"- Profiled: {a['steps']} steps after {s['settings']['warmup']} warm-up steps + 2 profiler warm-up steps; "
        f"{step} under the profiler; unprofiled step {unprof:.2f} ms"
        + (" (CUDA events)" if s["device_name"] else " (perf_counter)")
        + (f"; peak memory {s['peak_mem_gib_profiled']:.1f} GiB" if s["peak_mem_gib_profiled"] else ""),
        f"- Trace: [{s['files']['trace']}]({s['files']['trace']}) (ui.perfetto.dev or chrome://tracing)",
    ]


if __name__ == "__main__":
    sys.exit(main())
