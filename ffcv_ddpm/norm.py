"""GroupNorm and what follows it in the UNets' blocks, in three implementations chosen by `model.norm_impl`.

    GroupNormAct(groups, channels, silu=True, dropout=0.1)(x, add=temb)  # dropout(silu(GroupNorm(x + temb)))

- "torch": nn.GroupNorm, then F.silu and F.dropout: the reference, what the DDPM code wrote.
- "scale-shift": GroupNorm as x * scale + shift (scale_shift_group_norm), which keeps channels_last through
  torch.compile (inductor's own GroupNorm lowering returns NCHW on GPUs).
- "fused": Triton kernels (ffcv_ddpm.gn_kernels) for GroupNorm + the optional add before it + the optional FiLM
  after it + SiLU + dropout, behind the custom op ffcv_ddpm::group_norm_act that torch.compile keeps as one call.
  Statistics in fp32, output in the input's dtype, the dropout mask recomputed in the backward from a seed instead
  of stored (or kept as a bit per element: model.norm_mask_bits). On CPU tensors the op runs `reference_forward`,
  plain torch with the same mask. How the kernels split the work (their plan: `model.norm_plan`, DEFAULT_PLAN when
  empty) is part of every call, not module state.

All three have nn.GroupNorm's parameters and state_dict keys, so a checkpoint loads into any of them. Each takes a
tensor or the parts of a channel concatenation (the up path's (h, skip) with model.concat_free) and returns the
normalised concatenation; "scale-shift" never concatenates the input, the other two concatenate it first ("fused"
reads two parts where they lie with `parts`, and with `split_out` returns the output as two tensors too).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

NORM_IMPLS = ("torch", "scale-shift", "fused")

# The fused kernels' plan: (elements per tile of the elementwise kernels, elements per program of the reductions,
# num_warps[, stages]), what an empty model.norm_plan means. benchmarks.speed.norm_bench --plans grid sweeps others:
# (2048, 65536, 4) was the fastest at every site of ddpm-cifar10 on an H200, 16.5-24.7% faster than the first default
# (1024, 16384, 4), and 5.1-5.6% in the step (benchmarks/results/h200/norm-plans-57db305, norm-plan-step-8d99035).
# STAGES 4 (below): the fastest of --plans stages at every site on an H100 (-6.6% over three sites), and with
# model.fused_parts +3.1% in the step there, +1.4-1.5% on an H200 (benchmarks/results/h100/step-5f421de).
DEFAULT_PLAN = (2048, 65536, 4, 4)
PLAN_WARPS = (1, 2, 4, 8, 16)  # num_warps values a launch may take on every GPU the kernels run on
# The optional fourth part, STAGES: 0 (a plan of three parts) runs the reductions' loops over their chunk as written,
# one tile's loads in flight per program; 2-4 annotates those loops with tl.range(num_stages=STAGES), so that
# Triton's pipeliner keeps that many tiles' loads in flight. Why: the two reduction kernels move bytes at 1.7-2.1
# TB/s where the elementwise ones reach 2.9-3.2 on the same tensors (H200, b1e09eb: NOTES item 25).
PLAN_STAGES = (0, 2, 3, 4)
PLAN_HELP = "TILE,CHUNK,WARPS[,STAGES], e.g. '1024,16384,4' or '2048,65536,4,3', or '' for the default {}".format(
    ",".join(map(str, DEFAULT_PLAN)))


def plan_problem(tile: int, chunk: int, warps: int, stages: int = 0) -> str | None:
    """What makes (tile, chunk, warps[, stages]) no plan for the kernels, in words; None if it is one.

    Why these rules: tiles and chunks are tl.arange extents (powers of two), a reduction program covers whole tiles,
    num_warps is a power of two up to what every GPU runs, and stages is PLAN_STAGES' (see there)."""
    if min(tile, chunk, warps) < 1:
        return "every part must be a positive integer"
    for name, v in (("TILE", tile), ("CHUNK", chunk)):
        if v & (v - 1):
            return f"{name}={v} is not a power of two"
    if chunk < tile:
        return f"CHUNK={chunk} is below TILE={tile} (a reduction program covers whole tiles)"
    if warps not in PLAN_WARPS:
        return f"WARPS={warps} is not one of {', '.join(map(str, PLAN_WARPS))}"
    if stages not in PLAN_STAGES:
        return f"STAGES={stages} is not one of {', '.join(map(str, PLAN_STAGES))}"
    return None


def plan_args(plan: tuple[int, ...]) -> tuple[int, int, int, int]:
    """A plan of three or four parts as the ops take it: (tile, chunk, warps, stages), stages 0 when not given."""
    return (*plan, 0) if len(plan) == 3 else tuple(plan)


def parse_plan(text: str) -> tuple[int, ...]:
    """model.norm_plan's text as (tile, chunk, warps[, stages]); "" is DEFAULT_PLAN. ValueError('norm_plan=...: ...')
    saying what is wrong and what to write instead."""
    if text == "":
        return DEFAULT_PLAN
    try:
        plan = tuple(int(part) for part in text.split(",")) if isinstance(text, str) else ()
    except ValueError:
        plan = ()
    if len(plan) not in (3, 4):
        raise ValueError(f"norm_plan={text!r}: expected three or four comma-separated integers {PLAN_HELP}")
    problem = plan_problem(*plan)
    if problem:
        raise ValueError(f"norm_plan={text!r}: {problem}; write {PLAN_HELP}")
    return plan


def scale_shift_group_norm(x: Tensor | Sequence[Tensor], groups: int, weight: Tensor | None, bias: Tensor | None,
                           eps: float) -> Tensor:
    """GroupNorm computed as x * scale + shift with a scale and shift per (sample, channel): the output and the
    gradient it returns keep the input's memory layout.

    Why: inductor lowers nn.GroupNorm through torch._refs.native_group_norm, which on GPUs normalises a
    reshape(N, G, C/G, H*W) of the input and views it back, so a channels_last input comes out NCHW-contiguous and
    cuDNN's convolution backward must convert it back (benchmarks/NOTES.md, attempt 4).
    Statistics: a Welford mean and variance per channel over H, W (a reduction with no layout to impose), combined
    per group by the law of total variance (channels of a group count equally).

    `x` may be a sequence of tensors, the parts of a channel concatenation: the result is the normalised
    concatenation, computed without concatenating the input (per-channel statistics per part, a group may straddle
    two parts); torch.compile writes the output's parts straight into one buffer.
    """
    parts = (x,) if isinstance(x, Tensor) else tuple(x)
    n, c = parts[0].shape[0], sum(p.shape[1] for p in parts)
    g, k = groups, c // groups
    dtype = torch.promote_types(parts[0].dtype, torch.float32)  # statistics in fp32 at least, as group_norm's
    xf = [p.to(dtype) for p in parts]
    stats = [torch.var_mean(p, dim=tuple(range(2, p.dim())), unbiased=False) for p in xf]  # per part (N, C_i) each
    var_c = torch.cat([v for v, _ in stats], 1).view(n, g, k)
    mean_c = torch.cat([m for _, m in stats], 1).view(n, g, k)
    mean = mean_c.mean(2, keepdim=True)  # (N, G, 1)
    var = var_c.mean(2, keepdim=True) + (mean_c - mean).square().mean(2, keepdim=True)  # within + between
    scale = torch.rsqrt(var + eps).expand(n, g, k)
    if weight is not None:
        scale = scale * weight.to(dtype).view(1, g, k)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.to(dtype).view(1, g, k)
    scale, shift = scale.reshape(n, c), shift.reshape(n, c)
    outs, c0 = [], 0
    for p in xf:
        c1 = c0 + p.shape[1]
        per_channel = (n, c1 - c0) + (1,) * (p.dim() - 2)
        outs.append(p * scale[:, c0:c1].reshape(per_channel) + shift[:, c0:c1].reshape(per_channel))
        c0 = c1
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    # What nn.GroupNorm returns: fp32 under CUDA autocast (group_norm is on its fp32 list), else the input's dtype
    # (CPU autocast runs group_norm in the lower precision).
    keep_fp32 = parts[0].device.type == "cuda" and torch.is_autocast_enabled("cuda")
    return out if keep_fp32 else out.to(parts[0].dtype)


