"""The ε-prediction UNets: the DDPM paper's CIFAR-10 network and an Annotated-Diffusion-style small network.

Layers -> blocks -> networks, each its own class. The networks map (x_t, t, y) to a noise estimate and never see
a noise schedule (that lives in ``ffcv_ddpm.diffusion``).

Presets (``PRESETS``; parameter counts are asserted by tests/test_unet.py):

- ``ddpm-cifar10``: Ho et al. 2020, CIFAR-10 (35,746,307 parameters). Base 128, multipliers (1, 2, 2, 2), two
  residual blocks per resolution, one-head self-attention at 16x16, GroupNorm(32), SiLU, dropout 0.1, sinusoidal
  time embedding -> MLP, strided 3x3 conv downsample, nearest upsample + 3x3 conv. The stride-2 convs pad
  symmetrically (padding=1) where the TensorFlow original used 'SAME' (pads bottom/right only); same parameters.
- ``annotated-small``: the "Annotated Diffusion Model" UNet of the published MFU table (9,190,211 parameters).
  Base 32, multipliers (1, 2, 4, 8), 1x1 stem, two ResNet blocks per level with weight-standardized 3x3 convs,
  GroupNorm(8) and a FiLM-style (scale, shift) time embedding, full self-attention (4 heads x 32) at every level
  and in the middle, skip concatenation from every block. Its downsample is a space-to-depth then 1x1 conv. The
  original wrote that as ``x.reshape(B, 4C, H/2, W/2)``, which does not move 2x2 neighbourhoods into channels but
  scrambles rows of the image; here it is a correct pixel-unshuffle (``F.pixel_unshuffle``: channel c*4 + 2i + j
  holds pixel (2h+i, 2w+j) of channel c). The parameter count is unchanged.
- ``digits``: class-conditional (10 classes + the null label) for the digits quality report (6,475,011
  parameters, 3.17 GFLOP per image forward): the DDPM network at base 64 with three levels (1, 2, 2), attention at
  16x16. A quarter of ddpm-cifar10's forward FLOPs, so a few thousand steps and the report's sampling fit minutes.
- ``tiny``: a few tens of thousands of parameters, for CPU tests.

Speed notes: nothing here forces an NCHW copy (every reshape is commented with its shapes and is a view on a
channels_last tensor), there is no data-dependent Python control flow and no host sync, so the forward has no
graph break (tests/test_unet.py compiles it with ``fullgraph=True``; the trainer does not pass that flag).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import register_flop_formula

from ffcv_ddpm.attn_math import math_attention
from ffcv_ddpm.norm import NORM_IMPLS, GroupNormAct, Pending, parse_plan, residual_first, resolved


@dataclass
class ModelConfig:
    arch: str = "ddpm"  # network family: "ddpm" (Ho et al. 2020) or "annotated" (Annotated Diffusion style)
    image_size: int = 32  # input height = width; fixes which levels get attention
    in_channels: int = 3  # image channels in and out (ε has the image's shape)
    base_channels: int = 128  # channels at the first resolution; level i has base_channels * channel_mult[i]
    channel_mult: tuple[int, ...] = (1, 2, 2, 2)  # one multiplier per resolution level (each level but the last halves H, W)
    num_res_blocks: int = 2  # residual blocks per level on the way down (the up path has one more for "ddpm")
    attn_resolutions: tuple[int, ...] = (16,)  # feature-map sizes (H) that get self-attention; the middle always has it
    attn_heads: int = 1  # attention heads
    attn_head_dim: int | None = None  # channels per head; None = channels // attn_heads ("ddpm"); "annotated" uses 32
    dropout: float = 0.1  # dropout inside residual blocks, before the second 3x3 conv
    norm_groups: int = 32  # GroupNorm groups in residual blocks (and attention for "ddpm")
    conv_groups: int = 1  # groups for the res-block 3x3 convs: 1 dense, >1 grouped, = channels depthwise; must divide their channel counts
    depthwise_separable: bool = False  # res-block 3x3 convs as depthwise 3x3 + pointwise 1x1 (MobileNet); needs conv_groups=1
    attn_impl: str = "sdpa"  # "sdpa" = F.scaled_dot_product_attention, "math" = explicit matmul-softmax (the "before SDPA" row)
    # "math-qkv": math's arithmetic, q, k and v's gradients written as one tensor (ffcv_ddpm.attn_math; one head,
    # attn_linear; NOTES item 55)
    norm_impl: str = "scale-shift"  # GroupNorm (+ SiLU, dropout): "scale-shift" (keeps channels_last), "torch" (nn.GroupNorm) or "fused" (Triton); see ffcv_ddpm.norm
    norm_plan: str = ""  # norm_impl=fused only: the kernels' "TILE,CHUNK,WARPS[,STAGES]" (e.g. "1024,16384,4"; norm_bench --plans); "" = the default
    num_classes: int = 0  # 0 = unconditional; N > 0 adds a label embedding with N + 1 rows, index N = null label (CFG)
    weight_standardize: bool = False  # weight-standardized res-block 3x3 convs (the "annotated" network uses them)
    stem_kernel: int = 3  # kernel of the first conv (3 for "ddpm"; the annotated net uses 1)
    # How the network is computed, not what: each switch gives the same function (up to float rounding) and the
    # same state_dict; benchmarks/NOTES.md item 11 has the measurements behind them.
    concat_free: bool = False  # "ddpm" up path: blocks take (h, skip) as two inputs instead of torch.cat([h, skip])
    upsample: str = "nearest"  # "nearest" (F.interpolate), "expand" (broadcast copy) or "transposed" (folded into the conv)
    pad_image_channels: int = 0  # stem input and output-conv output zero-padded to this many channels; 0 = as is
    attn_linear: bool = False  # attention's 1x1 qkv and output convs as matmuls on the NHWC view (bias in the GEMM)
    # With attn_linear: the qkv projection's backward from q, k and v's gradients where SDPA wrote them (three GEMMs
    # for the weight, dh as one GEMM and two addmm onto it), where autograd stacked them into one (B, HW, 3C)
    # gradient first: a copy of 3 x B x HW x C elements a call (0.19 ms at 16x16 on an H200, NOTES 44 and 49).
    attn_split_grads: bool = False
    # "ddpm" res blocks: conv1's bias joins the time embedding in norm2's add (a pass over conv1's output fewer where
    # nothing can fuse the bias add: norm_impl=fused; +1.3-1.6% in the step on an H200, NOTES item 24).
    conv_bias_in_norm: bool = False
    # norm_impl=fused with concat_free: the up blocks' first GroupNorm reads (h, skip) where they lie instead of
    # concatenating them first (a cat per block, and dx as slices of one tensor); exact; +1.3-1.8% in the step and
    # 2.7 GiB less peak memory on an H100, within the spread on an H200 (NOTES items 24, 26). Not in
    # REFERENCE_COMPUTATION's set (it goes with concat_free: reference_config turns it off too).
    fused_parts: bool = False
    # With fused_parts, at the up blocks whose two parts differ in width (256 + 128 at 32x32 and 16x16): that GroupNorm
    # writes its output as two tensors too, and the block's first conv runs as two over them (its weight's two
    # slices, summed), so that no 384-channel activation or gradient exists: cuDNN's dgrad of the 384 -> 128 conv
    # took 2.21 ms alone where the two parts' took 1.35 together, the forward the same either way (H200, NOTES items
    # 44-45; results/h200/conv-sites-f1fd892/). The equal-width concatenations' dgrads already run at cuDNN's usual rate
    # in the step (745-782 TFLOP/s, profile-1f28a9b), where the split would only add the sum's passes. Measured on an
    # H200 (conv-parts-7017e9e): -0.1 ms over three rounds, the convolutions' 0.5 ms given back by the passes: off.
    conv_parts: bool = False
    # norm_impl=fused, the GroupNorms with an add ("ddpm" res blocks' norm2): the backward's per-channel sum of xhat
    # from the per-channel means the forward saves, instead of a third sum in its reduction (168 -> fewer registers
    # a thread at the 22 add sites; NOTES item 31). Exact up to fp32 summation order.
    norm_saved_means: bool = False
    # norm_impl=fused, the GroupNorms with dropout: the forward keeps the mask as bits (1 a element) and both
    # backward kernels read them instead of hashing (seed, index) again (NOTES item 31). The same mask: exact.
    norm_mask_bits: bool = False
    # norm_impl=fused, "ddpm": each residual sum (a res block's skip + conv2, attention's x + projection) left to the
    # next fused GroupNorm, which writes it while it takes its statistics and, backward, adds the sum's other
    # gradients to its dx in the same write (one pass forward and two backward fewer at each; NOTES item 31).
    norm_residual: bool = False
    # norm_impl=fused: SiLU and its derivative through one tanh.approx.f32 (SiLU(y) = h + h tanh(h), h = y / 2)
    # instead of an exponential and a division, in the forward and both backward kernels. The kernels lose 10-30
    # points of a copy's rate to SiLU's arithmetic (NOTES items 36-37); tanh.approx's ~2^-11 relative error is
    # under bf16's rounding, but it is not exact: NOTES 27's numerics rule before it becomes a default.
    norm_fast_silu: bool = False
    # norm_impl=fused, the GroupNorms with dropout: one hash for each pair of channels (its 16-bit halves against
    # p * 2^16) instead of one an element: half the integer work of the mask, which the kernels are short of (NOTES
    # item 37: the hash costs the apply ~15 points of a copy's rate). A different mask of the same p (to 2^-16).
    norm_pair_hash: bool = False
    # norm_impl=fused, every GroupNorm + SiLU: the backward kernels sum dy * x and x and form dx from x (the sums
    # over xhat follow per channel: u sum(dy x) + v sum(dy)), so xhat = x * u + v is never formed: one multiply-add
    # an element fewer in the reduction and in dx, the kernels the arithmetic holds back (NOTES item 38). The same
    # sums up to fp32 rounding (PyTorch's own GroupNorm backward sums over x too).
    norm_x_sums: bool = False
    # norm_impl=fused with norm_residual: a residual sum's bias gradient (conv2's and the skip's biases, attention's
    # projection's) from the dx kernel's per-tile sums of the sum's gradient as it writes it, where a reduction of its
    # own read that gradient again (NOTES item 41). The same sum in another order; +4.1 ms a step on an H200: off.
    norm_dbias: bool = False
    # norm_impl=fused, "ddpm" res blocks: each 3x3 conv whose output a fused GroupNorm reads next (conv1 -> norm2, and
    # with norm_residual conv2 -> the next block's or attention's GroupNorm) run by that GroupNorm's op with CUTLASS's
    # sm90 kernel (ffcv_ddpm.conv_cutlass: bf16, CUDA, nvcc-built), whose epilogue adds the residual and bias and
    # writes per-128-pixel sums for the GroupNorm's statistics: no statistics pass over the output. Where the kernel
    # does not apply (8x8 and 4x4 maps, two residuals on the up path, fp32) the conv runs as before; conv1's bias
    # joins norm2's add as with conv_bias_in_norm. The backward is cuDNN's. NOTES 47-48.
    conv_cutlass: bool = False
    # With conv_cutlass: those convolutions' data gradients by CUTLASS's dgrad too (the weight's stays cuDNN's):
    # 1.024x cuDNN's rate over the step's sites, 2.21 -> 1.40 ms at the 384 -> 128 32x32 one (NOTES 48).
    conv_cutlass_dgrad: bool = False
    # With conv_cutlass: an up block's skip GEMM (mm_acc) gives its parts' gradients to norm1's backward through a slot
    # output of norm1, which adds them into its dx and dx2 in place (the skip's part always; the first part where it
    # has no ds route, i.e. is no residual sum norm1 computes) instead of the GEMM writing them and autograd adding
    # (NOTES 52; the first form, every part, was slower: results/h200/skip-slot-34ff970).
    conv_cutlass_skip_slot: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Rebuilds a config saved as JSON: lists become tuples again, unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def to_dict(self) -> dict:
        return asdict(self)

    def fused_norm_plan(self) -> tuple[int, ...] | None:
        """norm_plan as GroupNormAct takes it: (tile, chunk, warps[, stages]), or None for the default plan."""
        return parse_plan(self.norm_plan) if self.norm_plan else None

    def act_norm(self) -> dict:
        """The plan and switches as every GroupNorm + SiLU takes them (GroupNormAct's plan, fast_silu, x_sums)."""
        return dict(plan=self.fused_norm_plan(), fast_silu=self.norm_fast_silu, x_sums=self.norm_x_sums,
                    dbias=self.norm_dbias)

    def norm_switches(self) -> dict:
        """The fused kernels' switches as GroupNormAct takes them (for the GroupNorms with an add or dropout)."""
        return dict(saved_means=self.norm_saved_means, mask_bits=self.norm_mask_bits, pair_hash=self.norm_pair_hash)

    def validate(self) -> None:
        """Raises ValueError naming the first inconsistent field, so a bad config fails before building."""
        if self.arch not in ("ddpm", "annotated"):
            raise ValueError(f"arch={self.arch!r}: use 'ddpm' or 'annotated'")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r}: use one of {', '.join(map(repr, ATTN_IMPLS))}")
        if self.attn_impl == "math-qkv" and not (self.attn_linear and self.attn_heads == 1
                                                 and self.attn_head_dim is None and not self.attn_split_grads):
            raise ValueError("attn_impl='math-qkv' is one head's attention over the qkv matmul's output: it needs "
                             "attn_linear=True, attn_heads=1, attn_head_dim=None and attn_split_grads=False; set them "
                             "or use attn_impl='math'")
        if self.norm_impl not in NORM_IMPLS:
            raise ValueError(f"norm_impl={self.norm_impl!r}: use one of {', '.join(map(repr, NORM_IMPLS))}")
        parse_plan(self.norm_plan)  # ValueError('norm_plan=...: ...') naming what is wrong
        if self.norm_plan and self.norm_impl != "fused":  # else the plan would be recorded but change nothing
            raise ValueError(f"norm_plan={self.norm_plan!r} is the fused GroupNorm kernels' plan, but "
                             f"norm_impl={self.norm_impl!r} runs no such kernels; set norm_impl=fused or norm_plan=''")
        if self.image_size % 2 ** (len(self.channel_mult) - 1):
            raise ValueError(
                f"image_size={self.image_size} must be divisible by 2**(len(channel_mult)-1)="
                f"{2 ** (len(self.channel_mult) - 1)}; use fewer levels or another size"
            )
        if self.num_classes < 0:
            raise ValueError(f"num_classes={self.num_classes}: use 0 (unconditional) or the number of classes")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.attn_heads < 1:
            raise ValueError(f"attn_heads={self.attn_heads} must be >= 1")
        chans = sorted({self.base_channels} | {self.base_channels * m for m in self.channel_mult})
        if self.attn_head_dim is None and any(c % self.attn_heads for c in chans):
            raise ValueError(
                f"attn_heads={self.attn_heads} must divide every level's channels {chans} "
                "(or set attn_head_dim)"
            )
        for name in ("norm_groups", "conv_groups"):
            g = getattr(self, name)
            if g < 1 or any(c % g for c in chans):
                raise ValueError(f"{name}={g} must be >= 1 and divide every level's channels {chans}")
        if not isinstance(self.depthwise_separable, bool):
            raise ValueError(f"depthwise_separable={self.depthwise_separable!r} must be True or False")
        if self.depthwise_separable and self.conv_groups != 1:
            raise ValueError(f"depthwise_separable=True with conv_groups={self.conv_groups}: the depthwise part is "
                             "already grouped per channel; set conv_groups=1")
        if self.upsample not in UPSAMPLES:
            raise ValueError(f"upsample={self.upsample!r}: use one of {', '.join(map(repr, UPSAMPLES))}")
        if self.concat_free and self.arch != "ddpm":
            raise ValueError("concat_free=True is built for arch='ddpm' (the annotated block convolves the raw "
                             "concatenation first); set concat_free=False")
        if self.conv_bias_in_norm and (self.arch != "ddpm" or self.weight_standardize or self.depthwise_separable):
            raise ValueError("conv_bias_in_norm=True is built for arch='ddpm' res blocks with plain 3x3 convs "
                             "(weight_standardize=False, depthwise_separable=False); set conv_bias_in_norm=False")
        if self.norm_residual and (self.arch != "ddpm" or self.weight_standardize or self.depthwise_separable):
            raise ValueError("norm_residual=True is built for arch='ddpm' res blocks with plain 3x3 convs "
                             "(weight_standardize=False, depthwise_separable=False); set norm_residual=False")
        on = [name for name in FUSED_SWITCHES if getattr(self, name)]
        if on and self.norm_impl != "fused":  # all named at once: the preset has several on
            raise ValueError(f"the fused GroupNorm kernels' switches {', '.join(on)} are on, but "
                             f"norm_impl={self.norm_impl!r} runs no fused kernels: turn them off with it ("
                             + " ".join(f"model.{name}=False" for name in on) + ") or set norm_impl=fused")
        if self.norm_dbias and not self.norm_residual:
            raise ValueError("norm_dbias=True sums a residual sum's bias gradient in the GroupNorm that reads the sum: "
                             "it needs norm_residual=True; set norm_dbias=False")
        if self.fused_parts and not self.concat_free:
            raise ValueError("fused_parts=True is the fused GroupNorm's read of the up path's (h, skip) parts: it "
                             "needs concat_free=True; set fused_parts=False")
        if self.conv_parts and not self.fused_parts:
            raise ValueError("conv_parts=True convolves the two parts the fused GroupNorm reads with fused_parts: it "
                             "needs fused_parts=True (and concat_free=True); set conv_parts=False")
        if self.attn_split_grads and not self.attn_linear:
            raise ValueError("attn_split_grads=True is the backward of attention's qkv matmul (attn_linear): set "
                             "attn_linear=True or attn_split_grads=False")
        if self.conv_cutlass and (self.arch != "ddpm" or self.weight_standardize or self.depthwise_separable
                                  or self.conv_groups != 1):
            raise ValueError("conv_cutlass=True is built for arch='ddpm' res blocks with plain dense 3x3 convs "
                             "(weight_standardize=False, depthwise_separable=False, conv_groups=1); set "
                             "conv_cutlass=False")
        if self.conv_cutlass_dgrad and not self.conv_cutlass:
            raise ValueError("conv_cutlass_dgrad=True is the backward of the convolutions conv_cutlass runs: set "
                             "conv_cutlass=True or conv_cutlass_dgrad=False")
        if self.conv_cutlass_skip_slot and not self.conv_cutlass:
            raise ValueError("conv_cutlass_skip_slot=True routes the skip GEMM of conv_cutlass's up blocks: set "
                             "conv_cutlass=True or conv_cutlass_skip_slot=False")
        if self.conv_parts and (self.weight_standardize or self.depthwise_separable or self.conv_groups != 1):
            raise ValueError("conv_parts=True is built for res blocks with plain dense 3x3 convs "
                             "(weight_standardize=False, depthwise_separable=False, conv_groups=1); set "
                             "conv_parts=False")
        if self.pad_image_channels and self.pad_image_channels < self.in_channels:
            raise ValueError(f"pad_image_channels={self.pad_image_channels} is below in_channels={self.in_channels}; "
                             "use 0 (no padding) or at least in_channels")


