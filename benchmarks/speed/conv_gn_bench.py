"""The convolution that owns its GroupNorm (ffcv_ddpm.conv_gn), forward only, against what it replaces (issue 47).

    python -m benchmarks.speed.conv_gn_bench --out DIR                 # CUDA: every 3x3 conv site, batch 1024
    python -m benchmarks.speed.conv_gn_bench --out DIR --sites 3 data.batch_size=512
    TRITON_INTERPRET=1 python -m benchmarks.speed.conv_gn_bench --out DIR --smoke --sites 1   # CPU, seconds

The sites come from the model: one forward of the preset (as the overrides configure it) at a small batch records
every 3x3 convolution, what normalised its input (the GroupNormAct whose output it reads: SiLU, dropout, one or two
parts) and what reads its output (a GroupNorm, directly or after a residual add; the time embedding a GroupNorm adds,
which the fused epilogue adds instead), and how many times a step each distinct site occurs. Per site, at the
step's batch, bf16, channels_last, one GPU:

- cuDNN: F.conv2d alone (no bias, as inductor calls it; cudnn.benchmark as the step runs it), and the Triton
  convolution with no prologue or epilogue (its own GEMM rate, the "conv part").
- today: the input's GroupNorm forward (the fused kernels' statistics, finalize and apply: norm.triton_forward),
  the cuDNN convolution, the bias / residual add as inductor compiles it, and the next GroupNorm's statistics pass
  and finalize over the output.
- fused: the input's statistics and finalize (the same kernels), the dropout mask's bits, the fused convolution,
  and the finalize of its epilogue's statistics.
  Both chains count the input's statistics, which in a chain of fused convolutions would come from the producer's
  epilogue: the difference between the two is what a site saves (the apply pass, the add's passes, the output's
  statistics read, against the fused kernel's extra arithmetic).
Each chain is captured as one CUDA graph and replayed (clocks.graph_ms: no host launches in the timing). Tile
configs (conv_gn.TileConfig) are tried per site and the fastest kept, for the fused and the plain kernel each.
Every site's fused output and statistics are checked against a torch reference first (fp32, the same mask).
conv_gn_bench.json and conv_gn_bench.md are rewritten after every site, in order of the site's convolution FLOPs a
step, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option

# Tile configs tried per site (block_m, block_n, block_k, warps, stages); block_n shrinks to the output channels.
# Few, so that compiling them for every site fits the call (~60 kernels). From offline sm_90 builds of the fused
# kernel (Triton 3.6): 8 warps on a 128-row tile hold the prologue's values in 177-230 registers with no spills; 4
# warps on it spill (dropped); 64 rows with 4 warps is the tile that keeps an 8x8 sample's rows to itself.
CONFIGS = ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4))
SMOKE_CONFIGS = ((32, 32, 32, 4, 1),)  # --smoke: one, interpreted
# --smoke's network, before the command's overrides: the preset's blocks at 8x8 pixels, 16 and 32 channels, batch 3
SMOKE_OVERRIDES = ("model.base_channels=16", "model.channel_mult=(1,2)", "model.num_res_blocks=1", "model.image_size=8",
                   "model.norm_groups=4", "model.attn_resolutions=()", "model.attn_heads=1", "data.batch_size=3")
RECORD_BATCH = 2


@dataclasses.dataclass(frozen=True)
class Site:
    """A distinct 3x3 convolution of the network: shapes and what the fused kernel does around it."""
    cin: int            # input channels (both parts)
    cout: int           # output channels
    h: int              # input height = width
    stride: int         # 1, or 2 (the downsample)
    c1: int             # the first part's channels (= cin with one part)
    norm: bool          # its input is a GroupNormAct's output (the prologue normalises)
    silu: bool          # ... with SiLU
    p: float            # ... and dropout p
    norm_add: bool      # ... which added a per-(sample, channel) vector first (today's norm2; the fused chain
                        # adds it in the producing convolution's epilogue instead)
    bias: str           # "" | "channel" (the conv's own) | "sample" (a GroupNorm's per-(sample, channel) add)
    residual: bool      # the output is added to a residual before anything reads it
    stats: bool         # a GroupNorm reads the output (or output + residual): the epilogue writes statistics
    groups: int         # the GroupNorms' groups

    @property
    def out_h(self) -> int:
        return (self.h - 1) // self.stride + 1

    def flops(self, batch: int) -> int:
        return 2 * batch * self.out_h ** 2 * self.cout * self.cin * 9

    def name(self) -> str:
        parts = f"{self.c1}+{self.cin - self.c1}" if self.c1 != self.cin else f"{self.cin}"
        pro = ("GN" + ("+SiLU" if self.silu else "") + (f"+drop{self.p:g}" if self.p else "")) if self.norm else "-"
        epi = "+".join(x for x in (self.bias and f"bias/{self.bias}", self.residual and "res",
                                   self.stats and "stats") if x) or "-"
        return f"{parts}->{self.cout} {self.h}x{self.h}/s{self.stride} [{pro}; {epi}]"


def record_sites(model_cfg) -> list[tuple[Site, int]]:
    """The distinct 3x3 convolutions of one forward of the model (CPU, fp32, batch RECORD_BATCH), each with how many
    times a step it runs, in the order first seen."""
    import dataclasses

    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from benchmarks.speed.flops import _inputs
    from ffcv_ddpm.norm import GroupNormAct
    from ffcv_ddpm.unet import build_model

    torch.manual_seed(0)
    # The residual sums computed where they are written (norm_residual leaves them to the next GroupNorm as Pending
    # sums, which the recorder below cannot follow): the same convolutions, adds and GroupNorms.
    model = build_model(dataclasses.replace(model_cfg, norm_residual=False)).train()
    keep = []  # every tensor seen, alive until the end: ids stay unique
    gn_out, gn_in = {}, []  # id(GroupNormAct output) -> (module, input parts, add given); (part ids, add) per call
    convs, sums = [], {}  # conv calls; id(a + b) -> the ids of a and b

    def hook(module, args, kwargs, out):
        x = args[0]
        parts = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        keep.extend([*parts, out])
        gn_out[id(out)] = (module, parts, kwargs.get("add") is not None)
        gn_in.append(([id(t) for t in parts], kwargs.get("add") is not None))

    adds = {torch.Tensor.__add__, torch.Tensor.add, torch.add, torch.Tensor.__radd__}

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is F.conv2d:
                x, w = args[0], args[1]
                bias = args[2] if len(args) > 2 else kwargs.get("bias")
                stride = args[3] if len(args) > 3 else kwargs.get("stride", 1)
                keep.extend([x, out])
                convs.append((x, w.shape, bias is not None, stride if isinstance(stride, int) else stride[0], out))
            elif func in adds and all(isinstance(a, torch.Tensor) for a in args[:2]):
                keep.extend([*args[:2], out])
                sums[id(out)] = (id(args[0]), id(args[1]))
            return out

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules() if isinstance(m, GroupNormAct)]
    x, t, y = _inputs(model_cfg, RECORD_BATCH, "cpu")
    with torch.no_grad(), Recorder():
        model(x, t, *([y] if y is not None else []))
    for h in handles:
        h.remove()

    normed_ids = {i for ids, _ in gn_in for i in ids}
    with_add = {i for ids, add in gn_in if add for i in ids}
    conv_ins = {id(c[0]) for c in convs}
    counts: dict[Site, int] = {}
    for x, wshape, has_bias, stride, out in convs:
        cout, cin, kh, kw = wshape
        if (kh, kw) != (3, 3):
            continue
        module, parts, norm_add = gn_out.get(id(x), (None, (), False))
        # The epilogue adds the residual when the sum is all anyone reads of the output (a res block's conv2; not
        # the stem, whose output its first block's GroupNorm also reads).
        summed = [s for s, (a, b) in sums.items() if id(out) in (a, b)]
        residual = len(summed) == 1 and id(out) not in normed_ids and id(out) not in conv_ins
        read = id(out) in normed_ids or (residual and summed[0] in normed_ids)
        # conv_bias_in_norm: the conv runs without bias and its GroupNorm adds the per-(sample, channel) vector
        bias = "channel" if has_bias else "sample" if id(out) in with_add else ""
        site = Site(cin=cin, cout=cout, h=x.shape[-1], stride=stride, c1=parts[0].shape[1] if module else cin,
                    norm=module is not None, silu=bool(module and module.silu), p=float(module.p) if module else 0.0,
                    norm_add=norm_add,
                    bias=bias, residual=residual, stats=read, groups=model_cfg.norm_groups)
        counts[site] = counts.get(site, 0) + 1
    return list(counts.items())


def sites_by_cost(model_cfg, batch: int) -> list[tuple[Site, int]]:
    """record_sites' sites, the costliest first: by their convolution FLOPs a step at `batch`."""
    return sorted(record_sites(model_cfg), key=lambda sc: -sc[0].flops(batch) * sc[1])