class GroupNormAct(nn.GroupNorm):
    """dropout(act(GroupNorm(x + add) * (1 + scale) + shift)): everything the UNets do between two convolutions.

    `add` (N, C) is added to x before normalisation (the DDPM block's time embedding); `film` = (scale, shift), each
    (N, C), modulates the normalised output (the annotated block's FiLM); act is SiLU or nothing; dropout is active
    in training mode only. Parameters and state_dict keys are nn.GroupNorm's. With `split_out` (model.conv_parts;
    fused, with `parts`) a call on two parts returns the output as two tensors, the parts' channels each.
    """

    # The fused kernels' switches: constructor arguments and attributes of the same names.
    SWITCHES = ("parts", "saved_means", "mask_bits", "fast_silu", "pair_hash", "x_sums", "dbias", "split_out")

    def __init__(self, num_groups: int, num_channels: int, impl: str = "torch", silu: bool = True,
                 dropout: float = 0.0, eps: float = 1e-5, plan: tuple[int, ...] | None = None,
                 parts: bool = False, saved_means: bool = False, mask_bits: bool = False, fast_silu: bool = False,
                 pair_hash: bool = False, x_sums: bool = False, dbias: bool = False, split_out: bool = False):
        super().__init__(num_groups, num_channels, eps=eps)
        if impl not in NORM_IMPLS:
            raise ValueError(f"norm_impl={impl!r}: use one of {', '.join(map(repr, NORM_IMPLS))}")
        if plan is not None and impl != "fused":
            raise ValueError(f"plan={plan} is the fused kernels' plan; norm_impl={impl!r} has none: pass plan=None")
        if plan is not None and (problem := plan_problem(*plan)):
            raise ValueError(f"plan={plan}: {problem}")
        self.impl = impl  # "torch" | "scale-shift" | "fused"
        self.silu = silu  # SiLU after the normalisation (False: the attention block's plain GroupNorm)
        self.p = dropout  # dropout probability after the activation
        # The fused kernels' (tile, chunk, warps[, stages]), DEFAULT_PLAN unless given; None for the other ones.
        self.plan = (tuple(plan) if plan is not None else DEFAULT_PLAN) if impl == "fused" else None
        self.parts = parts  # fused: two parts of a concatenation read where they are, not concatenated first
        self.saved_means = saved_means  # fused, with an add: the backward's sum of xhat from the forward's means
        self.mask_bits = mask_bits  # fused, with dropout: the mask kept as bits by the forward, not hashed again
        self.fast_silu = fast_silu  # fused: SiLU and its derivative through one tanh.approx (gn_kernels._silu)
        self.pair_hash = pair_hash  # fused, with dropout: one hash for two channels' masks (gn_kernels._keep_tile)
        self.x_sums = x_sums  # fused: the backward kernels sum over x, not xhat (gn_kernels._bwd_reduce_kernel)
        self.dbias = dbias  # fused, reading a Pending sum with a bias: its gradient from the dx kernel's tile sums
        self.split_out = split_out  # fused, two parts: the output as two tensors (the next conv's two inputs)
        for name, on in self.switches().items():
            if on and impl != "fused":
                raise ValueError(f"{name}=True is a switch of the fused kernels; norm_impl={impl!r} has none")
        if split_out and not parts:
            raise ValueError("split_out=True writes the output of two parts read where they lie as two tensors: it "
                             "needs parts=True; set split_out=False")
        if pair_hash and num_channels % 2:
            raise ValueError(f"pair_hash=True draws one hash for two channels: {num_channels} channels is odd; "
                             "set pair_hash=False")

    def switches(self) -> dict[str, bool]:
        """{switch: on} of SWITCHES: what a GroupNormAct built like this one takes (ffcv_ddpm.compress)."""
        return {name: getattr(self, name) for name in self.SWITCHES}

    def extra_repr(self) -> str:
        plan = f", plan={self.plan}" if self.plan else ""
        switches = "".join(f", {k}=True" for k, on in self.switches().items() if on)
        return f"{super().extra_repr()}, impl={self.impl}, silu={self.silu}, dropout={self.p}{plan}{switches}"

    def forward(self, x: Tensor | Pending | Sequence[Tensor | Pending], add: Tensor | None = None,
                film: tuple[Tensor, Tensor] | None = None, skip: Tensor | None = None):
        """`x`: a tensor, or the parts of a channel concatenation (the up path's (h, skip)); the output is one tensor,
        or with `split_out` and two parts two, (out, out2) with the parts' channels and layouts (model.conv_parts).
        "scale-shift" normalises the parts as they are, "fused" two parts with `parts` (model.fused_parts); the
        others concatenate them first. A Pending residual sum (model.norm_residual), as x or as the first part, is
        computed by "fused" while it takes the statistics, by the others first; either way its value() is set.
        skip (model.conv_cutlass): the up block's 1x1 skip weight over the same two parts; the call then returns
        (output, slot), slot the op's (group_norm_act's skip_w) for unet.mm_acc, None where the op did not take the
        two parts as they lie."""
        if not isinstance(x, (Tensor, Pending)):
            as_parts = self.impl == "scale-shift" or (self.parts and len(x) == 2)
            if len(x) == 1 or not as_parts:
                x = resolved(x[0]) if len(x) == 1 else torch.cat(resolved(tuple(x)), 1)
        if self.impl == "fused":
            out, slot = self._fused(x, add, film, skip)
            return out if skip is None else (out, slot)
        if skip is not None:
            return self.forward(x, add, film), None
        x = resolved(x)
        if add is not None:
            x = x + add[:, :, None, None] if isinstance(x, Tensor) else _add_per_part(x, add)  # (N, C) -> (N, C, 1, 1)
        norm = F.group_norm if self.impl == "torch" else scale_shift_group_norm
        y = norm(x, self.num_groups, self.weight, self.bias, self.eps)
        if film is not None:
            y = y * (film[0][:, :, None, None] + 1) + film[1][:, :, None, None]
        if self.silu:
            y = F.silu(y)
        return F.dropout(y, self.p, self.training) if self.p else y

    def _fused(self, x: Tensor | Pending | Sequence[Tensor | Pending], add: Tensor | None,
               film: tuple[Tensor, Tensor] | None, skip: Tensor | None = None):
        x, x2 = (x, None) if isinstance(x, (Tensor, Pending)) else (x[0], resolved(x[1]))
        fold = x if isinstance(x, Pending) and x.computed is None else None  # a sum this call computes
        x, res, res2, rbias = fold.terms if fold else (resolved(x), None, None, None)
        cw = None  # the convolution's weight where the op runs it (model.conv_cutlass)
        if fold is not None and fold.conv is not None:
            from ffcv_ddpm import conv_cutlass

            cx, w = fold.conv
            dgrad = fold.cutlass_dgrad
            if x2 is None and res2 is None and conv_cutlass.applies(cx, w.shape[0]):
                x, cw = cx, w.to(cx.dtype, memory_format=torch.channels_last)
            else:  # in torch first (a shape or type the kernel does not take, or two residuals)
                x = F.conv2d(cx, w, None, 1, 1)
        n = x.shape[0]
        dt = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        # The affine after normalisation, per (sample, channel): y = xhat * a + b.
        a, b = self.weight.to(dt).expand(n, -1), self.bias.to(dt).expand(n, -1)
        if film is not None:
            scale, shift = film[0].to(dt), film[1].to(dt)
            a, b = a * (scale + 1), b * (scale + 1) + shift
        p = self.p if self.training else 0.0
        # A fresh mask per call, drawn on the device (no host sync); the backward recomputes it from this seed (or
        # reads the forward's bits: mask_bits).
        seed = (torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0
                else torch.zeros(1, dtype=torch.int64, device=x.device))
        split = self.split_out and x2 is not None
        skip_w = skip.flatten(1).to(x.dtype) if skip is not None and x2 is not None and cw is None else None
        out, *_, s, out2, slot = torch.ops.ffcv_ddpm.group_norm_act(
            x, a.contiguous(), b.contiguous(), None if add is None else add.to(dt).contiguous(), seed,
            self.num_groups, self.eps, self.silu_mode, p, *plan_args(self.plan), x2, self.saved_means, self.mask_bits,
            res, res2, rbias, self.pair_hash, self.x_sums, self.dbias, split,
            *(() if cw is None else (cw, dgrad)), *(() if skip_w is None else (None, False, skip_w)))  # (graphs as
        # before where neither is passed)
        if fold and cw is not None and res is None:
            fold.spend()
        elif fold:
            fold.set(s if s.numel() else x)  # (a convolution without a residual, computed in torch: x)
        return (out, out2) if split else out, slot if skip_w is not None else None

    @property
    def silu_mode(self) -> int:
        """The op's `silu`: 0 none, 1 y * sigmoid(y), 2 through tanh.approx (fast_silu; gn_kernels._silu)."""
        return 0 if not self.silu else 2 if self.fast_silu else 1