ATTN_IMPLS = ("sdpa", "math", "math-qkv")
UPSAMPLES = ("nearest", "expand", "transposed")
# ModelConfig's switches of the fused GroupNorm kernels (ffcv_ddpm.gn_kernels): each needs norm_impl='fused'. A run
# of ddpm-cifar10 with another GroupNorm turns off those the preset has on; FUSED_OFF turns off all of them.
FUSED_SWITCHES = ("fused_parts", "conv_parts", "norm_saved_means", "norm_mask_bits", "norm_residual",
                  "norm_fast_silu", "norm_pair_hash", "norm_x_sums", "norm_dbias", "conv_cutlass", "conv_cutlass_dgrad",
                  "conv_cutlass_skip_slot")
FUSED_OFF = tuple(f"model.{name}=False" for name in FUSED_SWITCHES)

# The computation switches' reference values: the network as the paper wrote it. benchmarks/speed/flops.py counts the
# FLOPs of this network, so a switch that does extra work (zero padding) or less (the folded upsample) does not
# change the model FLOPs that MFU divides by.
REFERENCE_COMPUTATION = {"concat_free": False, "upsample": "nearest", "pad_image_channels": 0, "attn_linear": False,
                         "conv_bias_in_norm": False}


def reference_config(cfg: ModelConfig) -> ModelConfig:
    """The same network with every computation switch at its reference value (fused_parts reads concat_free's parts:
    it goes off with concat_free, else the reference network would be refused, and conv_parts with it; norm_residual's
    blocks return their sums uncomputed, which torchinfo's count of the published table cannot follow; norm_dbias
    needs norm_residual: it goes off with it, else a norm_dbias row's FLOP count is refused, as on an H200 at
    0930219); conv_cutlass's blocks return their convolutions uncomputed too; attn_split_grads goes with
    attn_linear, and math-qkv, math's arithmetic over the qkv matmul, with it to math)."""
    return replace(cfg, **REFERENCE_COMPUTATION, attn_impl="math" if cfg.attn_impl == "math-qkv" else cfg.attn_impl,
                   fused_parts=False, conv_parts=False, norm_residual=False,
                   norm_dbias=False, conv_cutlass=False, conv_cutlass_dgrad=False, conv_cutlass_skip_slot=False,
                   attn_split_grads=False)


