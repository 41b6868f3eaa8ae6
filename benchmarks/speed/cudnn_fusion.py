"""cuDNN's own fusions for GroupNorm's passes around a 3x3 convolution: which it runs, and at what rate (issue 47).

    python -m benchmarks.speed.cudnn_fusion --out DIR                  # CUDA, with nvidia-cudnn-frontend importable
    python -m benchmarks.speed.cudnn_fusion --out DIR --sites 3 data.batch_size=512

NOTES 27: past ~42% the step needs fewer passes, not faster kernels: the statistics' read of each convolution's
output, the apply pass that writes the next convolution's input. NOTES 28: a Triton convolution that does those
itself runs at 57% of cuDNN's rate, and loses. cuDNN's graph API fuses pointwise prologues and statistics epilogues
into its own convolution kernels; it was built for BatchNorm (per-channel scale-bias-ReLU before the convolution,
per-channel sums after it), and GroupNorm needs them per (sample, channel). Whether cuDNN builds those graphs, and
at what cost over its plain convolution, decides whether a convolution of cuDNN's own can own its GroupNorm. Per
distinct 3x3 site of the model (conv_gn_bench.record_sites), at the step's batch, bf16 (--dtype), channels_last:

    graph                 what it would replace
    conv                  nothing: the graph API's convolution against F.conv2d (its plan choice)
    conv+genstats         BatchNorm's epilogue (per-channel sums): the control cuDNN documents
    conv+stats_nc         the next GroupNorm's statistics pass: per-(sample, channel) sum and sum of squares
    sbr+conv              BatchNorm's prologue (per-channel scale, bias, ReLU): the control
    gn_silu+conv          the input's GroupNorm apply + SiLU (per-(sample, channel) scale and shift) as the prologue
    gn_silu+conv+stats_nc both: the forward of a res block's convolution, dropout aside
    gn_silu+wgrad         the weight gradient that recomputes the activation from the convolution's input
    dgrad+dsilu           the data gradient with SiLU's backward in its epilogue

A graph cuDNN has no engine for is a row with its error. A supported one is checked against torch in fp32 and timed
as a CUDA graph (clocks.graph_ms), beside F.conv2d (or its weight / data gradient) in the same process, and
beside a bf16 copy of the bytes the fusion removes (the "passes" column: what today's separate kernels move at
the copy rate). A fusion pays where its extra time over the plain convolution is below that. The dropout between a
res block's norm2 and conv2 and the up path's two-part inputs are not in these graphs: the rows measure the
mechanism on one input tensor. cudnn_fusion.json and .md are rewritten after every site.

Install on a machine without network: `pip download --no-deps nvidia-cudnn-frontend` where there is one, carry the
wheel, `pip install --no-deps`; it uses the cuDNN library torch loaded.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import fail

GRAPHS = ("conv", "conv+genstats", "conv+stats_nc", "sbr+conv", "gn_silu+conv", "gn_silu+conv+stats_nc",
          "gn_silu+wgrad", "dgrad+dsilu")
TOL = 2e-2  # max |cuDNN - fp32 torch| / max |fp32 torch|: bf16 inputs and outputs, fp32 accumulation


def preload_nvrtc_builtins() -> str | None:
    """cuDNN's runtime-fusion engines compile their kernels with NVRTC, which dlopens libnvrtc-builtins by its bare
    name from the caller's search path: cuDNN's RUNPATH (nvidia/cudnn/lib), where pip's CUDA wheels do not put it, a
    known cause of COMPILATION_FAILED. Loading the builtins first, globally, from the wheel that ships NVRTC (or
    CUDA_HOME) rules that cause out. It was not the cause on the H200 image of results/h200/cudnn-fusion-75836a2:
    every prologue graph still failed to compile, preloaded or on LD_LIBRARY_PATH. Returns the path loaded (the
    report names it), or None where none was found."""
    import ctypes
    import glob
    import os
    import site

    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    pattern = [os.path.join(r, "nvidia", "*", "lib", "libnvrtc-builtins.so*") for r in roots if r]
    pattern.append(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "libnvrtc-builtins.so*"))
    for pat in pattern:
        for path in sorted(glob.glob(pat)):
            if ".alt." in path or path.endswith(".a"):
                continue
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
            except OSError:
                continue
    return None


def passes_removed(graph: str, n: int, cin: int, cout: int, h: int, ho: int) -> int:
    """Bytes (bf16) that the separate kernels move and the fused graph does not: the activation written and read
    again (the prologue; dSiLU's input gradient in dgrad+dsilu), the output read again (per-(sample, channel)
    statistics). The BatchNorm controls are priced as their GroupNorm counterparts."""
    act, out = 2 * n * h * h * cin, 2 * n * ho * ho * cout
    prologue = 2 * act if graph.startswith(("gn_silu", "sbr")) or graph == "dgrad+dsilu" else 0
    if graph == "gn_silu+wgrad":
        prologue = act  # the backward reads x instead of the saved activation: the forward's write is what goes
    return prologue + (out if "stats" in graph or "genstats" in graph else 0)


class Site:
    """One site's tensors (random, not zero), its torch references and the cuDNN graphs built on them."""

    def __init__(self, cudnn, handle, cin: int, cout: int, h: int, stride: int, batch: int, device: str = "cuda",
                 dtype: str = "bf16", intermediate: str = "io"):
        self.cudnn, self.handle, self.stride, self.device = cudnn, handle, stride, device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        self.io = {"bf16": cudnn.data_type.BFLOAT16, "fp16": cudnn.data_type.HALF}[dtype]
        # cuDNN's own samples of its BatchNorm fusions keep the intermediates at the io type (fp16); fp32
        # intermediates were refused at every site on an H200 (results/h200/cudnn-fusion-7d43009)
        self.intermediate = self.io if intermediate == "io" else cudnn.data_type.FLOAT
        g = torch.Generator(device=device).manual_seed(0)
        cl = torch.channels_last

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, device=device, generator=g) * scale).to(self.dtype).to(memory_format=cl)

        self.x = rand(batch, cin, h, h)
        self.w = rand(cout, cin, 3, 3, scale=(cin * 9) ** -0.5)
        self.scale_nc, self.shift_nc = rand(batch, cin, 1, 1, scale=0.5) + 1, rand(batch, cin, 1, 1, scale=0.5)
        self.scale_c, self.shift_c = self.scale_nc[:1].clone(), self.shift_nc[:1].clone()
        self.ho = (h - 1) // stride + 1
        self.dy = rand(batch, cout, self.ho, self.ho)

    def conv(self, x):
        return F.conv2d(x, self.w, stride=self.stride, padding=1)

    # ---- the graphs --------------------------------------------------------------------------------------------
    def build(self, name: str, lower: bool = True):
        """(execute(), output tensors, fp32 references); raises cudnn's error when no engine supports the graph.
        lower=False stops before the graph is lowered to cuDNN's (which needs a GPU): the tests' check that every
        node is built as the frontend's Python API takes it."""
        cudnn = self.cudnn
        g = cudnn.pygraph(io_data_type=self.io, intermediate_data_type=self.intermediate,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        X, W = g.tensor_like(self.x), g.tensor_like(self.w)
        feeds = {X: self.x, W: self.w}
        conv_args = dict(padding=[1, 1], stride=[self.stride] * 2, dilation=[1, 1])
        xf, wf = self.x.float(), self.w.float()
        a_ref = xf  # the convolution's input as torch computes it
        inp = X
        if name.startswith(("gn_silu", "sbr")):
            s, b = (self.scale_nc, self.shift_nc) if name.startswith("gn_silu") else (self.scale_c, self.shift_c)
            S, B = g.tensor_like(s), g.tensor_like(b)
            feeds.update({S: s, B: b})
            pre = g.bias(input=g.scale(input=X, scale=S), bias=B)
            inp = g.swish(input=pre) if name.startswith("gn_silu") else g.relu(input=pre)
            a_ref = xf * s.float() + b.float()
            a_ref = F.silu(a_ref) if name.startswith("gn_silu") else F.relu(a_ref)
        outs, refs = {}, {}
        if name.endswith("wgrad"):
            DY = g.tensor_like(self.dy)
            feeds[DY] = self.dy
            DW = g.conv_wgrad(image=inp, loss=DY, **conv_args)
            outs["dw"] = torch.empty_like(self.w)
            DW.set_output(True).set_dim(list(self.w.shape)).set_stride(list(self.w.stride()))
            DW.set_data_type(self.io)
            feeds[DW] = outs["dw"]
            refs["dw"] = torch.nn.grad.conv2d_weight(a_ref, self.w.shape, self.dy.float(), self.stride, 1)
        elif name == "dgrad+dsilu":
            DY = g.tensor_like(self.dy)
            feeds[DY] = self.dy
            DA = g.conv_dgrad(loss=DY, filter=W, **conv_args)
            DA.set_dim(list(self.x.shape)).set_stride(list(self.x.stride()))
            DX = g.swish_backward(loss=DA, input=X)  # the gradient at SiLU's input: x is the pre-activation here
            outs["dx"] = torch.empty_like(self.x)
            DX.set_output(True).set_data_type(self.io)
            feeds[DX] = outs["dx"]
            da = torch.nn.grad.conv2d_input(self.x.shape, wf, self.dy.float(), self.stride, 1)
            sig = torch.sigmoid(xf)
            refs["dx"] = da * sig * (1 + xf * (1 - sig))
        else:
            Y = g.conv_fprop(image=inp, weight=W, **conv_args)
            outs["y"] = torch.empty(self.dy.shape, device=self.device, dtype=self.dtype).to(
                memory_format=torch.channels_last)
            Y.set_output(True).set_stride(list(outs["y"].stride())).set_data_type(self.io)
            feeds[Y] = outs["y"]
            y_ref = F.conv2d(a_ref, wf, stride=self.stride, padding=1)
            refs["y"] = y_ref
            n, c = y_ref.shape[:2]
            if name.endswith("+genstats"):
                SUM, SQ = g.genstats(input=Y)
                shape = (1, c, 1, 1)
                refs["sum"], refs["sq"] = y_ref.sum((0, 2, 3)).view(shape), (y_ref ** 2).sum((0, 2, 3)).view(shape)
            elif name.endswith("+stats_nc"):
                SUM = g.reduction(input=Y, mode=cudnn.reduction_mode.ADD)
                SQ = g.reduction(input=g.mul(a=Y, b=Y), mode=cudnn.reduction_mode.ADD)
                shape = (n, c, 1, 1)
                for T in (SUM, SQ):
                    T.set_dim(list(shape)).set_stride([c, 1, c, c])
                refs["sum"], refs["sq"] = y_ref.sum((2, 3)).view(shape), (y_ref ** 2).sum((2, 3)).view(shape)
            if "stats" in name:
                for key, T in (("sum", SUM), ("sq", SQ)):
                    T.set_output(True).set_data_type(cudnn.data_type.FLOAT)
                    outs[key] = torch.zeros(shape, device=self.device, dtype=torch.float32)
                    feeds[T] = outs[key]
        if not lower:
            return None, outs, refs
        g.validate()  # lowers the graph to cuDNN's: from here on a GPU
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        workspace = torch.empty(max(g.get_workspace_size(), 1), device=self.device, dtype=torch.uint8)
        accumulates = [outs[k] for k in ("sum", "sq") if k in outs]

        def execute():
            for t in accumulates:  # genstats accumulates (its test zeroes the sums first)
                t.zero_()
            cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
            g.execute(feeds, workspace, handle=self.handle)

        return execute, outs, refs

    def baseline(self, name: str):
        """What the fused graph's arithmetic costs in torch's own call: F.conv2d, or its weight / data gradient."""
        def grad(mask):
            return lambda: torch.ops.aten.convolution_backward(
                self.dy, self.x, self.w, None, [self.stride] * 2, [1, 1], [1, 1], False, [0, 0], 1, mask)

        if name.endswith("wgrad"):
            return grad([False, False, True])
        if name == "dgrad+dsilu":
            return grad([True, False, False])
        return lambda: self.conv(self.x)


def timed(fn, iters: int) -> tuple[float, str]:
    """ms per call from CUDA-graph replays; from CUDA events around each call if the graph cannot be captured."""
    from benchmarks.speed.clocks import graph_ms, time_ms

    try:
        return graph_ms(fn, iters, warmup=2), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return time_ms(fn, 2 * iters, warmup=2), "events"


def rel_error(outs: dict, refs: dict) -> float:
    return max(float((outs[k].float() - refs[k]).abs().max() / refs[k].abs().max().clamp_min(1e-12)) for k in refs)


def render(result: dict) -> str:
    lines = [f"# cuDNN's fusions for GroupNorm around a 3x3 convolution ({result.get('device_name')})", "",
             f"`{result['command']}`", "",
             f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}, cuDNN "
             f"{result.get('cudnn_backend')}, cudnn-frontend {result.get('cudnn_frontend')}; batch {result['batch']}, "
             f"{result.get('dtype', 'bf16')} (intermediates {result.get('intermediate', 'float')}), channels_last; ms "
             "per call, CUDA-graph replays (median; events where one could not be captured); "
             f"copy rate {result.get('copy_gbs', 0):.0f} GB/s (a bf16 clone of 128 MB); NVRTC's builtins preloaded "
             f"from {result.get('nvrtc_builtins')}.", "",
             "extra = the graph's ms - torch's same arithmetic (F.conv2d or its gradient) in the same process; "
             "passes = the bytes the fusion removes, at the copy rate. A fusion pays where extra < passes.", ""]
    rows = []
    for site in result["sites"]:
        for r in site.get("graphs", []):
            if r.get("error"):
                # cuDNN's "no engine for this graph" is an answer; any other error a question for the next call
                kind = "unsupported" if "NotSupported" in r["error"].split(":")[0] else "error"
                cell = ["-", "-", "-", f"{kind}: " + r["error"][:140].replace("|", "/").replace("\n", " ")]
            else:
                ok = "ok" if r["rel_err"] <= TOL else f"WRONG ({r['rel_err']:.1e})"
                cell = [f"{r['ms']:.3f}", f"{r['ms'] - r['base_ms']:+.3f}", f"{r['passes_ms']:.3f}",
                        f"{ok}, base {r['base_ms']:.3f} ms" + ("" if r["timing"] == "graph" else ", events")]
            rows.append([site["name"], f"{site['count']}", r["graph"], *cell])
    lines += md_table(["site", "a step", "graph", "ms", "extra ms", "passes ms", "check"], rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.speed.conv_gn_bench import site_parser

    p = site_parser("cudnn_fusion", __doc__)
    p.add_argument("--graphs", default=",".join(GRAPHS), help=f"comma-separated, of {', '.join(GRAPHS)}")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="the inputs' and outputs' type")
    p.add_argument("--intermediate", choices=("io", "float"), default="io",
                   help="the type of the graph's virtual tensors (the prologue's and the statistics' operands)")
    args, overrides = p.parse_with_overrides(argv)
    graphs = [g for g in args.graphs.split(",") if g]
    if bad := [g for g in graphs if g not in GRAPHS]:
        return fail("cudnn_fusion", f"--graphs {','.join(bad)}: expected some of {', '.join(GRAPHS)}")
    from ffcv_ddpm.config import load_config

    try:
        cfg = load_config(args.preset, ["data.batch_size=1024", *overrides])
    except ValueError as e:
        return fail("cudnn_fusion", str(e))
    if not torch.cuda.is_available():
        return fail("cudnn_fusion", "needs a CUDA GPU (cuDNN's graphs run only there)")
    try:
        import cudnn
    except ImportError as e:
        return fail("cudnn_fusion", f"cannot import cudnn ({e}): pip install --no-deps nvidia-cudnn-frontend (a "
                                    "wheel downloaded elsewhere, on a machine without network)")
    from benchmarks.speed.conv_gn_bench import sites_by_cost
    from benchmarks.speed.copy_rate import copy_gb_per_s
    from ffcv_ddpm.env import environment

    nvrtc_builtins = preload_nvrtc_builtins()

    torch.backends.cudnn.benchmark = True  # F.conv2d's baseline as the step runs it
    batch = cfg.data.batch_size
    sites = sites_by_cost(cfg.model, batch)[:args.sites]  # (None: all)
    handle = cudnn.create_handle()
    result = {"command": "python -m benchmarks.speed.cudnn_fusion " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "device_name": torch.cuda.get_device_name(), "batch": batch,
              "cudnn_backend": cudnn.backend_version_string(), "cudnn_frontend": getattr(cudnn, "__version__", "?"),
              "torch_cudnn": torch.backends.cudnn.version(), "graphs": graphs, "dtype": args.dtype,
              "intermediate": args.intermediate, "nvrtc_builtins": nvrtc_builtins, "sites": []}
    args.out.mkdir(parents=True, exist_ok=True)
    result["copy_gbs"] = copy_gb_per_s(128 << 20, iters=args.iters)
    t0 = time.time()
    for spec, count in sites:
        site = Site(cudnn, handle, spec.cin, spec.cout, spec.h, spec.stride, batch, dtype=args.dtype,
                    intermediate=args.intermediate)
        entry = {"name": spec.name(), "count": count, "site": {"cin": spec.cin, "cout": spec.cout, "h": spec.h,
                                                                "stride": spec.stride}, "graphs": []}
        result["sites"].append(entry)
        for name in graphs:
            row = {"graph": name}
            try:
                execute, outs, refs = site.build(name)
                execute()
                torch.cuda.synchronize()
                row["rel_err"] = rel_error(outs, refs)
                row["ms"], row["timing"] = timed(execute, args.iters)
                row["base_ms"] = timed(site.baseline(name), args.iters)[0]
                removed = passes_removed(name, batch, spec.cin, spec.cout, spec.h, site.ho)
                row["passes_gb"] = removed / 1e9
                row["passes_ms"] = removed / result["copy_gbs"] / 1e6
            except Exception as e:  # noqa: BLE001 - cuDNN's "not supported" comes in several types: each is a row
                row["error"] = f"{type(e).__name__}: {e}"
            entry["graphs"].append(row)
            write_json(args.out / "cudnn_fusion.json", result)
            write_text(args.out / "cudnn_fusion.md", render(result))
            state = row.get("error") or f"{row['ms']:.3f} ms (base {row['base_ms']:.3f}, err {row['rel_err']:.1e})"
            print(f"cudnn_fusion: [{time.time() - t0:.0f} s] {entry['name']} {name}: {state}", flush=True)
        del site
        torch.cuda.empty_cache()
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