class Pending:
    """A residual sum h + res (+ res2) (+ bias per channel) left to its reader (model.norm_residual): a block returns
    it instead of computing it, so that the fused GroupNorm reading it next writes it while it takes its statistics
    (and, backward, adds the sum's other gradients to its own in one write) instead of a pass of its own writing it
    and another reading it. Any other reader calls value(), which computes it in torch. Either way it is computed
    once, and value() gives it to the readers after (the block's skip, the UNet's skip connections).
    conv = (input, weight) (model.conv_cutlass): h itself is left too, the 3x3 convolution (padding 1, no bias) of
    input by weight, which the fused GroupNorm runs with the sum and its statistics in one kernel where it can
    (ffcv_ddpm.conv_cutlass); h is None then, and res may be None (the convolution alone, no bias). cutlass_dgrad
    (model.conv_cutlass_dgrad): the op's backward takes that convolution's dx from CUTLASS's dgrad."""

    def __init__(self, h: Tensor | None, res: Tensor | None = None, res2: Tensor | None = None,
                 bias: Tensor | None = None, conv: tuple[Tensor, Tensor] | None = None, cutlass_dgrad: bool = False):
        if (h is None) == (conv is None) or (res is None and (res2 is not None or bias is not None)):
            raise ValueError("Pending: give h or conv (not both), and a bias or second residual only with a residual")
        self.terms = (h, res, res2, bias)  # bias: (C,), any float dtype
        self.conv = conv
        self.cutlass_dgrad = cutlass_dgrad  # the convolution's dx by CUTLASS's dgrad where the op runs it
        self.computed: Tensor | None = None  # the sum, once a reader has computed it
        self.spent = False  # a convolution alone, run by the fused GroupNorm reading it: not kept for others

    def set(self, s: Tensor) -> None:
        """The sum, computed: the terms are let go (eager mode would keep them alive while the UNet holds the sum
        as a skip connection)."""
        self.computed, self.terms, self.conv = s, None, None

    def spend(self) -> None:
        """The convolution alone (no residual), run by the fused GroupNorm that read it: its output has no
        gradient of its own (the op's backward takes it from the GroupNorm's), so no one else may read it."""
        self.terms, self.conv, self.spent = None, None, True

    def value(self) -> Tensor:
        if self.spent:
            raise ValueError("Pending: this convolution's output was normalised by the fused GroupNorm that ran it "
                             "(model.conv_cutlass) and is kept for its backward only; read value() before that "
                             "GroupNorm if another reader needs it")
        if self.computed is None:
            h, res, res2, bias = self.terms
            if self.conv is not None:
                h = F.conv2d(*self.conv, None, 1, 1)
            self.set(h if res is None else residual_sum(h, res, res2, bias))
        return self.computed


def residual_sum(h: Tensor, res: Tensor, res2: Tensor | None, bias: Tensor | None) -> Tensor:
    """h + res (+ res2) (+ bias per channel, in h's dtype) in torch."""
    s = h + res if res2 is None else h + res + res2
    return s if bias is None else s + bias.to(s.dtype)[None, :, None, None]


def conv_sum(x: Tensor, cw: Tensor, res: Tensor | None, rbias: Tensor | None) -> Tensor:
    """conv3x3(x, cw) (padding 1, no bias) (+ res + rbias) in torch, in x's layout: the op's first part with cw, as
    its plain-torch path computes it."""
    h = F.conv2d(x, cw, None, 1, 1)
    s = h if res is None else residual_sum(h, res, None, rbias)
    return s.contiguous(memory_format=_format(x))


def _conv_output_like(x: Tensor, cw: Tensor) -> Tensor:
    """An empty tensor shaped like conv3x3(x, cw)'s output in x's layout (what the op normalises with cw)."""
    if cw.dim() != 4 or cw.shape[1] != x.shape[1] or cw.shape[2:] != (3, 3):
        raise ValueError(f"fused GroupNorm: the convolution's weight {tuple(cw.shape)} is not [C, {x.shape[1]}, 3, 3] "
                         f"for its input {tuple(x.shape)}")
    return torch.empty((x.shape[0], cw.shape[0], *x.shape[2:]), dtype=x.dtype, device=x.device,
                       memory_format=_format(x))


def residual_first(x: Tensor | Pending) -> bool:
    """Whether a fused GroupNorm reading x (as x or as a first part) computes it as a residual sum with a residual,
    the case where its op returns the sum and takes the sum's other gradients as ds (norm_residual)."""
    return isinstance(x, Pending) and x.computed is None and x.terms is not None and x.terms[1] is not None


def resolved(x):
    """x with every Pending sum in it (x itself, or the parts of a tuple) replaced by its value."""
    if isinstance(x, Pending):
        return x.value()
    return tuple(resolved(t) for t in x) if isinstance(x, (tuple, list)) else x


def _add_per_part(parts: Sequence[Tensor], add: Tensor) -> list[Tensor]:
    """parts[i] + add's channels of part i: (N, C) added to the parts of an (N, C, H, W) concatenation."""
    out, c0 = [], 0
    for p in parts:
        out.append(p + add[:, c0:c0 + p.shape[1], None, None])
        c0 += p.shape[1]
    return out


# ---------------------------------------------------------------------------------------------------- the op


def _on_triton(x: Tensor) -> bool:
    """Whether the op runs its Triton kernels on `x`: on CUDA tensors. (tests/test_norm.py routes CPU tensors there
    too, through Triton's interpreter, to test the op end to end without a GPU.)"""
    return x.device.type == "cuda"