PRESETS: dict[str, ModelConfig] = {
    # The paper's network computed the fastest exact way measured (benchmarks/results/h100/mfu-levers: 137.9 ->
    # 126.2 ms per step of 1024 on an H100); REFERENCE_COMPUTATION gives the paper's own computation back. The fused
    # GroupNorm kernels with CUDA graphs (train.compile_mode) and cuDNN's search: 9,029 img/s against scale-shift's
    # 8,598 with the same two, one H100, one call (benchmarks/results/h100/defaults-26cefa3); bf16 vs fp32 within
    # tolerance at 2,000 steps (numerics-fused-2000). On CPU tensors the op runs plain torch (ffcv_ddpm.norm). Then
    # conv1's bias in norm2's add and the kernels' (2048, 65536, 4) plan: 10,524-10,557 img/s against 9,846-9,864,
    # one H200, same GPU and calls (benchmarks/results/h200/norm-plan-step-8d99035). Then the plan's reductions
    # pipelined (STAGES 4, norm.DEFAULT_PLAN) with fused_parts: 9,931-9,933 img/s against 9,633 on an H100 and
    # 10,823-10,907 against 10,672-10,742 on an H200 (benchmarks/results/h100/step-5f421de, h200/step-5f421de);
    # bf16 vs fp32 at 2,000 steps within the noise floor (h200/numerics-5f421de). Then SiLU through tanh.approx
    # (norm_fast_silu): 92.32-92.45 ms a step of 1024 against 94.37-94.91, one H200, one process
    # (benchmarks/results/h200/fast-silu-9212ba3); bf16 with it against exact fp32 passes NOTES 27's six-draw rule
    # (h200/numerics-fast-silu-9212ba3: median 6.74% against a bound of 9.51%). Then one dropout hash for two
    # channels with each residual sum left to the next GroupNorm (norm_pair_hash, norm_residual): 91.4-91.6 ms
    # against 92.8-93.0 (h200/pair-hash-d2254d0), bf16 with both against fp32 with neither passes the rule
    # (h200/numerics-pair-residual-d2254d0: 6.99% against 10.05%); and the backward's sums over x (norm_x_sums, exact
    # to fp32 rounding): the reduction and dx kernels 5-7% faster at the 32x32 dropout site, the step -0.1 to -0.3 ms
    # on top (h200/x-sums-17a6ad0). A norm_impl other than fused needs FUSED_OFF with it (ModelConfig.validate says
    # so), concat_free=False model.fused_parts=False.
    "ddpm-cifar10": ModelConfig(concat_free=True, upsample="transposed", pad_image_channels=8, attn_linear=True,
                                conv_bias_in_norm=True, norm_impl="fused", fused_parts=True, norm_fast_silu=True,
                                norm_residual=True, norm_pair_hash=True, norm_x_sums=True),
    "annotated-small": ModelConfig(
        arch="annotated",
        base_channels=32,
        channel_mult=(1, 2, 4, 8),
        attn_resolutions=(32, 16, 8, 4),
        attn_heads=4,
        attn_head_dim=32,
        dropout=0.0,
        norm_groups=8,
        weight_standardize=True,
        stem_kernel=1,
    ),
    "digits": ModelConfig(base_channels=64, channel_mult=(1, 2, 2), num_classes=10),
    "tiny": ModelConfig(
        base_channels=8, channel_mult=(1, 2), num_res_blocks=1, norm_groups=4, dropout=0.0, attn_heads=2
    ),
}