def site_parser(name: str, doc: str) -> Parser:
    """The options the per-site convolution benchmarks share (this one, cudnn_fusion, conv_tma): where to write,
    which network, how many of its sites, calls a captured graph; each adds its own."""
    p = Parser(prog=f"python -m benchmarks.speed.{name}", doc=doc, overrides=True,
               epilog="Overrides: data.batch_size (default 1024) and model.* configure the network the sites are "
                      "recorded from.")
    p.add_argument("--out", type=Path, required=True, help=f"folder for {name}.json and .md")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--sites", type=option(int, at_least(1)), help="only the first N sites (by FLOPs a step)")
    p.add_argument("--iters", type=option(int, at_least(1)), default=10, help="calls per captured graph")
    return p


# ---------------------------------------------------------------------------------------------------- one site


def tile_for(config: tuple, site: Site) -> "TileConfig":
    """A CONFIGS entry as conv_gn takes it at `site`: block_n no wider than the output channels need."""
    from ffcv_ddpm.conv_gn import TileConfig

    bm, bn, bk, warps, stages = config
    return TileConfig(bm, min(bn, max(16, 1 << (site.cout - 1).bit_length())), bk, warps, stages)


def usable(config: tuple, site: Site) -> bool:
    """Whether `config` can run `site`: its statistics need H*W and block_m to divide one another, and a block_n
    wider than the output channels would repeat a narrower config."""
    from ffcv_ddpm.conv_gn import stats_layout

    if config[1] > max(128, site.cout):
        return False
    try:
        stats_layout(site.out_h ** 2, config[0]) if site.stats else None
    except ValueError:
        return False
    return True