# The plan (tile, chunk, warps, stages) is four int arguments of both ops, so torch.compile sees it as constants of the
# call and two models with different plans can run in one process. It decides how the Triton kernels split the
# work, not what they compute: the plain-torch path (reference_*) has nothing to split and leaves it unused.
@torch.library.custom_op("ffcv_ddpm::group_norm_act", mutates_args=())
def group_norm_act(x: Tensor, a: Tensor, b: Tensor, e: Tensor | None, seed: Tensor, groups: int, eps: float,
                   silu: int, p: float, tile: int, chunk: int, warps: int, stages: int, x2: Tensor | None,
                   saved_means: bool, mask_bits: bool, res: Tensor | None, res2: Tensor | None, rbias: Tensor | None,
                   pair_hash: bool, x_sums: bool, dbias: bool, split_out: bool, cw: Tensor | None = None,
                   cutlass_dgrad: bool = False, skip_w: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, mean, rstd, cmean, bits, s, out2, slot): out as GroupNormAct describes (silu: GroupNormAct.silu_mode; the
    plain-torch path computes SiLU one way), mean and rstd (N, groups) fp32 for the backward. x2: None, or the second
    part of a channel concatenation [x, x2] that is never materialised (model.fused_parts). cmean, bits: what the
    backward takes instead of a third sum and of the mask's hash (model.norm_saved_means, model.norm_mask_bits;
    _extra_outputs), empty where off or without an add / dropout.
    res (res2, rbias): the first part is the residual sum s = x + res (+ res2) (+ rbias per channel), returned as s
    (model.norm_residual; else s is empty). pair_hash: the dropout mask one hash for two channels (keep_mask).
    x_sums, dbias: the backward's only (model.norm_x_sums, model.norm_dbias), carried to it. split_out (with x2,
    model.conv_parts): out is the output's first C1 channels in x's layout and out2 the rest in x2's, else out2 is
    empty. cw (model.conv_cutlass): the op computes its input too, s = conv3x3(x, cw) (+ res + rbias), x being the
    convolution's input and cw its [C, Cin, 3, 3] weight, and returns s; on CUDA by CUTLASS's kernel, whose epilogue
    writes the sums the statistics take (ffcv_ddpm.conv_cutlass), so no pass reads s for them. No x2 or res2.
    cutlass_dgrad (with cw; model.conv_cutlass_dgrad): the backward's dx of that convolution by CUTLASS's dgrad
    (conv_cutlass.dgrad), its weight's gradient by cuDNN's. skip_w (two parts; model.conv_cutlass): the up block's
    1x1 skip weight [Cout, C1 + C2] over the same parts, whose GEMM (unet.mm_acc) takes slot, an uninitialised
    [N*H*W, Cout] tensor, as an input and gives it the skip output's gradient: the backward accumulates that times
    the weight into dx2, and into dx where there is no res (a residual sum's other gradients come as ds), in place
    (cuBLAS reading them as C) instead of a GEMM output and an add (model.conv_cutlass_skip_slot, NOTES 52); slot is
    empty without skip_w."""
    if split_out and x2 is None:
        raise ValueError("fused GroupNorm: split_out writes the output of two parts as two tensors; x2 is None")
    if cw is not None and (x2 is not None or res2 is not None or cw.dtype != x.dtype):
        raise ValueError("fused GroupNorm: a convolution computed by the op (cw) takes one input, one residual and a "
                         f"weight of the input's dtype; got a second part {x2 is not None}, a second residual "
                         f"{res2 is not None}, a {cw.dtype} weight for a {x.dtype} input")
    if skip_w is not None and (x2 is None or cw is not None or skip_w.shape[1] != x.shape[1] + x2.shape[1]):
        raise ValueError(f"fused GroupNorm: skip_w is a 1x1 weight over two parts of {x.shape[1]} + "
                         f"{None if x2 is None else x2.shape[1]} channels; got {tuple(skip_w.shape)}"
                         f"{' and a convolution (cw)' if cw is not None else ''}")
    slot = _slot(x, skip_w)
    if _on_triton(x):
        return *triton_forward(x, a, b, e, seed, groups, eps, silu, p, tile, chunk, warps, stages, x2, saved_means,
                               mask_bits, res, res2, rbias, pair_hash, split_out, cw), slot
    if cw is not None:
        x = s = conv_sum(x, cw, res, rbias)
    else:
        s = residual_sum(x, res, res2, rbias).contiguous(memory_format=_format(x)) if res is not None else None
    out, *rest = reference_forward(_joined(x if s is None else s, x2), a, b, e, seed, groups, eps, silu, p,
                                   saved_means, mask_bits, pair_hash)
    out, out2 = _split(out, x, x2) if split_out else (out, x.new_empty(0))
    return out, *rest, x.new_empty(0) if s is None else s, out2, slot


def _slot(x: Tensor, skip_w: Tensor | None) -> Tensor:
    """The op's slot output: [N*H*W, Cout] of x's dtype, never written or read (its gradient is what it carries)."""
    return x.new_empty(0) if skip_w is None else x.new_empty(x.shape[0] * x[0, 0].numel(), skip_w.shape[0])


@group_norm_act.register_fake
def _(x, a, b, e, seed, groups, eps, silu, p, tile, chunk, warps, stages, x2, saved_means, mask_bits, res, res2,
      rbias, pair_hash, x_sums, dbias, split_out, cw=None, cutlass_dgrad=False, skip_w=None):
    x = x if cw is None else _conv_output_like(x, cw)  # what the GroupNorm normalises: the convolution's output
    stats = x.new_empty((x.shape[0], groups), dtype=torch.float32)
    out, out2 = _outputs_like(x, x2, split_out)
    n, c = x.shape[0], x.shape[1] + (x2.shape[1] if x2 is not None else 0)
    return (out, stats, stats.clone(),
            *_extra_outputs(x, n, c, x[0, 0].numel(), e is not None and saved_means, p > 0 and mask_bits),
            torch.empty_like(x) if res is not None or cw is not None else x.new_empty(0), out2, _slot(x, skip_w))


@register_flop_formula(torch.ops.ffcv_ddpm.group_norm_act)
def _flops(x_shape, *args, out_shape=None, **kwargs) -> int:
    """FlopCounterMode's count of the op: its convolution's where it runs one (cw, model.conv_cutlass; argument 23,
    passed only then), as aten.convolution's formula counts it; the GroupNorm's arithmetic is elementwise, which
    FlopCounterMode never counts. (Its backward's convolution is aten.convolution_backward, or with cutlass_dgrad
    that for the weight and conv_cutlass.dgrad, each with a formula of its own.)"""
    cw = args[22] if len(args) > 22 else kwargs.get("cw")
    if cw is None:
        return 0
    n, _, h, w = x_shape
    return 2 * n * h * w * prod(cw)


@torch.library.custom_op("ffcv_ddpm::group_norm_act_backward", mutates_args=())
def group_norm_act_backward(dout: Tensor, x: Tensor, a: Tensor, b: Tensor, e: Tensor | None, seed: Tensor,
                            mean: Tensor, rstd: Tensor, groups: int, eps: float, silu: int, p: float, tile: int,
                            chunk: int, warps: int, stages: int, x2: Tensor | None, cmean: Tensor | None,
                            bits: Tensor | None, ds: Tensor | None, pair_hash: bool, x_sums: bool, dbias: bool,
                            dout2: Tensor | None, dres: Tensor | None = None, skip_w: Tensor | None = None,
                            skip_first: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, da, db, de, dx2, dbias): de is empty when there was no add, dx2 when there is no second part, dbias
    without `dbias` (else dx summed over samples and pixels, fp32: a residual sum's bias gradient). cmean, bits: the
    forward's, None where it kept none. ds: a gradient of x from elsewhere (the residual sum's other readers), added
    to dx. x_sums: the kernels' sums over x (the plain-torch path computes one way). dout2: with a forward that split
    its output (split_out), out2's gradient, dout then out's; None: dout is the whole output's. dres, skip_w (the
    forward's skip_w): the skip GEMM's output gradient [N*H*W, Cout], times the weight's slices added to dx2, and to
    dx with skip_first (model.conv_cutlass_skip_slot, NOTES 52)."""
    if _on_triton(x):
        dx, da, db, de, dx2, dsum = triton_backward(dout, x, a, b, e, seed, mean, rstd, groups, silu, p, tile, chunk,
                                                    warps, stages, x2, cmean, bits, ds, pair_hash, x_sums, dbias,
                                                    dout2)
    else:
        dout = dout if dout2 is None else torch.cat((dout, dout2), 1)
        dx, da, db, de = reference_backward(dout, _joined(x, x2), a, b, e, seed, groups, eps, silu, p, bits,
                                            pair_hash)
        dx, dx2 = _split(dx, x, x2) if x2 is not None else (dx, dx.new_empty(0))
        dx = dx if ds is None else (dx + ds).contiguous(memory_format=_format(x))
        dsum = bias_grad(dx) if dbias else dx.new_empty(0, dtype=torch.float32)
    if dres is not None:
        c1 = x.shape[1]
        dx2 = _acc_mm(dx2, dres, skip_w[:, c1:])
        if skip_first:
            dx = _acc_mm(dx, dres, skip_w[:, :c1])
            dsum = bias_grad(dx) if dbias else dsum  # (the dx kernel's sums did not have the skip's term)
    return dx, da, db, de, dx2, dsum


def _acc_mm(t: Tensor, d: Tensor, w: Tensor) -> Tensor:
    """t + (d @ w) in t's (N, C, H, W) shape, d [N*H*W, Cout] and w [Cout, C]: in place where t is channels_last (its
    NHWC view is then the GEMM's C, read and written by cuBLAS), else a new tensor."""
    n, c, h, wd = t.shape
    if t.is_contiguous(memory_format=torch.channels_last):
        t.permute(0, 2, 3, 1).view(n * h * wd, c).addmm_(d, w)
        return t
    return t + (d @ w).view(n, h, wd, c).permute(0, 3, 1, 2)


@register_flop_formula(torch.ops.ffcv_ddpm.group_norm_act_backward)
def _backward_flops(dout_shape, *args, out_shape=None, **kwargs) -> int:
    """The skip GEMM's input gradients where the backward takes them (dres, skip_w and skip_first, arguments 24-26:
    unet.mm_acc with a slot): 2 M Cout C2, and C1 with skip_first, as aten.mm's formula counts them; the rest is
    elementwise. The first part's channels from x's shape (argument 1)."""
    dres = args[23] if len(args) > 23 else kwargs.get("dres")
    skip_w = args[24] if len(args) > 24 else kwargs.get("skip_w")
    first = args[25] if len(args) > 25 else kwargs.get("skip_first", False)
    if dres is None or skip_w is None:
        return 0
    return 2 * dres[0] * dres[1] * (skip_w[1] if first else skip_w[1] - args[0][1])


@group_norm_act_backward.register_fake
def _(dout, x, a, b, e, seed, mean, rstd, groups, eps, silu, p, tile, chunk, warps, stages, x2, cmean, bits, ds,
      pair_hash, x_sums, dbias, dout2, dres=None, skip_w=None, skip_first=False):
    return (torch.empty_like(x), torch.empty_like(a), torch.empty_like(b), a.new_empty(a.shape if e is not None else 0),
            torch.empty_like(x2) if x2 is not None else x.new_empty(0),
            x.new_empty(x.shape[1] if dbias else 0, dtype=torch.float32))


def bias_grad(dx: Tensor) -> Tensor:
    """A per-channel bias's gradient from its output's: dx summed over samples and pixels, in fp32."""
    return dx.sum((0, 2, 3), dtype=torch.promote_types(dx.dtype, torch.float32))


def _joined(x: Tensor, x2: Tensor | None) -> Tensor:
    """The concatenation the two parts stand for (the plain-torch path computes on it)."""
    return x if x2 is None else torch.cat((x, x2), 1).contiguous(memory_format=_format(x))


def _split(t: Tensor, x: Tensor, x2: Tensor) -> tuple[Tensor, Tensor]:
    """The concatenation t's channels as the parts x and x2 hold them: two dense tensors in their layouts (what the
    kernels write: dx and dx2, or split_out's out and out2). Copies: where a slice is dense already (one sample,
    NCHW) .contiguous() would return it, a view of t, and a custom op's outputs may not alias each other."""
    t1, t2 = t.split([x.shape[1], x2.shape[1]], 1)
    return t1.clone(memory_format=_format(x)), t2.clone(memory_format=_format(x2))


def _outputs_like(x: Tensor, x2: Tensor | None, split_out: bool) -> tuple[Tensor, Tensor]:
    """Empty (out, out2): out of the concatenation's shape in x's layout and out2 empty, or with split_out one like
    each part."""
    if split_out:
        return torch.empty_like(x), torch.empty_like(x2)
    if x2 is None:
        return torch.empty_like(x), x.new_empty(0)
    shape = (x.shape[0], x.shape[1] + x2.shape[1], *x.shape[2:])
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=_format(x)), x.new_empty(0)