# ---------------------------------------------------------------------------------------------------- layers


def null_labels(t: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The "no label" index (num_classes) for every sample of t: what a class-conditional model reads for y=None."""
    return torch.full_like(t, num_classes, dtype=torch.long)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding (B,) -> (B, dim) of integer or real t: [sin(t f_k), cos(t f_k)], f_k = 10000^(-k/(dim/2-1))."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    args = t.float()[:, None] * freqs[None, :]  # (B, half)
    emb = torch.cat([torch.sin(args), torch.cos(args)], dim=1)  # (B, 2*half)
    return F.pad(emb, (0, dim % 2))  # (B, dim)


class WSConv2d(nn.Conv2d):
    """Conv2d with weight standardization (Qiao et al. 2019): each output filter has zero mean, unit variance."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The looser eps at low precision is the Annotated Diffusion choice; dtype is static, so this compiles away.
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        var, mean = torch.var_mean(self.weight, dim=(1, 2, 3), keepdim=True, correction=0)
        w = (self.weight - mean) * torch.rsqrt(var + eps)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ImageConv2d(nn.Conv2d):
    """A conv on the image side of the network: the stem (`side="in"`, reads the image's channels) or the output conv
    (`side="out"`, writes them). With `pad_to` > 0 it runs with those image channels zero-padded to `pad_to` (zero
    weights, the parameters keep their shapes): the same function, but cuDNN gets 16-byte channel rows at bf16
    instead of 3 channels, for which it picks sm80 kernels (the output conv's data gradient ran at 2.6 TFLOP/s:
    2.7 ms per step of 1024 on an H200, benchmarks/NOTES.md item 9)."""

    def __init__(self, cin: int, cout: int, kernel: int, side: str, pad_to: int = 0):
        super().__init__(cin, cout, kernel, padding=kernel // 2)
        self.side = side  # "in": the input channels are the image's; "out": the output channels are
        self.pad_to = pad_to  # image channels as computed; 0 = unpadded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pad_to:
            return super().forward(x)
        if self.side == "in":
            extra = self.pad_to - self.in_channels
            x = F.pad(x, (0, 0, 0, 0, 0, extra))  # (B, C, H, W) -> (B, pad_to, H, W), zeros appended
            return F.conv2d(x, F.pad(self.weight, (0, 0, 0, 0, 0, extra)), self.bias, padding=self.padding)
        extra = self.pad_to - self.out_channels
        w = F.pad(self.weight, (0, 0, 0, 0, 0, 0, 0, extra))  # (cout, cin, k, k) -> (pad_to, cin, k, k)
        y = F.conv2d(x, w, F.pad(self.bias, (0, extra)), padding=self.padding)[:, :self.out_channels]
        # The slice is not dense; return what the unpadded conv returns: a dense tensor in the input's layout.
        return y.contiguous(memory_format=torch.channels_last if channels_last(x) else torch.contiguous_format)


def channels_last(x: torch.Tensor) -> bool:
    """Whether a 4-D tensor is laid out NHWC (channels unit-stride); static under torch.compile."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def conv_over_parts(conv: nn.Conv2d, parts: tuple[torch.Tensor, ...], bias: bool = True) -> torch.Tensor:
    """conv(torch.cat(parts, 1)) as a sum of convolutions over the parts with slices of its weight (without conv's
    bias: bias=False): no concatenated input, whose gradient's channel slices cuDNN's backward would copy into dense
    tensors."""
    out = None
    for y in convs_over_parts(conv, parts, bias):
        out = y if out is None else out + y
    return out


def convs_over_parts(conv: nn.Conv2d, parts: tuple[torch.Tensor, ...], bias: bool) -> list[torch.Tensor]:
    """conv_over_parts' terms: each part convolved with its slice of conv's weight (the first with conv's bias)."""
    out, c0 = [], 0
    for part in parts:
        c1 = c0 + part.shape[1]
        out.append(F.conv2d(part, conv.weight[:, c0:c1], conv.bias if bias and not out else None, conv.stride,
                            conv.padding, conv.dilation, conv.groups))
        c0 = c1
    return out


def skip_over_parts(conv: nn.Conv2d, parts: tuple[torch.Tensor, ...], slot: torch.Tensor | None = None,
                    first: bool = False) -> torch.Tensor:
    """A 1x1 conv (without its bias) over the channel concatenation of two parts as one tensor: the first part's GEMM
    on its NHWC view, the second's accumulated onto it (mm_acc: C read by the GEMM, no add of its own), in the first
    part's NHWC order. model.conv_cutlass: one residual, which the CUTLASS epilogue adds, where two
    (convs_over_parts) were added by the statistics kernel. slot: the fused GroupNorm's that read the same parts
    (GroupNormAct's skip): the second part's gradient of this GEMM then goes to that op's backward, and the first's
    too with `first` (mm_acc)."""
    if len(parts) != 2:
        raise ValueError(f"skip_over_parts takes the up path's two parts (h, skip), not {len(parts)}")
    n, _, h, w = parts[0].shape
    c0 = parts[0].shape[1]
    # The activations' dtype for the weight (under autocast, what autocast would cast mm's inputs to: it does not
    # cast a custom op's). Not asked of autocast itself: torch.amp.is_autocast_available breaks dynamo's graph
    # (d322256: a graph break a block, the recompile limit hit, the step 148 ms; NOTES 51).
    dtype = parts[0].dtype
    weight = conv.weight.flatten(1).to(dtype)  # [Cout, Cin]
    a, a2 = (p.permute(0, 2, 3, 1).reshape(n * h * w, p.shape[1]).to(dtype) for p in parts)  # views if channels_last
    out = mm_acc(a, weight[:, :c0].t(), a2, weight[:, c0:].t(), slot, first)
    return out.view(n, h, w, -1).permute(0, 3, 1, 2)


@torch.library.custom_op("ffcv_ddpm::mm_acc", mutates_args=())
def mm_acc(a: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor, slot: torch.Tensor | None = None,
           first: bool = False) -> torch.Tensor:
    """a @ b + a2 @ b2, the second GEMM accumulating onto the first's output in place (cuBLAS reads it as C, beta 1).
    An op of its own because the compiled step's torch.addmm(a @ b, a2, b2) copies its C into a new output first:
    12 copies of an activation a step, 0.64 ms on an H200 (results/h200/dgrad-sums-d61c088/prof, NOTES 51).
    slot (a fused GroupNorm's, over the same a and a2: norm.group_norm_act's skip_w; model.conv_cutlass_skip_slot):
    never read; the backward gives it the output's gradient, from which that op's backward adds a2's gradient into
    its dx2, and a's into its dx with `first` (NOTES 52); those inputs then get none from here."""
    return torch.mm(a, b).addmm_(a2, b2)


@mm_acc.register_fake
def _(a, b, a2, b2, slot=None, first=False):
    return a.new_empty(a.shape[0], b.shape[1])


def _mm_acc_setup(ctx, inputs, output):
    a, b, a2, b2, slot, first = inputs
    ctx.slot, ctx.first = slot is not None, slot is not None and first
    ctx.save_for_backward(a, a2, None if ctx.first else b, None if ctx.slot else b2)


def _mm_acc_backward(ctx, grad):
    a, a2, b, b2 = ctx.saved_tensors
    need = ctx.needs_input_grad
    db, db2 = (a.t() @ grad if need[1] else None), (a2.t() @ grad if need[3] else None)
    da = grad @ b.t() if need[0] and not ctx.first else None  # (else in the GroupNorm's backward, from the slot's)
    da2 = grad @ b2.t() if need[2] and not ctx.slot else None
    return da, db, da2, db2, grad if ctx.slot else None, None


mm_acc.register_autograd(_mm_acc_backward, setup_context=_mm_acc_setup)


@register_flop_formula(torch.ops.ffcv_ddpm.mm_acc)
def _mm_acc_flops(a_shape, b_shape, a2_shape, b2_shape, *args, out_shape=None, **kwargs) -> int:
    """Two GEMMs' multiply-adds, as aten.mm's formula counts them: 2 M K N each."""
    return 2 * a_shape[0] * b_shape[1] * (a_shape[1] + a2_shape[1])


def nearest_2x(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="nearest") as a broadcast copy in the input's memory order, so that its
    gradient is a plain sum over each 2x2 block (inductor lowers interpolate's backward as an index_put with
    accumulation: 3.5 ms per step of 1024 on an H200, benchmarks/NOTES.md item 9)."""
    B, C, H, W = x.shape
    if channels_last(x):
        y = x.permute(0, 2, 3, 1)[:, :, None, :, None, :].expand(B, H, 2, W, 2, C)  # (B, H, 2, W, 2, C), a view
        return y.reshape(B, 2 * H, 2 * W, C).permute(0, 3, 1, 2)  # (B, C, 2H, 2W), channels_last
    y = x[:, :, :, None, :, None].expand(B, C, H, 2, W, 2)  # (B, C, H, 2, W, 2), a view
    return y.reshape(B, C, 2 * H, 2 * W)


def fold_nearest_2x(weight: torch.Tensor) -> torch.Tensor:
    """The 3x3 conv weight (cout, cin, 3, 3) of "nearest 2x upsample, then conv (padding 1)" as the weight
    (cin, cout, 4, 4) of one transposed conv (stride 2, padding 1) on the low-resolution input.

    Output row 2m reads upsampled rows 2m-1, 2m, 2m+1 = input rows m-1, m, m: taps w0 on row m-1 and w1 + w2 on
    row m; output row 2m+1 reads input rows m, m, m+1: w0 + w1 on row m, w2 on row m+1. A transposed conv with
    stride 2 and padding 1 takes tap k of input row i into output row 2i - 1 + k, so its taps are
    (w2, w1 + w2, w0 + w1, w0); the same along columns. 16 taps per output pixel instead of 36 per 2x2 block:
    the convolution does 4/9 of the work. Zero padding at the border agrees (input row -1 is upsampled row -1)."""
    def fold(w: torch.Tensor, dim: int) -> torch.Tensor:
        a, b, c = w.unbind(dim)
        return torch.stack([c, b + c, a + b, a], dim)

    return fold(fold(weight, 2), 3).transpose(0, 1)  # (cout, cin, 4, 4) -> (cin, cout, 4, 4)


# train.sdpa_backend's names of SDPA's kernels (ffcv_ddpm.step.set_sdpa_backend); "auto" pins none.
SDPA_KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str,
              kernel: SDPBackend | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v on (B, heads, N, d) tensors, by SDPA (its kernel pinned if given) or by the explicit
    matmul-softmax reference."""
    if impl == "sdpa" and kernel is not None:
        # In the traced graph, not only in torch.backends.cuda's flags: a compiled step's saved artifacts are keyed on
        # the graph, so with the flags alone a later compile reused a cached graph of another kernel (NOTES item 39).
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v)
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (B, heads, N, N)
    return scores.softmax(dim=-1) @ v  # (B, heads, N, d)


class QKVProjection(torch.autograd.Function):
    """q, k, v = the NHWC activation h's matmul with the qkv weight (one GEMM), split as SelfAttention splits it
    (views of the GEMM's output), with a backward that takes their three gradients where SDPA wrote them: each
    third of the weight's gradient a GEMM of its own, dh one GEMM and two addmm onto it (cuBLAS reads the C it adds),
    so that no stacked (B, HW, 3, heads, d) gradient is copied together first (model.attn_split_grads)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int):
        B, H, W, _ = h.shape
        qkv = F.linear(h, weight, bias).reshape(B, H * W, 3, heads, -1)
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, HW, d)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        h, weight = ctx.saved_tensors
        flat = h.reshape(-1, h.shape[-1])  # (B*HW, C): a view of an NHWC h
        inner = weight.shape[0] // 3
        dh, dw, db = None, [], []
        for i, g in enumerate(grads):
            g = g.transpose(1, 2).reshape(flat.shape[0], inner)  # (B, HW, heads, d): a view if SDPA wrote it so
            w = weight[i * inner:(i + 1) * inner]
            dw.append(g.t() @ flat)
            db.append(g.sum(0))
            dh = g @ w if dh is None else torch.addmm(dh, g, w)
        return dh.view(h.shape), torch.cat(dw), torch.cat(db) if ctx.has_bias else None, None


class SelfAttention(nn.Module):
    """Pre-norm multi-head self-attention over all H*W positions, with a residual connection.

    The fused qkv output is split in channels_last order, (B, H, W, 3*heads*d) -> (B, HW, 3, heads, d), so q, k, v
    and their gradients are views of the conv's storage. Splitting in NCHW order instead ((B, 3, heads, d, HW),
    then a transpose) made the backward do a stack plus a transposing copy of the whole qkv gradient: 7.29 vs
    6.21 ms compiled for one fwd+bwd of a 32x32x32 block at batch 512 in bf16 on an H200 (torch 2.11).
    """

    def __init__(self, channels: int, heads: int, head_dim: int | None, norm_groups: int, qkv_bias: bool, impl: str,
                 norm_impl: str = "scale-shift", linear: bool = False, norm_plan: tuple[int, ...] | None = None,
                 pending: bool = False, dbias: bool = False, split_grads: bool = False):
        super().__init__()
        self.heads = heads  # number of heads
        self.head_dim = head_dim or channels // heads  # channels per head
        self.impl = impl  # "sdpa", "math" or "math-qkv"
        self.sdpa_kernel: SDPBackend | None = None  # SDPA's one kernel (pin_sdpa_kernel); None: torch's choice
        # The 1x1 convs as matmuls on the NHWC view: inductor hands a conv to cuDNN without its bias and adds the bias
        # in a kernel of its own, which nothing fuses when SDPA consumes the output; cuBLAS adds it in its epilogue.
        self.linear = linear
        self.split_grads = split_grads  # with linear: QKVProjection's backward (model.attn_split_grads)
        self.pending = pending  # the output x + projection left as a Pending sum (model.norm_residual)
        inner = self.heads * self.head_dim
        self.norm = GroupNormAct(norm_groups, channels, norm_impl, silu=False, plan=norm_plan, dbias=dbias)
        self.qkv = nn.Conv2d(channels, 3 * inner, 1, bias=qkv_bias)
        self.proj = nn.Conv2d(inner, channels, 1)

    def forward(self, x: torch.Tensor | Pending) -> torch.Tensor | Pending:
        h = self.norm(x)  # computes a Pending input
        x = resolved(x)
        B, C, H, W = x.shape
        if self.linear and self.split_grads:
            q, k, v = QKVProjection.apply(h.permute(0, 2, 3, 1), self.qkv.weight.flatten(1), self.qkv.bias,
                                          self.heads)
        else:
            if self.linear:  # (B, H, W, C) @ (C, 3*heads*d): a view and one GEMM if channels_last
                qkv = F.linear(h.permute(0, 2, 3, 1), self.qkv.weight.flatten(1), self.qkv.bias)
            else:
                qkv = self.qkv(h).permute(0, 2, 3, 1)  # (B, 3*heads*d, H, W) -> (B, H, W, 3*heads*d)
            if self.impl != "math-qkv":
                qkv = qkv.reshape(B, H * W, 3, self.heads, self.head_dim)  # (B, HW, 3, heads, d): a view if NHWC
                q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, heads, HW, d), d unit-stride
        if self.impl == "math-qkv":  # one head over the qkv GEMM's output as one (B, HW, 3C) tensor, its gradient too
            o = math_attention(qkv.reshape(B, H * W, -1))  # (B, HW, C)
        else:
            o = attention(q, k, v, self.impl, self.sdpa_kernel).transpose(1, 2)  # (B, HW, heads, d)
        o = o.reshape(B, H, W, self.heads * self.head_dim)
        if self.linear:
            y = F.linear(o, self.proj.weight.flatten(1), self.proj.bias).permute(0, 3, 1, 2)
            return Pending(y, x) if self.pending else x + y
        o = o.permute(0, 3, 1, 2)  # (B, heads*d, H, W), channels_last
        if self.pending:
            return Pending(F.conv2d(o, self.proj.weight), x, bias=self.proj.bias)
        return x + self.proj(o)


def pin_sdpa_kernel(model: nn.Module, backend: str) -> None:
    """train.sdpa_backend: every attention of the model runs SDPA's kernel of that name ("auto": torch's choice)."""
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.sdpa_kernel = SDPA_KERNELS.get(backend)


class TimeEmbedding(nn.Module):
    """t (and optionally a label) -> the per-sample vector every residual block is conditioned on."""

    def __init__(self, base: int, dim: int, act: type[nn.Module], num_classes: int):
        super().__init__()
        self.base = base  # width of the sinusoidal features
        self.num_classes = num_classes  # the null label index; 0 = no label embedding
        self.mlp = nn.Sequential(nn.Linear(base, dim), act(), nn.Linear(dim, dim))
        # One extra row, index num_classes, is the "no label" embedding for classifier-free guidance.
        self.label = nn.Embedding(num_classes + 1, dim) if num_classes else None

    def forward(self, t: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        # In the weights' dtype: a model cast to fp64 (the exactness tests) or bf16 runs; autocast casts anyway.
        emb = self.mlp(timestep_embedding(t, self.base).to(self.mlp[0].weight.dtype))  # (B, dim)
        if self.label is not None:
            y = null_labels(t, self.num_classes) if y is None else y
            emb = emb + self.label(y)
        return emb


# ---------------------------------------------------------------------------------------------------- blocks


class SeparableConv2d(nn.Sequential):
    """A 3x3 conv factored as depthwise 3x3 (one filter per input channel, no bias: the pointwise bias absorbs it)
    then pointwise 1x1: 9 cin + cin cout + cout parameters instead of 9 cin cout + cout."""

    def __init__(self, conv: type[nn.Conv2d], cin: int, cout: int):
        super().__init__()
        self.depthwise = conv(cin, cin, 3, padding=1, groups=cin, bias=False)
        self.pointwise = conv(cin, cout, 1)


def res_conv3x3(cfg: ModelConfig, cin: int, cout: int) -> nn.Module:
    """The residual blocks' 3x3 conv: dense, grouped or depthwise-separable, plain or weight-standardized."""
    conv = WSConv2d if cfg.weight_standardize else nn.Conv2d
    if cfg.depthwise_separable:
        return SeparableConv2d(conv, cin, cout)
    return conv(cin, cout, 3, padding=1, groups=cfg.conv_groups)