def gn_coef(x, groups: int, a, b, e=None, x2=None, res=None, rbias=None):
    """(coef (N, 2, C), mean, rstd) of the GroupNorm of x (or of [x, x2]) with per-(sample, channel) a, b and add e: the
    fused GroupNorm's statistics and finalize kernels with the default plan, as norm.triton_forward launches them
    before its apply pass (which this leaves out). With res (and a per-channel rbias), of the residual sum x + res
    (+ rbias), which the statistics kernel writes as it reads (model.norm_residual, the preset's)."""
    from ffcv_ddpm import gn_kernels as K
    from ffcv_ddpm import norm

    tile, chunk, warps, stages = norm.plan_args(norm.DEFAULT_PLAN)
    x2_, c1, x2s, two = norm._second_part(x, x2)
    pl = norm._plan(x, groups, tile, chunk, channels=x.shape[1] + (x2.shape[1] if two else 0))
    n, c, hw, k = pl["N"], pl["C"], pl["HW"], pl["K"]
    part = x.new_empty((n, k, 2, c), dtype=torch.float32)
    coef = x.new_empty((n, 2, c), dtype=torch.float32)
    mean, rstd = (x.new_empty((n, groups), dtype=torch.float32) for _ in range(2))
    xs = (*norm._nchw_strides(x), c1, *x2s)
    addends = norm._residual_addends(x, res, None)
    s_out = torch.empty_like(x) if addends else x.new_empty(0)
    K._stats_kernel[(n, k)](x, x2_, part, c, hw, k, *xs, CHUNK=pl["CHUNK"], BLOCK_R=pl["BLOCK_R"],
                            BLOCK_C=pl["BLOCK_C"], TWO=two, STAGES=stages or None, num_warps=warps,
                            **norm._residual_args(x, addends, rbias, s_out, a))
    e_ = a if e is None else e
    K._finalize_kernel[(n,)](part, a, b, e_, coef, mean, rstd, c, hw, groups, pl["CPG"], k, a.stride(0), a.stride(1),
                             e_.stride(0), e_.stride(1), 1e-5, CHUNK=pl["CHUNK"], BLOCK_K=pl["BLOCK_K"],
                             BLOCK_G=pl["BLOCK_G"], BLOCK_CPG=pl["BLOCK_CPG"], HAS_ADD=e is not None,
                             num_warps=warps)
    return coef, mean, rstd