def _setup_context(ctx, inputs, output):
    (x, a, b, e, seed, *args, x2, _saved_means, _mask_bits, res, res2, rbias, pair_hash, x_sums, dbias, split_out,
     cw, cutlass_dgrad, skip_w) = inputs
    _, mean, rstd, cmean, bits, s, _, _ = output
    # With a residual sum the kernels after the statistics read s, not x: the backward too. With a convolution (cw)
    # also its input and weight, for its backward.
    conv = cw is not None
    ctx.save_for_backward(s if res is not None or conv else x, a, b, e, seed, mean, rstd, x2,
                          cmean if cmean.numel() else None, bits if bits.numel() else None, x if conv else None, cw,
                          skip_w)
    if conv and res is None:
        # s is then the convolution's output, returned for the backward only (its Pending refuses other readers):
        # without this its gradient would be zeros that the dx kernel reads and adds (a fill and a pass at each
        # such site, +2 ms a step on an H200: results/h200/conv-cutlass-profile-bdaad7c).
        ctx.mark_non_differentiable(s)
    ctx.args = tuple(args)  # groups, eps, silu, p and the plan: tile, chunk, warps, stages
    ctx.residual = (res is not None, res2 is not None, None if rbias is None else rbias.dtype)
    ctx.pair_hash, ctx.x_sums, ctx.dbias, ctx.split_out = pair_hash, x_sums, dbias and rbias is not None, split_out
    ctx.cutlass_dgrad = cutlass_dgrad


def _backward(ctx, dout, _dmean, _drstd, _dcmean, _dbits, ds, dout2, dslot):
    x, a, b, e, seed, mean, rstd, x2, cmean, bits, cx, cw, skip_w = ctx.saved_tensors
    has_res, has_res2, rbias_dtype = ctx.residual
    ds = ds if has_res and ds is not None and ds.numel() else None  # s's gradient from its other readers
    dres = dslot if skip_w is not None and dslot is not None else None  # the skip GEMM's output gradient
    dx, da, db, de, dx2, dbias = group_norm_act_backward(dout, x, a, b, e, seed, mean, rstd, *ctx.args, x2, cmean,
                                                         bits, ds, ctx.pair_hash, ctx.x_sums, ctx.dbias,
                                                         dout2 if ctx.split_out else None,
                                                         *(() if dres is None else (dres, skip_w, not has_res)))
    # The sum's terms share its gradient; its bias, the sum of it over samples and pixels (with ctx.dbias summed by
    # the dx kernel as it writes dx).
    if rbias_dtype is not None:
        dbias = (dbias if ctx.dbias else bias_grad(dx)).to(rbias_dtype)
    else:
        dbias = None
    dcx = dcw = None
    if cw is not None:  # s = conv3x3(cx, cw) + ...: its input's and weight's gradients from s's (cuDNN's backward)
        dcx, dcw, _ = torch.ops.aten.convolution_backward(dx, cx, cw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                          [not ctx.cutlass_dgrad, True, False])
        if ctx.cutlass_dgrad:  # dx by CUTLASS's dgrad (model.conv_cutlass_dgrad)
            from ffcv_ddpm import conv_cutlass

            dcx = conv_cutlass.dgrad(dx, cw)
    return (dx if cw is None else dcx, da, db, (de if e is not None else None), None,
            *(None for _ in ctx.args),  # seed, the non-tensors
            dx2 if x2 is not None else None, None, None, dx if has_res else None, dx if has_res2 else None, dbias,
            None, None, None, None, dcw, None, None)  # pair_hash, x_sums, dbias, split_out, cw, cutlass_dgrad,
    # skip_w (its gradient is the skip GEMM's, unet.mm_acc's)


group_norm_act.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------- Triton