class DDPMResBlock(nn.Module):
    """Ho et al.: GN-SiLU-conv, + projected time embedding, GN-SiLU-dropout-conv, 1x1 shortcut on width change."""

    def __init__(self, cfg: ModelConfig, cin: int, cout: int, temb_dim: int, uneven_parts: bool = False):
        super().__init__()
        # uneven_parts: an up block whose (h, skip) differ in width, where model.conv_parts splits conv1
        self.norm1 = GroupNormAct(cfg.norm_groups, cin, cfg.norm_impl, parts=cfg.fused_parts,  # GroupNorm + SiLU
                                  split_out=cfg.conv_parts and uneven_parts, **cfg.act_norm())
        self.conv1 = res_conv3x3(cfg, cin, cout)
        self.temb = nn.Linear(temb_dim, cout)
        self.norm2 = GroupNormAct(cfg.norm_groups, cout, cfg.norm_impl, dropout=cfg.dropout,  # + SiLU + dropout
                                  **cfg.act_norm(), **cfg.norm_switches())
        self.conv2 = res_conv3x3(cfg, cout, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        self.bias_in_norm = cfg.conv_bias_in_norm  # conv1's bias added with the time embedding, inside norm2
        self.pending = cfg.norm_residual  # the output left as a Pending sum for the next fused GroupNorm
        self.conv_cutlass = cfg.conv_cutlass  # the convs left to the fused GroupNorm after them (Pending.conv)
        self.cutlass_dgrad = cfg.conv_cutlass_dgrad  # ... and their dx by CUTLASS's dgrad
        self.skip_slot = cfg.conv_cutlass_skip_slot  # ... and the up path's skip gradients through norm1's slot

    def forward(self, x: torch.Tensor | Pending | tuple[torch.Tensor | Pending, ...],
                temb: torch.Tensor) -> torch.Tensor | Pending:
        """`x`: the input, or the parts of a channel concatenation (model.concat_free: (h, skip) on the up path); a
        Pending sum (model.norm_residual) as the input or its first part is computed by norm1."""
        slot, first = None, False  # model.conv_cutlass_skip_slot on the up path: norm1's, for skip_over_parts
        if self.skip_slot and self.pending and not isinstance(x, (torch.Tensor, Pending)) \
                and not isinstance(self.skip, nn.Identity):
            first = not residual_first(x[0])  # the first part's gradient through the slot too (else ds: NOTES 52)
            h, slot = self.norm1(x, skip=self.skip.weight)
        else:
            h = self.norm1(x)  # the normalised concatenation; with model.conv_parts and two parts, its two parts
        x = resolved(x)  # the input's value, computed by norm1 where it was a Pending sum
        add = self.temb(F.silu(temb))  # the (B, cout) time embedding, added to conv1's output before norm2
        c = self.conv1
        parts = isinstance(h, tuple)  # conv1 as two convolutions, over the parts with its weight's slices
        if c._forward_pre_hooks:  # a pre-hook (torch's pruning) makes the weight: call c, on one tensor
            h = c(torch.cat(h, 1) if parts else h)
        elif self.bias_in_norm or self.conv_cutlass:
            # conv1's output is read only by norm2, which adds a per-(sample, channel) vector anyway: the bias goes
            # there. Inductor cannot fuse a bias add into the fused GroupNorm op, so it would cost a pass of its own.
            if self.conv_cutlass and not parts:  # conv1 itself left to norm2 (model.conv_cutlass)
                h = Pending(None, conv=(h, c.weight), cutlass_dgrad=self.cutlass_dgrad)
            else:
                h = (conv_over_parts(c, h, bias=False) if parts
                     else F.conv2d(h, c.weight, None, c.stride, c.padding, c.dilation, c.groups))
            add = add + c.bias
        else:
            h = conv_over_parts(c, h) if parts else c(h)
        h = self.norm2(h, add=add)
        if self.pending and not self.conv2._forward_pre_hooks:  # (a pre-hook makes the weight: call the module)
            # The biases ride in the sum, which the next fused GroupNorm computes.
            c2, bias = self.conv2, self.conv2.bias
            conv = (h, c2.weight) if self.conv_cutlass else None  # the conv too, with model.conv_cutlass
            h = None if conv else F.conv2d(h, c2.weight, None, c2.stride, c2.padding, c2.dilation, c2.groups)
            if isinstance(self.skip, nn.Identity):
                return Pending(h, x if isinstance(x, torch.Tensor) else torch.cat(x, 1), bias=bias, conv=conv,
                               cutlass_dgrad=self.cutlass_dgrad)
            if conv and not isinstance(x, torch.Tensor):  # the up path's two parts: one residual (skip_over_parts)
                res = (skip_over_parts(self.skip, x, slot, first),)
            else:
                res = convs_over_parts(self.skip, (x,) if isinstance(x, torch.Tensor) else x, bias=False)
            return Pending(h, *res, bias=bias + self.skip.bias, conv=conv, cutlass_dgrad=self.cutlass_dgrad)
        h = self.conv2(h)
        if isinstance(x, torch.Tensor):
            return self.skip(x) + h
        if isinstance(self.skip, nn.Identity):
            return torch.cat(x, 1) + h
        return conv_over_parts(self.skip, x) + h


class AnnotatedResBlock(nn.Module):
    """Annotated Diffusion: conv-GN-FiLM(t)-SiLU, conv-GN-SiLU, 1x1 shortcut on width change."""

    def __init__(self, cfg: ModelConfig, cin: int, cout: int, temb_dim: int):
        super().__init__()
        self.temb = nn.Sequential(nn.SiLU(), nn.Linear(temb_dim, 2 * cout))
        self.conv1 = res_conv3x3(cfg, cin, cout)
        # GroupNorm, FiLM, SiLU, then a dropout before conv2 (not in the original; off at the preset's dropout=0)
        self.norm1 = GroupNormAct(cfg.norm_groups, cout, cfg.norm_impl, dropout=cfg.dropout,
                                  **cfg.act_norm(), **cfg.norm_switches())
        self.conv2 = res_conv3x3(cfg, cout, cout)
        self.norm2 = GroupNormAct(cfg.norm_groups, cout, cfg.norm_impl, **cfg.act_norm())  # GroupNorm + SiLU
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.temb(temb).chunk(2, dim=1)  # 2 x (B, cout)
        h = self.norm1(self.conv1(x), film=(scale, shift))
        h = self.norm2(self.conv2(h))
        return self.skip(x) + h


class Downsample(nn.Module):
    """Halves H and W: a stride-2 3x3 conv ("ddpm") or pixel-unshuffle then 1x1 conv ("annotated")."""

    def __init__(self, cin: int, cout: int, unshuffle: bool):
        super().__init__()
        self.unshuffle = unshuffle  # True: space-to-depth (B,C,H,W) -> (B,4C,H/2,W/2), then a 1x1 conv
        self.conv = nn.Conv2d(4 * cin, cout, 1) if unshuffle else nn.Conv2d(cin, cout, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pixel_unshuffle(x, 2) if self.unshuffle else x)  # unshuffle: (B, 4C, H/2, W/2)


class Upsample(nn.Module):
    """Doubles H and W: nearest-neighbour then 3x3 conv, computed as `impl` says (model.upsample): "nearest"
    (F.interpolate), "expand" (nearest_2x) or "transposed" (one transposed conv, fold_nearest_2x)."""

    def __init__(self, cin: int, cout: int, impl: str = "nearest"):
        super().__init__()
        self.impl = impl  # one of UPSAMPLES
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "transposed":
            return F.conv_transpose2d(x, fold_nearest_2x(self.conv.weight), self.conv.bias, stride=2, padding=1)
        return self.conv(nearest_2x(x) if self.impl == "expand" else F.interpolate(x, scale_factor=2.0, mode="nearest"))


# ---------------------------------------------------------------------------------------------------- networks


class DDPMUNet(nn.Module):
    """Ho et al. 2020's UNet. Down: per level num_res_blocks blocks (+attention), then downsample; every output is a
    skip. Middle: block, attention, block. Up: per level num_res_blocks+1 blocks, each eating one skip, then upsample."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        ch = cfg.base_channels
        temb_dim = 4 * ch
        self.num_classes = cfg.num_classes  # index of the null label (when > 0)
        self.concat_free = cfg.concat_free  # up-path blocks take (h, skip) unconcatenated
        self.time = TimeEmbedding(ch, temb_dim, nn.SiLU, cfg.num_classes)
        self.stem = ImageConv2d(cfg.in_channels, ch, cfg.stem_kernel, "in", cfg.pad_image_channels)
        block = lambda cin, cout, uneven=False: DDPMResBlock(cfg, cin, cout, temb_dim, uneven)  # noqa: E731
        attn = lambda c: SelfAttention(c, cfg.attn_heads, cfg.attn_head_dim, cfg.norm_groups, True,  # noqa: E731
                                       cfg.attn_impl, cfg.norm_impl, cfg.attn_linear, cfg.fused_norm_plan(),
                                       cfg.norm_residual, cfg.norm_dbias, cfg.attn_split_grads)

        # Down path: `down` is a flat list run in order; every module's output is pushed as a skip.
        self.down = nn.ModuleList()
        skips, cur, res = [ch], ch, cfg.image_size
        for level, mult in enumerate(cfg.channel_mult):
            for _ in range(cfg.num_res_blocks):
                self.down.append(Stage(block(cur, ch * mult), attn(ch * mult) if res in cfg.attn_resolutions else None))
                cur = ch * mult
                skips.append(cur)
            if level != len(cfg.channel_mult) - 1:
                self.down.append(Downsample(cur, cur, unshuffle=False))
                res //= 2
                skips.append(cur)

        self.mid = Stage(block(cur, cur), attn(cur), block(cur, cur))

        # Up path: each Stage concatenates one skip first; Upsample modules take no skip.
        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(cfg.channel_mult))):
            for _ in range(cfg.num_res_blocks + 1):
                skip = skips.pop()
                self.up.append(Stage(block(cur + skip, ch * mult, cur != skip),
                                     attn(ch * mult) if res in cfg.attn_resolutions else None))
                cur = ch * mult
            if level != 0:
                self.up.append(Upsample(cur, cur, cfg.upsample))
                res *= 2
        # GroupNorm + SiLU, conv; the Identity keeps the conv's state_dict key (out.2) from when SiLU was a module.
        self.out = nn.Sequential(GroupNormAct(cfg.norm_groups, cur, cfg.norm_impl, **cfg.act_norm()),
                                 nn.Identity(), ImageConv2d(cur, cfg.in_channels, 3, "out", cfg.pad_image_channels))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        temb = self.time(t, y)
        h = self.stem(x)
        hs = [h]
        # With model.norm_residual a Stage returns a Pending sum: the next Stage's first GroupNorm computes it, any
        # other module gets its value (resolved); the skips are resolved when the up path takes them, computed by then.
        for m in self.down:
            h = m(h, temb) if isinstance(m, Stage) else m(resolved(h))
            hs.append(h)
        h = self.mid(h, temb)
        for m in self.up:
            if isinstance(m, Stage):
                parts = (h, resolved(hs.pop()))
                h = m(parts if self.concat_free else torch.cat(resolved(parts), dim=1), temb)  # concat on channels
            else:
                h = m(resolved(h))
        return self.out(h)


class AnnotatedUNet(nn.Module):
    """The Annotated Diffusion UNet (full attention everywhere). Per level down: blocks (skip after each, attention
    before the last skip), then downsample (3x3 conv at the last level, which keeps H, W but widens). Up mirrors it
    with one skip per block; a final block sees the stem output concatenated."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        dim = cfg.base_channels
        temb_dim = 4 * dim
        self.num_classes = cfg.num_classes  # index of the null label (when > 0)
        self.time = TimeEmbedding(dim, temb_dim, nn.GELU, cfg.num_classes)
        self.stem = ImageConv2d(cfg.in_channels, dim, cfg.stem_kernel, "in", cfg.pad_image_channels)
        block = lambda cin, cout: AnnotatedResBlock(cfg, cin, cout, temb_dim)  # noqa: E731
        attn = lambda c: SelfAttention(c, cfg.attn_heads, cfg.attn_head_dim, 1, False,  # noqa: E731
                                       cfg.attn_impl, cfg.norm_impl, cfg.attn_linear, cfg.fused_norm_plan(),
                                       split_grads=cfg.attn_split_grads)
        dims = [dim] + [dim * m for m in cfg.channel_mult]
        in_out = list(zip(dims[:-1], dims[1:]))
        n = cfg.num_res_blocks

        self.down = nn.ModuleList()
        res = cfg.image_size
        for level, (cin, cout) in enumerate(in_out):
            last = level == len(in_out) - 1
            use_attn = res in cfg.attn_resolutions
            blocks = [Stage(block(cin, cin), attn(cin) if use_attn and i == n - 1 else None) for i in range(n)]
            resample = nn.Conv2d(cin, cout, 3, padding=1) if last else Downsample(cin, cout, unshuffle=True)
            self.down.append(Level(blocks, resample))
            res = res if last else res // 2

        mid = dims[-1]
        self.mid = Stage(block(mid, mid), attn(mid), block(mid, mid))

        self.up = nn.ModuleList()
        for level, (cin, cout) in enumerate(reversed(in_out)):
            last = level == len(in_out) - 1
            use_attn = res in cfg.attn_resolutions
            blocks = [Stage(block(cout + cin, cout), attn(cout) if use_attn and i == n - 1 else None) for i in range(n)]
            resample = nn.Conv2d(cout, cin, 3, padding=1) if last else Upsample(cout, cin, cfg.upsample)
            self.up.append(Level(blocks, resample))
            res = res if last else res * 2

        self.final = block(2 * dim, dim)
        self.out = ImageConv2d(dim, cfg.in_channels, 1, "out", cfg.pad_image_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        temb = self.time(t, y)
        h = self.stem(x)
        stem_out, hs = h, []
        for level in self.down:
            for stage in level.blocks:
                h = stage(h, temb)
                hs.append(h)
            h = level.resample(h)
        h = self.mid(h, temb)
        for level in self.up:
            for stage in level.blocks:
                h = stage(torch.cat([h, hs.pop()], dim=1), temb)  # concat on channels
            h = level.resample(h)
        return self.out(self.final(torch.cat([h, stem_out], dim=1), temb))


class Stage(nn.Module):
    """A residual block, optional attention, optional second residual block (the middle uses all three)."""

    def __init__(self, block: nn.Module, attn: nn.Module | None = None, block2: nn.Module | None = None):
        super().__init__()
        self.block = block
        self.attn = attn
        self.block2 = block2

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        x = self.block(x, temb)
        if self.attn is not None:  # structural, fixed at construction: no data-dependent branching
            x = self.attn(x)
        return x if self.block2 is None else self.block2(x, temb)


class Level(nn.Module):
    """One resolution of the annotated UNet: its residual stages and the resampling conv that ends it."""

    def __init__(self, blocks: list[Stage], resample: nn.Module):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.resample = resample


def build_model(cfg: ModelConfig) -> nn.Module:
    """Validates the config and builds the network; forward is model(x, t, y=None) -> ε estimate shaped like x."""
    cfg.validate()
    return (DDPMUNet if cfg.arch == "ddpm" else AnnotatedUNet)(cfg)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