class Bench:
    """One site's tensors at the step's batch, and the two chains (today's and the fused one) as closures."""

    def __init__(self, site: Site, batch: int, device: str, dtype: torch.dtype):
        self.site, self.batch = site, batch
        g = torch.Generator(device=device).manual_seed(0) if device != "meta" else None  # meta: shapes only
        cl = torch.channels_last

        def randn(*shape, scale=1.0, shift=0.0, dt=dtype):
            return (torch.randn(shape, generator=g, device=device) * scale + shift).to(dt)

        s, n = site, batch
        # The residual stream's activations: not centred, so that |mean| > std somewhere matters.
        self.x = randn(n, s.c1, s.h, s.h, scale=2.0, shift=1.0).contiguous(memory_format=cl)
        self.x2 = randn(n, s.cin - s.c1, s.h, s.h, scale=2.0, shift=1.0).contiguous(memory_format=cl) \
            if s.c1 != s.cin else None
        self.w = randn(s.cout, s.cin, 3, 3, scale=(9 * s.cin) ** -0.5).contiguous(memory_format=cl)
        self.a, self.b = randn(n, s.cin, scale=0.1, shift=1.0, dt=torch.float32), randn(n, s.cin, scale=0.1,
                                                                                        dt=torch.float32)
        self.e = randn(n, s.cin, dt=torch.float32) if s.norm_add else None
        self.a2, self.b2 = randn(n, s.cout, scale=0.1, shift=1.0, dt=torch.float32), randn(n, s.cout, scale=0.1,
                                                                                           dt=torch.float32)
        self.bias = randn(s.cout, scale=0.1, dt=torch.float32) if s.bias == "channel" else \
            randn(n, s.cout, dt=torch.float32) if s.bias == "sample" else None
        self.res = randn(n, s.cout, s.out_h, s.out_h).contiguous(memory_format=cl) if s.residual else None
        self.seed = torch.tensor([1234], device=device)
        self.pointwise = self._pointwise(device)

    def _pointwise(self, device: str):
        """Today's epilogue: the conv's own bias and the residual added by one kernel, as inductor fuses them (on
        CPU, eager: the smoke run compiles nothing). A per-(sample, channel) bias is the next GroupNorm's add."""
        s = self.site
        if s.bias != "channel" and not s.residual:
            return None

        def add(y, bias, res):
            y = y + bias.to(y.dtype)[None, :, None, None] if bias is not None else y
            return y + res if res is not None else y

        return torch.compile(add, dynamic=False) if device == "cuda" else add  # compiled on its first call

    # The pieces, and the two chains made of them. Each returns what it made, for the checks; the timing ignores it.

    def input_norm(self):
        """Today's GroupNorm of the input: statistics, finalize and apply (norm.triton_forward), the activation."""
        from ffcv_ddpm.norm import triton_forward

        s = self.site
        return triton_forward(self.x, self.a, self.b, self.e, self.seed, s.groups, 1e-5, s.silu, s.p, *_plan(),
                              self.x2)[0]

    def input_coef(self):
        """The input's statistics and finalize alone: the per-(sample, channel) scale and shift."""
        return gn_coef(self.x, self.site.groups, self.a, self.b, self.e, self.x2)[0]

    def keep_bits(self):
        from ffcv_ddpm import conv_gn

        s = self.site
        return conv_gn.keep_bits(self.seed, (self.batch, s.cin, s.h, s.h), s.p)

    def fused_conv(self, config: tuple, coef, bits, **given):
        """The fused kernel with the input's (scale, shift) and keep bits given: (out, part). `given`: conv3x3's
        warmup, out, part."""
        from ffcv_ddpm import conv_gn

        s = self.site
        return conv_gn.conv3x3(self.x, self.w, x2=self.x2, coef=coef, silu=s.silu, bits=bits, p=s.p, bias=self.bias,
                               res=self.res, stats=s.stats, stride=s.stride, config=tile_for(config, s), **given)

    def today(self):
        s = self.site
        y = torch.nn.functional.conv2d(self.input_norm() if s.norm else self.whole, self.w, None, s.stride, 1)
        if self.pointwise is not None:
            y = self.pointwise(y, self.bias if s.bias == "channel" else None, self.res)
        if s.stats:
            gn_coef(y, s.groups, self.a2, self.b2, self.bias if s.bias == "sample" else None)
        return y

    def fused(self, config: tuple, **given):
        """(out, the next GroupNorm's (coef, mean, rstd) or None, the input's coef). `given`: conv3x3's out, part."""
        from ffcv_ddpm import conv_gn

        s = self.site
        coef = self.input_coef() if s.norm else None
        out, part = self.fused_conv(config, coef, self.keep_bits() if s.p else None, **given)
        block_m = tile_for(config, s).block_m
        stats = conv_gn.finalize(part, s.out_h ** 2, block_m, s.groups, self.a2, self.b2) if s.stats else None
        return out, stats, coef

    def conv_alone(self, config: tuple | None, epilogue: bool = False, **given):
        """The convolution alone: cuDNN's (config None) or the Triton kernel with no prologue, and with its epilogue
        or none. `given`: conv3x3's warmup."""
        from ffcv_ddpm import conv_gn

        s = self.site
        if config is None:
            return torch.nn.functional.conv2d(self.whole, self.w, None, s.stride, 1)
        extra = dict(bias=self.bias, res=self.res, stats=s.stats) if epilogue else {}
        return conv_gn.conv3x3(self.whole, self.w, stride=s.stride, config=tile_for(config, s), **extra, **given)[0]

    @property
    def whole(self):
        """The input as one tensor (the parts concatenated, once): what cuDNN's convolution reads."""
        if self.x2 is None:
            return self.x
        if not hasattr(self, "_whole"):
            self._whole = torch.cat((self.x, self.x2), 1).contiguous(memory_format=torch.channels_last)
        return self._whole

    def check(self, config: tuple) -> dict:
        """The fused chain against fp32 torch on the same inputs (the same coef, the same dropout mask): relative
        error of the output, of the next GroupNorm's mean and rstd (against torch's over the stored output), and of
        the plain kernel against cuDNN."""
        from ffcv_ddpm import conv_gn

        from ffcv_ddpm.conv_gn import stats_layout

        s, n = self.site, self.batch
        # NaN first: an element the kernel does not write fails the comparison, whatever memory it was given.
        out = torch.full((n, s.cout, s.out_h, s.out_h), float("nan"), dtype=self.x.dtype, device=self.x.device)
        given = {"out": out.contiguous(memory_format=torch.channels_last)}
        if s.stats:
            k = stats_layout(s.out_h ** 2, tile_for(config, s).block_m)[0]
            given["part"] = torch.full((n, k, 2, s.cout), float("nan"), device=self.x.device)
        out, stats, coef = self.fused(config, **given)
        shape = (n, s.cin, s.h, s.h)
        # The mask as the bits hold it (tests/test_conv_gn.py checks the bits against norm.keep_mask, whose NumPy
        # hash would take seconds at this size).
        keep = conv_gn.unpack_bits(self.keep_bits(), shape) if s.p else None
        tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False  # an fp32 reference, not TF32's
        try:
            ref = conv_gn.reference(self.whole.float(), self.w.float(), coef=coef, silu=s.silu, keep=keep, p=s.p,
                                    bias=self.bias, res=self.res, stride=s.stride)
        finally:
            torch.backends.cudnn.allow_tf32 = tf32
        got = {"out": rel(out, ref), "written": bool(torch.isfinite(out).all())}
        del ref
        if stats is not None:
            g = s.groups
            var, mean = torch.var_mean(out.double().reshape(n, g, -1), dim=2, unbiased=False)
            got["mean"] = rel(stats[1], mean)
            got["rstd"] = rel(stats[2], torch.rsqrt(var + 1e-5))
        got["plain_vs_cudnn"] = rel(self.conv_alone(config), self.conv_alone(None))
        return got