def _plan(x: Tensor, groups: int, tile: int, chunk: int, channels: int | None = None) -> dict:
    """Tile sizes, and the split of each sample's rows into K chunks for the reductions (ffcv_ddpm.gn_kernels):
    about `tile` elements per tile of the elementwise kernels and `chunk` per program of the reductions. `channels`:
    the concatenation's when x is its first part."""
    import triton

    if problem := plan_problem(tile, chunk, 1):
        raise ValueError(f"fused GroupNorm plan tile={tile}, chunk={chunk}: {problem}")
    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise RuntimeError("the fused GroupNorm's Triton kernels run on CUDA tensors, or on CPU tensors under "
                           "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    n, c = x.shape[0], channels or x.shape[1]
    hw = x[0, 0].numel()
    sms = 4 if x.device.type != "cuda" else torch.cuda.get_device_properties(x.device).multi_processor_count
    return plan_for(n, c, hw, groups, tile, chunk, sms)


def plan_for(n: int, c: int, hw: int, groups: int, tile: int, chunk: int, sms: int) -> dict:
    """_plan's arithmetic on the shape alone (N samples, C channels, HW rows, on a GPU of `sms` SMs): the launch
    constants the kernels get. benchmarks.speed.kernel_regs builds the kernels with them, without a GPU."""
    import triton

    if n * c * hw >= 2**31:
        raise ValueError(f"the fused GroupNorm indexes with 32-bit integers: (N, C, H*W) = {(n, c, hw)} has too "
                         "many elements; use a smaller batch or model.norm_impl=scale-shift")
    cpg = c // groups
    block_c = triton.next_power_of_2(c)
    block_g, block_cpg = triton.next_power_of_2(groups), triton.next_power_of_2(cpg)
    if block_g * block_cpg > 8192:
        raise ValueError(f"the fused GroupNorm handles up to 8192 channels, got {c}; use model.norm_impl=scale-shift")
    block_r = max(1, min(triton.next_power_of_2(hw), tile // block_c))
    k = triton.cdiv(hw, max(block_r, chunk // block_c))
    if n * k < 4 * sms:  # small batches: more, shorter chunks to fill the GPU
        k = min(triton.cdiv(hw, block_r), triton.cdiv(4 * sms, n))
    k = min(k, max(1, 16384 // (block_g * block_cpg)))  # the finalize kernels hold [K, C] partials
    rows = triton.cdiv(triton.cdiv(hw, k), block_r) * block_r  # a sample's rows per reduction program
    k = triton.cdiv(hw, rows)
    return dict(N=n, C=c, HW=hw, G=groups, CPG=cpg, K=k, CHUNK=rows, BLOCK_R=block_r, BLOCK_C=block_c,
                BLOCK_G=block_g, BLOCK_CPG=block_cpg, BLOCK_K=triton.next_power_of_2(k), WORD=min(32, block_c))


def _nchw_strides(t: Tensor) -> tuple[int, int, int]:
    """(n, c, hw) strides of an (N, C, H, W) tensor whose H and W merge into one axis (NCHW and channels_last do)."""
    if t.dim() == 4 and t.shape[3] > 1 and t.shape[2] > 1 and t.stride(2) != t.shape[3] * t.stride(3):
        raise ValueError(f"fused GroupNorm: H and W of a tensor with strides {t.stride()} cannot be merged")
    return t.stride(0), t.stride(1), t.stride(-1)


def mask_words(c: int) -> int:
    """Int32 words a row of the dropout mask takes as bits (model.norm_mask_bits): 32 channels a word."""
    return -(-c // 32)


def _extra_outputs(x: Tensor, n: int, c: int, hw: int, means: bool, bits: bool) -> tuple[Tensor, Tensor]:
    """The op's (cmean, bits) outputs, empty where not asked for: (N, C) fp32 per-channel means of x + e, and the
    dropout mask as (N * HW, mask_words(C)) int32 words, bit b of word j the keep of channel 32 j + b (the layout of
    ffcv_ddpm.conv_gn.keep_bits)."""
    return (x.new_empty((n, c) if means else 0, dtype=torch.float32),
            x.new_empty((n * hw, mask_words(c)) if bits else 0, dtype=torch.int32))


def _dropout_args(p: float, pair_hash: bool = False) -> tuple[int, float]:
    """(threshold on the hash's top 24 bits, or with pair_hash on each 16-bit half; 1 / keep probability)."""
    return int(round(p * (1 << (16 if pair_hash else 24)))), 1.0 / (1.0 - p)


def _pair(pair_hash: bool, p: float, c: int) -> bool:
    """The kernels' PAIR: one hash for channels 2j and 2j + 1 (an even channel count, refused otherwise)."""
    if pair_hash and p > 0 and c % 2:
        raise ValueError(f"fused GroupNorm: pair_hash draws one hash for two channels; {c} channels is odd")
    return pair_hash and p > 0


def _second_part(x: Tensor, x2: Tensor | None) -> tuple[Tensor, int, tuple[int, int, int], bool]:
    """(the second part's tensor, C1, its (n, c, hw) strides, TWO) as the kernels take them: without a second part,
    x again (never read: TWO is off), C1 = all of x's channels."""
    if x2 is None:
        return x, x.shape[1], (0, 0, 0), False
    if x2.shape[0] != x.shape[0] or x2.shape[2:] != x.shape[2:] or x2.dtype != x.dtype:
        raise ValueError(f"fused GroupNorm: the parts {tuple(x.shape)} {x.dtype} and {tuple(x2.shape)} {x2.dtype} "
                         "differ in more than their channels")
    return x2, x.shape[1], _nchw_strides(x2), True


def triton_forward(x, a, b, e, seed, groups, eps, silu, p, tile, chunk, warps, stages=0, x2=None, saved_means=False,
                   mask_bits=False, res=None, res2=None, rbias=None, pair_hash=False, split_out=False, cw=None):
    """The op's forward through the Triton kernels, launched with the plan (tile, chunk, warps, stages); x2: the
    second part of a channel concatenation (None: x is all of it). (out, mean, rstd, cmean, bits, s, out2): cmean the
    per-channel means of x + e with saved_means and an add, bits the dropout mask with mask_bits and p > 0 (their
    layout: mask_words), each empty otherwise. res (and res2, rbias): the first part is the residual sum
    s = x + res (+ res2) (+ rbias per channel), written while the statistics are taken and returned (else empty).
    split_out (with x2): the output written as two tensors, out like x and out2 like x2 (else out2 is empty).
    cw: x is a convolution's input, s = conv3x3(x, cw) (+ res + rbias) and the statistics come from the sums its
    epilogue writes (conv_cutlass.conv_sums): no statistics kernel."""
    import triton

    from ffcv_ddpm import conv_cutlass
    from ffcv_ddpm import gn_kernels as K

    sums = None
    if cw is not None:
        x, sums = conv_cutlass.conv_sums(x, cw, res, rbias)
        res = None  # in x now, which the op returns as s
    x2_, c1, x2s, two = _second_part(x, x2)
    pl = _plan(x, groups, tile, chunk, channels=x.shape[1] + (x2.shape[1] if two else 0))
    n, c, hw = pl["N"], pl["C"], pl["HW"]
    out, out2 = _outputs_like(x, x2, split_out)
    if out.stride() != x.stride() and not two:
        raise ValueError(f"fused GroupNorm: input strides {x.stride()} are not those of a dense tensor")
    addends = _residual_addends(x, res, res2)
    s_out = x if sums is not None else torch.empty_like(x) if addends else x.new_empty(0)
    mean = x.new_empty((n, groups), dtype=torch.float32)
    rstd = torch.empty_like(mean)
    e_ = a if e is None else e  # any tensor: not read when HAS_ADD is off
    xs = (*_nchw_strides(x), c1, *x2s)  # the input's strides, then where and how the second part is read
    os = _nchw_strides(out)
    split = {}  # the apply kernel's second output (split_out: the channels from C1 on), none by its defaults
    if split_out:
        split = dict(zip(("s_o2n", "s_o2c", "s_o2hw"), _nchw_strides(out2)), out2_ptr=out2, OUT_TWO=True)
    k = pl["K"]
    part = x.new_empty((n, k, 2, c), dtype=torch.float32)
    coef = x.new_empty((n, 2, c), dtype=torch.float32)
    cmean, bits = _extra_outputs(x, n, c, hw, e is not None and saved_means, p > 0 and mask_bits)
    chunk_rows = pl["CHUNK"]
    if sums is not None:  # the convolution's tiles are the chunks
        part, k, chunk_rows = sums, hw // conv_cutlass.TILE_M, conv_cutlass.TILE_M
    else:
        K._stats_kernel[(n, k)](x, x2_, part, c, hw, k, *xs, CHUNK=pl["CHUNK"], BLOCK_R=pl["BLOCK_R"],
                                BLOCK_C=pl["BLOCK_C"], TWO=two, STAGES=stages or None, num_warps=warps,
                                **_residual_args(x, addends, rbias, s_out, a), **K.pdl_args())
    x = s_out if addends else x  # what the kernels after the statistics read
    K._finalize_kernel[(n,)](part, a, b, e_, coef, mean, rstd, c, hw, groups, pl["CPG"], k, a.stride(0), a.stride(1),
                             e_.stride(0), e_.stride(1), eps, CHUNK=chunk_rows,
                             BLOCK_K=triton.next_power_of_2(k) if sums is not None else pl["BLOCK_K"],
                             BLOCK_G=pl["BLOCK_G"], BLOCK_CPG=pl["BLOCK_CPG"], HAS_ADD=e is not None,
                             cmean_ptr=cmean if cmean.numel() else mean, SAVE_MEANS=cmean.numel() > 0,
                             SUMS_ROWS=n * k, SUMS=sums is not None, num_warps=warps, **K.pdl_args())
    K._apply_kernel[(n, triton.cdiv(hw, pl["BLOCK_R"]))](  # unused pointers: any tensor, never touched
        x, x2_, out, coef, seed, bits if bits.numel() else x, c, hw, mask_words(c), *xs, *os,
        *_dropout_args(p, pair_hash), BLOCK_R=pl["BLOCK_R"], BLOCK_C=pl["BLOCK_C"], SILU=int(silu), DROPOUT=p > 0,
        TWO=two, BITS=bits.numel() > 0, WORD=pl["WORD"], FAST_TANH=_fast_tanh(silu), PAIR=_pair(pair_hash, p, c),
        num_warps=warps, **split, **K.pdl_args())
    return out, mean, rstd, cmean, bits, s_out, out2


def _fast_tanh(silu: int) -> bool:
    """The kernels' tanh through tanh.approx.f32 (SiLU mode 2), except under Triton's interpreter (no inline PTX)."""
    import triton

    return silu == 2 and not triton.knobs.runtime.interpret


def _residual_addends(x: Tensor, res: Tensor | None, res2: Tensor | None) -> tuple[Tensor, ...]:
    """The residual tensors the statistics kernel adds to x, in x's layout (what it reads them with)."""
    addends = tuple(t for t in (res, res2) if t is not None)
    for t in addends:
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"fused GroupNorm: a residual {tuple(t.shape)} {t.dtype} is not like the input "
                             f"{tuple(x.shape)} {x.dtype}")
    return tuple(t if t.stride() == x.stride() else t.contiguous(memory_format=_format(x)) for t in addends)


def _residual_args(x: Tensor, addends: tuple[Tensor, ...], rbias: Tensor | None, s_out: Tensor, a: Tensor) -> dict:
    """_stats_kernel's residual arguments: none without addends (its defaults)."""
    if not addends:
        return {}
    # The bias rounded to x's dtype first, as Pending.value() adds it.
    rb = rbias.to(x.dtype).float().contiguous() if rbias is not None else a
    return dict(res_ptr=addends[0], res2_ptr=addends[-1], rb_ptr=rb, s_ptr=s_out, RES=len(addends),
                RBIAS=rbias is not None)


def triton_backward(dout, x, a, b, e, seed, mean, rstd, groups, silu, p, tile, chunk, warps, stages=0, x2=None,
                    cmean=None, bits=None, ds=None, pair_hash=False, x_sums=False, dbias=False, dout2=None):
    """The op's backward through the Triton kernels, launched with the forward's plan (tile, chunk, warps, stages):
    (dx, da, db, de, dx2, dbias), dx2 empty without a second part, dbias the sum of the first part's dx over
    samples and pixels (fp32) with `dbias` (model.norm_dbias: from the dx kernel's per-tile sums), else empty.
    cmean, bits: what triton_forward kept with saved_means and mask_bits (None: the backward sums xhat itself, hashes
    the mask again). ds: a gradient of x (the first part) from elsewhere, added to dx (a residual sum's other readers:
    model.norm_residual). x_sums: the reduction and dx kernels compute over x, not xhat (model.norm_x_sums: one
    multiply-add an element fewer, the same sums). dout2: the gradient of a split output's out2 (split_out), dout
    then out's: the kernels read the two where they lie."""
    import triton

    from ffcv_ddpm import gn_kernels as K

    x2_, c1, x2s, two = _second_part(x, x2)
    pl = _plan(x, groups, tile, chunk, channels=x.shape[1] + (x2.shape[1] if two else 0))
    n, c, hw = pl["N"], pl["C"], pl["HW"]
    dx = torch.empty_like(x)
    dx2 = torch.empty_like(x2) if two else x.new_empty(0)
    da, db = (x.new_empty((n, c), dtype=torch.float32) for _ in range(2))
    de = x.new_empty((n, c) if e is not None else 0, dtype=torch.float32)
    e_ = a if e is None else e
    xs, dstr = (*_nchw_strides(x), c1, *x2s), _nchw_strides(dout)
    from_means, use_bits = e is not None and cmean is not None, p > 0 and bits is not None
    for name, kept, shape in (("means", cmean if from_means else None, (n, c)),
                              ("bits", bits if use_bits else None, (n * hw, mask_words(c)))):
        if kept is not None and kept.shape != shape:
            raise ValueError(f"fused GroupNorm backward: the forward's {name} {tuple(kept.shape)} are not {shape}, "
                             f"those of (N, C, H*W) = {(n, c, hw)}")
    bits_ = bits if use_bits else x  # never read when BITS is off
    common = (c, hw, mask_words(c), groups, pl["CPG"])
    flags = dict(HAS_ADD=e is not None, SILU=int(silu), DROPOUT=p > 0, TWO=two, BITS=use_bits, WORD=pl["WORD"],
                 FAST_TANH=_fast_tanh(silu), PAIR=_pair(pair_hash, p, c), XSUMS=x_sums, num_warps=warps)
    if dout2 is not None:  # out2's gradient: the channels from C1 on
        if not two or dout.shape != x.shape or dout2.shape != x2.shape:
            raise ValueError(f"fused GroupNorm backward: the split output's gradients {tuple(dout.shape)} and "
                             f"{tuple(dout2.shape)} are not the parts' {tuple(x.shape)} and "
                             f"{tuple(x2.shape) if two else None}")
        flags.update(zip(("s_d2n", "s_d2c", "s_d2hw"), _nchw_strides(dout2)), dout2_ptr=dout2, DOUT_TWO=True)
    dx2_ = dx2 if two else dx  # never written when TWO is off
    k = pl["K"]
    part = x.new_empty((n, k, 3, c), dtype=torch.float32)
    coef = x.new_empty((n, 3, c), dtype=torch.float32)
    K._bwd_reduce_kernel[(n, k)](dout, x, x2_, bits_, a, b, e_, seed, mean, rstd, part, *common, k, *xs, *dstr,
                                 a.stride(0), a.stride(1), e_.stride(0), e_.stride(1), *_dropout_args(p, pair_hash),
                                 CHUNK=pl["CHUNK"], BLOCK_R=pl["BLOCK_R"], BLOCK_C=pl["BLOCK_C"],
                                 STAGES=stages or None, SUM_XHAT=e is not None and not from_means, **flags,
                                 **K.pdl_args())
    K._bwd_finalize_kernel[(n,)](part, a, mean, rstd, cmean if from_means else mean, da, db,
                                 de if e is not None else da, coef, c, hw, groups, pl["CPG"], k,
                                 a.stride(0), a.stride(1), BLOCK_K=pl["BLOCK_K"], BLOCK_G=pl["BLOCK_G"],
                                 BLOCK_CPG=pl["BLOCK_CPG"], HAS_ADD=e is not None, FROM_MEANS=from_means,
                                 num_warps=warps, **K.pdl_args())
    if ds is not None and ds.shape != x.shape:
        raise ValueError(f"fused GroupNorm backward: ds {tuple(ds.shape)} is not the first part's {tuple(x.shape)}")
    extra = {}
    if ds is not None:
        s_gn, s_gc, s_ghw = _nchw_strides(ds)
        extra = dict(ds_ptr=ds, s_gn=s_gn, s_gc=s_gc, s_ghw=s_ghw, HAS_DS=True)
    tiles = triton.cdiv(hw, pl["BLOCK_R"])
    # A tile's sums, (N, tiles, C1) fp32: 2 / BLOCK_R of dx's bytes written and read where dx.sum read all of dx.
    dbias_part = x.new_empty((n, tiles, c1) if dbias else 0, dtype=torch.float32)
    if dbias:
        extra.update(dbias_ptr=dbias_part, DBIAS=True)
    K._bwd_dx_kernel[(n, tiles)](
        dout, x, x2_, bits_, dx, dx2_, a, b, e_, seed, mean, rstd, coef, *common, *xs, *dstr, a.stride(0),
        a.stride(1), e_.stride(0), e_.stride(1), *_dropout_args(p, pair_hash), BLOCK_R=pl["BLOCK_R"],
        BLOCK_C=pl["BLOCK_C"], **flags, **extra, **K.pdl_args())
    return dx, da, db, de, dx2, dbias_part.sum((0, 1)) if dbias else dbias_part


# ---------------------------------------------------------------------------------------------------- reference


def keep_mask(seed: Tensor, shape: tuple[int, ...], p: float, pair_hash: bool = False) -> Tensor:
    """Dropout's keep mask for an (N, C, H, W) output, as the Triton kernels draw it (gn_kernels._keep_tile): a 32-bit
    hash of the seed and each element's logical index in (n, hw, c) order, kept where its top 24 bits are
    >= p * 2^24; with pair_hash a hash of each pair of channels' index (n, hw, c // 2), channel c's the low 16 bits
    for even c and the high for odd, kept where >= p * 2^16."""
    n, c, h, w = shape
    m32 = np.uint64(0xFFFFFFFF)  # uint64 products of two 32-bit values do not overflow; keep the low 32 bits
    s = np.uint64(int(seed.reshape(-1)[0]) & 0xFFFFFFFF)
    s ^= s >> np.uint64(16)
    s = (s * np.uint64(0x7FEB352D)) & m32
    s ^= s >> np.uint64(15)
    pair_hash = _pair(pair_hash, p, c)  # the kernels' rule: an odd channel count is refused here too
    index = np.arange(n * h * w * c, dtype=np.uint64)
    z = ((index >> np.uint64(1) if pair_hash else index) * np.uint64(0x9E3779B1) + s) & m32
    z ^= z >> np.uint64(16)
    z = (z * np.uint64(0x85EBCA6B)) & m32
    z ^= z >> np.uint64(13)
    z = (z * np.uint64(0xC2B2AE35)) & m32
    z ^= z >> np.uint64(16)
    if pair_hash:  # the pair's index is the element's halved: c even, so a pair never straddles two rows
        z = (z >> (np.uint64(16) * (index & np.uint64(1)))) & np.uint64(0xFFFF)
    else:
        z = z >> np.uint64(8)
    keep = z.astype(np.int64) >= _dropout_args(p, pair_hash)[0]
    return torch.from_numpy(keep).view(n, h, w, c).permute(0, 3, 1, 2)


def pack_bits(keep: Tensor) -> Tensor:
    """A boolean (N, C, H, W) keep mask as the op's bits (_extra_outputs' layout, conv_gn.keep_bits' too;
    unpack_bits reads them back)."""
    n, c, h, w = keep.shape
    words = mask_words(c)
    k = F.pad(keep.permute(0, 2, 3, 1).reshape(n * h * w, c).long(), (0, 32 * words - c)).view(n * h * w, words, 32)
    packed = (k << torch.arange(32, device=k.device)).sum(-1)  # distinct bits: the sum is their OR, < 2^32
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()  # the same 32 bits as a signed int32


def unpack_bits(bits: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """pack_bits' (and conv_gn.keep_bits') words as the boolean (N, C, H, W) mask they hold (torch: the checks'
    reference reads it)."""
    n, c, h, w = shape
    ch = torch.arange(c, device=bits.device)
    words = bits.view(n, h, w, -1)[..., ch // 32]  # (N, H, W, C): each channel's word
    return ((words >> (ch % 32)) & 1).bool().permute(0, 3, 1, 2)


def _reference_math(x, a, b, e, seed, groups, eps, silu, p, pair_hash=False):
    """(out, mean, rstd, xhat, y): the forward in x's precision (fp32 at least), keeping what the backward needs."""
    n, c = x.shape[:2]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if e is not None:
        xf = xf + e.to(xf.dtype)[:, :, None, None]
    var, mean = torch.var_mean(xf.reshape(n, groups, -1), dim=2, unbiased=False)  # (N, G)
    rstd = torch.rsqrt(var + eps)
    xhat = ((xf.reshape(n, groups, -1) - mean[:, :, None]) * rstd[:, :, None]).view_as(xf)
    y = xhat * a.to(xf.dtype)[:, :, None, None] + b.to(xf.dtype)[:, :, None, None]
    out = F.silu(y) if silu else y
    if p > 0:
        out = torch.where(keep_mask(seed, tuple(x.shape), p, pair_hash).to(out.device), out * _dropout_args(p)[1], 0.0)
    return out, mean, rstd, xhat, y


def reference_forward(x, a, b, e, seed, groups, eps, silu, p, saved_means=False, mask_bits=False, pair_hash=False):
    """The op in plain torch (its CPU kernel), with the outputs triton_forward gives."""
    out, mean, rstd, _, _ = _reference_math(x, a, b, e, seed, groups, eps, silu, p, pair_hash)
    n, c, h, w = x.shape
    cmean, bits = _extra_outputs(x, n, c, h * w, False, False)
    if e is not None and saved_means:
        cmean = (x.to(mean.dtype).mean((2, 3)) + e.to(mean.dtype)).float()
    if p > 0 and mask_bits:
        bits = pack_bits(keep_mask(seed, tuple(x.shape), p, pair_hash).to(x.device))
    return out.to(x.dtype).contiguous(memory_format=_format(x)), mean.float(), rstd.float(), cmean, bits


def reference_backward(dout, x, a, b, e, seed, groups, eps, silu, p, bits=None, pair_hash=False):
    """The op's backward in plain torch (its CPU kernel): the same formulas as the Triton kernel, the dropout mask
    read from `bits` where the forward kept it. (Not autograd: a custom op's kernel runs below the autograd dispatch
    key.)"""
    n, c = x.shape[:2]
    _, _, rstd, xhat, y = _reference_math(x, a, b, e, seed, groups, eps, silu, 0.0)
    dy = dout.to(xhat.dtype)
    if p > 0:
        if bits is not None:
            keep = unpack_bits(bits, tuple(x.shape))
        else:
            keep = keep_mask(seed, tuple(x.shape), p, pair_hash)
        dy = torch.where(keep.to(dy.device), dy * _dropout_args(p)[1], 0.0)
    if silu:
        sig = torch.sigmoid(y)
        dy = dy * sig * (1 + y * (1 - sig))
    da, db = (dy * xhat).sum((2, 3)), dy.sum((2, 3))  # (N, C)
    dxhat = (dy * a.to(dy.dtype)[:, :, None, None]).reshape(n, groups, -1)
    xg = xhat.reshape(n, groups, -1)
    dx = (dxhat - dxhat.mean(2, keepdim=True) - xg * (dxhat * xg).mean(2, keepdim=True)) * rstd.to(dy.dtype)[:, :, None]
    dx = dx.view_as(xhat)
    de = dx.sum((2, 3)).to(e.dtype) if e is not None else x.new_empty(0, dtype=torch.float32)
    return dx.to(x.dtype).contiguous(memory_format=_format(x)), da.to(a.dtype), db.to(b.dtype), de


def _format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else torch.contiguous_format
