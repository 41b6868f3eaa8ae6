"""What a torch.profiler trace says: each kernel and op in an op class, per-step tables, charts. Pure analysis, no GPU.

    a = analyse(prof.events())                       # from a live profile (benchmarks.speed.profile)
    a = analyse(events_from_trace("trace.json.gz"))  # from a saved trace, on any machine
    python -m benchmarks.speed.profile --from-trace results/h200/profile-ddpm-cifar10/trace.json.gz   # the command

How a kernel gets its class: by its own name where that is unambiguous (cuDNN fprop/dgrad/wgrad, flash/SDPA,
fused Adam / multi_tensor_apply, memcpy, group-norm kernels, Triton kernels by their fused op names), else by the
outermost op on the CPU stack that launched it (a cuBLAS kernel under aten::convolution is a convolution; any
kernel under Optimizer.step is the optimizer), else by generic kernel names (gemm -> matmul, elementwise).
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import md_table, pyplot, save_figure, write_json, write_text


class TraceError(ValueError):
    """A file that is not a readable trace of profiled steps; one line for the user."""


STEP_PREFIX = "ProfilerStep"  # torch.profiler's per-step events ("ProfilerStep#3", shown as "ProfilerStep*")
# Events the profiler records about itself, on the device timeline, with no kernel behind them.
PROFILER_OVERHEAD = frozenset({"Command Buffer Full", "Activity Buffer Request"})
DATA_MARK = "data: next batch"  # our record_function around the loader, so data time has a name in the trace
# ---------------------------------------------------------------------------------------------------- op classes

CLASSES = ("convolution fwd", "convolution bwd", "attention", "matmul (gemm)", "normalization",
           "elementwise/activation", "optimizer", "data/copies", "communication", "other")
# NCCL's kernels and the c10d ops that launch them (DDP's gradient all-reduce): they run on their own stream.
_COMM = re.compile(r"nccl|c10d::|all_?reduce|all_?gather|reduce_?scatter", re.IGNORECASE)

_ELEMENTWISE_OPS = ("add|sub|rsub|mul|div|silu|silu_backward|gelu|relu|sigmoid|tanh|exp|log|pow|sqrt|rsqrt|neg|"
                    "where|mean|sum|mse_loss|mse_loss_backward|sin|cos|fill|zero|clamp|clamp_min|abs|maximum|"
                    "minimum|lerp|addcmul|addcdiv|normal|uniform|random|randint|randn|rand|bernoulli|lt|gt|le|ge|"
                    "eq|ne|flip|isfinite|square|reciprocal|sign|threshold_backward|sigmoid_backward|arange|exp2")
_ELEMENTWISE_NODES = "silu|mul|add|sub|rsub|div|mean|sum|mseloss|pow|exp|neg|sqrt|rsqrt|where|sin|cos|clamp|flip|tanh"

# Names that say what they are wherever they appear (a kernel, an aten op, an autograd node, a user annotation).
# Order matters: cuDNN's SDPA kernels say "fprop" too, so attention comes before convolution.
_SPECIFIC = tuple((c, re.compile(p)) for c, p in (
    ("communication", _COMM.pattern.lower()),
    ("data/copies", r"^data:|memcpy|memset|direct_copy|copy_kernel|catarraybatchedcopy|nchwtonhwc|nhwctonchw"
                    r"|^aten::(copy_|to|_to_copy|contiguous|clone|cat|index_select|_pin_memory|pin_memory)$"),
    ("optimizer", r"^optimizer\.|multi_tensor_apply|adam|_foreach_"),
    # cuDNN's SDPA backward also runs two helpers of its own: dot(dO, O) per row, and dQ's conversion to 16 bits.
    ("attention", r"flash|fmha|attention|sdpa|softmax|compute_dot_do_o|convert_dq_to_16bits"),
    ("convolution bwd", r"dgrad|wgrad|convolution_?backward|conv2d_backward|conv_bwd"),
    ("convolution fwd", r"fprop|convolve|convolution|conv2d|winograd|implicit_gemm|conv_fwd"),
    # var_mean: the statistics of the default (scale-shift) GroupNorm, whose apply step is plain elementwise work.
    ("normalization", r"group_?norm|layer_?norm|batch_?norm|rowwisemoments|computefusedparams|gammabeta"
                      r"|compute1d|var_mean"
                      # The fused GroupNorm's own Triton kernels (ffcv_ddpm/gn_kernels.py): under CUDA graphs nothing
                      # but their names says what they are (the launching op is the whole compiled graph).
                      r"|^_(stats|finalize|apply|bwd_reduce|bwd_finalize|bwd_dx)_kernel$"),
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
    if re.search(r"group_?norm|layer_?norm|batch_?norm|var_mean", ops):
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
        # Communication overlapped by compute costs nothing; what runs alone (busy time the compute kernels do not
        # cover) is what DDP adds to the step.
        comm = [k for k in kernels if _COMM.search(k.name)]
        alone_us = busy_us - _union_us([(k.time_range.start, k.time_range.end) for k in kernels
                                        if not _COMM.search(k.name)])
        gpu = {"span_ms_per_step": span_us / n / 1e3, "busy_ms_per_step": busy_us / n / 1e3,
               "kernel_ms_per_step": kernel_us / n / 1e3, "idle_share": 1 - busy_us / span_us if span_us else None,
               "comm_ms_per_step": sum(k.time_range.elapsed_us() for k in comm) / n / 1e3,
               "comm_exposed_ms_per_step": alone_us / n / 1e3}

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


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def top_ops_lines(a: dict) -> list[str]:
    cuda = a["gpu"] is not None
    step = (f"GPU step span {a['gpu']['span_ms_per_step']:.2f} ms" if cuda else f"CPU step {a['cpu_step_ms']:.2f} ms")
    lines = [f"### Top {len(a['top_ops'])} ops by {'self CUDA' if cuda else 'self CPU'} time "
             f"(per step; % of the {step})", ""]
    lines += md_table(["#", "op", "class", "calls", "self CUDA ms", "self CPU ms", "CPU total ms", "% of step"],
                       [[str(i), f"`{short(r['name'])}`", r["class"], f"{r['calls_per_step']:g}",
                         _ms(r["self_cuda_ms"]), _ms(r["self_cpu_ms"]), _ms(r["cpu_total_ms"]),
                         f"{r['pct_of_step']:.1f}%"]
                        for i, r in enumerate(a["top_ops"], 1)])
    if a["top_kernels"]:
        lines += ["", f"### Top {len(a['top_kernels'])} GPU kernels (per step)", ""]
        lines += md_table(["#", "kernel", "class", "calls", "GPU ms", "% of step", "% of GPU time", "launched by"],
                           [[str(i), f"`{short(r['name'])}`", r["class"], f"{r['calls_per_step']:g}",
                             _ms(r["gpu_ms"]), f"{r['pct_of_step']:.1f}%", f"{r['pct_of_gpu']:.1f}%",
                             f"`{short(r['launched_by'], 40)}`"] for i, r in enumerate(a["top_kernels"], 1)])
    if a.get("copies"):
        unit = "GPU ms" if cuda else "self CPU ms"
        lines += ["", "### Where the copies come from (aten::copy_ by the op that asked for it, per step)", ""]
        lines += md_table(["asked for by", "via", "calls", unit],
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
        if g.get("comm_ms_per_step"):
            exposed = g["comm_exposed_ms_per_step"]
            rows.append(["(communication with no compute beside it)", _ms(exposed), "-",
                         f"{100 * exposed / g['span_ms_per_step']:.1f}%"])
    total = "% of GPU kernel time" if cuda else "% of CPU op time"
    lines += md_table(["class", "ms", total, "% of step"], rows)
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
    plt = pyplot()

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
    save_figure(fig, path, 110)


def plot_classes(a: dict, path: Path, title: str) -> None:
    plt = pyplot()

    rows = sorted(a["classes"], key=lambda c: -c["ms_per_step"])
    labels, values = [c["class"] for c in rows], [c["pct_of_step"] for c in rows]
    if a["gpu"] is not None:
        labels.append("(GPU idle)")
        values.append(100 * a["gpu"]["idle_share"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    _bars(ax, labels, values, [f"{v:.1f}%" for v in values], f"% of step ({a['basis']})")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, 110)


def reanalyse(trace: Path, out: Path, top: int) -> dict:
    """The tables of a saved trace, with this version's analysis; the numbers are the trace's own kernel times."""
    if not trace.is_file():
        raise TraceError(f"--from-trace {trace}: no such file; give a trace.json.gz written by this command")
    try:
        a = analyse(events_from_trace(trace), top=top)
    except (json.JSONDecodeError, OSError, KeyError, RuntimeError) as e:  # RuntimeError: no ProfilerStep events
        raise TraceError(f"--from-trace {trace}: not a readable Chrome trace of profiled steps ({e})") from None
    out.mkdir(parents=True, exist_ok=True)
    link = f"[{trace.name}]({trace.name})" if out.resolve() == trace.parent.resolve() else f"`{trace}`"
    head = [f"- Re-analysis of {link} (`python -m benchmarks.speed.profile --from-trace {trace}`); "
            "device, config and commit are those of the run that wrote it (profile.md, summary.json)"]
    text = "\n".join([f"# Re-analysis: {trace}", "", *head, "", *top_ops_lines(a), "", *class_lines(a), ""])
    write_text(out / "reanalysis.md", text)
    write_json(out / "reanalysis.json", {"trace": str(trace), **a})
    print(text)
    print(f"profile: wrote {out}/reanalysis.md, reanalysis.json")
    return a