def _plan() -> tuple:
    from ffcv_ddpm.norm import DEFAULT_PLAN, plan_args

    return plan_args(DEFAULT_PLAN)


def rel(a, ref) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def bytes_saved(site: Site, batch: int, block_m: int) -> int:
    """The bf16 bytes the fused chain does not move, against today's: the apply pass (x read, the activation
    written), the bias / residual kernel's read and write of the output, the statistics' read of the output; less
    the dropout bits (written once, read) and the epilogue's partial statistics (written, read by the finalize)."""
    from ffcv_ddpm.conv_gn import stats_layout

    x = batch * site.cin * site.h ** 2 * 2
    y = batch * site.cout * site.out_h ** 2 * 2
    saved = (2 * x if site.norm else 0) + (2 * y if site.bias == "channel" or site.residual else 0)
    if site.stats:
        k = stats_layout(site.out_h ** 2, block_m)[0]
        saved += y - 2 * batch * k * 2 * site.cout * 4
    return saved - (2 * x // 16 if site.p else 0)


# ---------------------------------------------------------------------------------------------------- measuring


def warm(job: tuple) -> str | None:
    """Compile (no launch) the fused and the plain kernel `job` = (site, batch, config) launches: run in parallel
    processes before the timing, which then finds them in Triton's cache. None, or what failed."""
    site, batch, config = job
    try:
        b = Bench(site, batch, "meta", torch.bfloat16)
        n, s = batch, site
        coef = torch.empty((n, 2, s.cin), device="meta") if s.norm else None
        bits = torch.empty((n * s.h ** 2, -(-s.cin // 32)), dtype=torch.int32, device="meta") if s.p else None
        b.fused_conv(config, coef, bits, warmup=True)
        b.conv_alone(config, warmup=True)
        b.conv_alone(config, epilogue=True, warmup=True)
        return None
    except Exception as e:  # a config the compiler refuses is one failed config at timing too: say so, go on
        return f"{site.name()} {config}: {type(e).__name__}: {str(e).strip()[:200]}"


def precompile(jobs: list[tuple], workers: int) -> list[str]:
    """warm() over `jobs` in `workers` spawned processes (Triton compiles one kernel at a time per process)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return [e for e in pool.map(warm, jobs, chunksize=1) if e]


def measure(bench: Bench, configs: list[tuple], clock, quick, rounds: int) -> dict:
    """One site's row: the fastest config of the fused and the plain kernel, the checks, the chains' times."""
    s, n = bench.site, bench.batch
    coef = bench.input_coef() if s.norm else None
    bits = bench.keep_bits() if s.p else None

    def tune(make) -> tuple[tuple | None, dict]:
        tried = {}
        for config in configs:
            try:
                tried[config] = quick(make(config))
            except Exception as e:  # out of shared memory, a compiler error: that config's row says so
                tried[config] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        ok = {c: t for c, t in tried.items() if isinstance(t, float)}
        return (min(ok, key=ok.get) if ok else None), {str(c): t for c, t in tried.items()}

    best, tried = tune(lambda c: (lambda: bench.fused_conv(c, coef, bits)))
    best_plain, tried_plain = tune(lambda c: (lambda: bench.conv_alone(c)))
    row = {"site": dataclasses.asdict(s), "name": s.name(), "batch": n, "gflop": s.flops(n) / 1e9,
           "tried_fused": tried, "tried_plain": tried_plain}
    if best is None or best_plain is None:
        return {**row, "error": "no tile config ran (tried_fused / tried_plain say why)"}
    row["config"], row["config_plain"] = tile_for(best, s), tile_for(best_plain, s)
    row["check"] = bench.check(best)
    timed = {"conv_cudnn": lambda: bench.conv_alone(None), "conv_triton": lambda: bench.conv_alone(best_plain),
             "conv_epilogue": lambda: bench.conv_alone(best, epilogue=True),  # the fused config, no prologue
             "fused_conv": lambda: bench.fused_conv(best, coef, bits), "today": bench.today,
             "fused": lambda: bench.fused(best)}
    got = {k: [] for k in timed}
    for _ in range(rounds):  # interleaved: a clock that drifts lands on every chain alike
        for k, fn in timed.items():
            got[k].append(clock(fn))
    ms = {k: sorted(v)[len(v) // 2] for k, v in got.items()}
    parts = {"input_gn_forward": bench.input_norm if s.norm else None,  # today's, in the chain
             "input_gn_stats": bench.input_coef if s.norm else None,  # the fused chain's
             "keep_bits": bench.keep_bits if s.p else None}
    ms.update({k: clock(fn) for k, fn in parts.items() if fn is not None})
    return {**row, "ms": ms, "rounds": got, "bytes_saved": bytes_saved(s, n, row["config"].block_m)}


def passed(check: dict) -> bool:
    """Every element written; the output within bf16 operands' error of fp32 (METHOD: 1e-3 to 1e-2, here the
    activation and the output each rounded once); the statistics within fp32 reduction error."""
    return (check["written"] and check["out"] < 2e-2 and check["plain_vs_cudnn"] < 2e-2
            and check.get("mean", 0) < 1e-3 and check.get("rstd", 0) < 1e-3)


def table_rows(rows: list[dict], counts: dict) -> list[list[str]]:
    out = []
    for r in rows:
        count = counts[r["name"]]
        if "error" in r:
            out.append([r["name"], str(count), f"{r['gflop']:.0f}"] + ["-"] * 8 + [r["error"]])
            continue
        ms, flop = r["ms"], r["gflop"] * 1e9
        tf = lambda t: f"{flop / t / 1e9:.0f}"  # noqa: E731  ms -> TFLOP/s
        check = r["check"]
        out.append([r["name"], str(count), f"{r['gflop']:.0f}", tf(ms["conv_cudnn"]), tf(ms["conv_triton"]),
                    tf(ms["conv_epilogue"]), tf(ms["fused_conv"]), f"{ms['today']:.3f}", f"{ms['fused']:.3f}",
                    f"{r['bytes_saved'] / 1e6:.3g}", f"{(ms['today'] - ms['fused']) * count:+.3f}",
                    f"{check['out']:.1e}" + ("" if passed(check) else " FAILED")])
    return out


def render(result: dict) -> str:
    counts = {r["name"]: r["count"] for r in result["rows"]}
    rows = [r for r in result["rows"] if "error" in r or "ms" in r]
    done = [r for r in rows if "ms" in r]
    net = sum((r["ms"]["today"] - r["ms"]["fused"]) * r["count"] for r in done)
    today = sum(r["ms"]["today"] * r["count"] for r in done)
    env = result["environment"]
    lines = [f"# The convolution that owns its GroupNorm, forward: {result['preset']}, batch {result['batch']} - "
             f"{result['device_name'] or 'CPU (interpreter)'}", "",
             f"- commit {commit_text(env)}, torch {env.get('torch')}, triton {result['triton']}; command: "
             f"`{result['command']}`",
             f"- {len(done)} of {result['sites_total']} distinct 3x3 sites measured; today's chains at these sites "
             f"{today:.2f} ms a step, the fused ones {today - net:.2f} ({net:+.2f} ms a step saved)", "",
             "TFLOP/s count the convolution's FLOPs over: cuDNN's convolution alone; the Triton kernel with no "
             "prologue or epilogue (its fastest config); with the epilogue only (the fused kernel's config); the fused "
             "kernel. today / fused: the chains (see the module docstring), ms a call; net: (today - fused) x per "
             "step, positive when the fused chain is faster. err: the fused output against fp32 torch.", "",
             *md_table(["site", "per step", "GFLOP", "cuDNN TFLOP/s", "Triton conv TFLOP/s", "+ epilogue TFLOP/s",
                        "fused TFLOP/s", "today ms", "fused ms", "MB saved", "net ms/step", "err"],
                       table_rows(rows, counts))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = site_parser("conv_gn_bench", __doc__)
    p.add_argument("--rounds", type=option(int, at_least(1)), default=3,
                   help="each chain timed this many times, interleaved; a row is the median")
    p.add_argument("--configs", type=option(int, at_least(1)),
                   help=f"only the first N tile configs of the {len(CONFIGS)} (fewer kernels to compile)")
    p.add_argument("--compile-workers", type=option(int, at_least(0)), default=12,
                   help="processes compiling the Triton variants before the timing (0: compile as they run)")
    p.add_argument("--smoke", action="store_true",
                   help="on the CPU through Triton's interpreter (TRITON_INTERPRET=1 must be set), fp32, a small "
                        "network (SMOKE_OVERRIDES, before the command's), one tile config, one call a timing: checks "
                        "that the script runs, measures nothing")
    args, overrides = p.parse_with_overrides(argv)
    import triton

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.env import environment

    try:
        cfg = load_config(args.preset, ["data.batch_size=1024", *(SMOKE_OVERRIDES if args.smoke else ()), *overrides])
    except ValueError as e:
        return fail("conv_gn_bench", str(e))
    if args.smoke and not triton.knobs.runtime.interpret:
        return fail("conv_gn_bench", "--smoke runs the kernels through Triton's interpreter: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        return fail("conv_gn_bench", "needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1 for a CPU run)")
    from benchmarks.speed.clocks import graph_ms, time_ms

    batch = cfg.data.batch_size
    sites = sites_by_cost(cfg.model, batch)
    total = len(sites)
    sites = sites[:args.sites] if args.sites else sites
    if args.smoke:
        device, dtype, configs = "cpu", torch.float32, SMOKE_CONFIGS
        clock = quick = lambda fn: time_ms(fn, 1, 0, device="cpu")  # noqa: E731
        rounds = 1
    else:
        import triton.testing

        device, dtype, configs = "cuda", torch.bfloat16, CONFIGS[:args.configs]
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark  # the step's algorithm choice
        clock = lambda fn: graph_ms(fn, args.iters, warmup=2)  # noqa: E731
        quick = lambda fn: float(triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median"))  # noqa: E731
        rounds = args.rounds
    device_name = torch.cuda.get_device_name() if device == "cuda" else None
    from benchmarks.speed.peaks import lookup_peak

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"preset": args.preset, "overrides": overrides, "batch": batch, "device_name": device_name,
              "peak_tflops": lookup_peak(device_name, "bf16").tflops, "triton": triton.__version__,
              "command": "python -m benchmarks.speed.conv_gn_bench " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "sites_total": total, "configs": configs,
              "settings": {"iters": args.iters, "rounds": rounds, "smoke": args.smoke,
                           "cudnn_benchmark": torch.backends.cudnn.benchmark},
              "rows": [{"name": s.name(), "count": c, "site": dataclasses.asdict(s)} for s, c in sites]}
    t0 = time.time()
    if device == "cuda" and args.compile_workers:
        jobs = [(s, batch, c) for s, _ in sites for c in configs if usable(c, s)]
        result["compile_errors"] = precompile(jobs, args.compile_workers)
        result["compile_s"] = time.time() - t0
        print(f"conv_gn_bench: {len(jobs)} variants compiled in {result['compile_s']:.0f} s by "
              f"{args.compile_workers} processes", flush=True)
    for i, (site, count) in enumerate(sites):
        bench = Bench(site, batch, device, dtype)
        row = measure(bench, [c for c in configs if usable(c, site)], clock, quick, rounds)
        result["rows"][i] = {**row, "count": count}
        del bench
        if device == "cuda":
            torch.cuda.empty_cache()
        write_json(args.out / "conv_gn_bench.json", result)
        write_text(args.out / "conv_gn_bench.md", render(result))
        last = table_rows([result["rows"][i]], {site.name(): count})[0]
        print(f"conv_gn_bench: [{time.time() - t0:.0f} s] " + " | ".join(last), flush=True)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
