// CUTLASS 3's sm90 implicit-GEMM convolution (forward) as a C library that Python calls with torch's pointers and
// stream (ffcv_ddpm/conv_cutlass.py builds and loads it; NOTES 46-47): plain, and with the epilogue the next
// GroupNorm needs (the residual added, per-tile channel sums of the output).
//
// The GEMM: M = the output pixels (N*P*Q, im2col TMA loads of the NHWC input: the padding is TMA's zero fill, a tile
// may span samples), N = the output channels, K = 9 taps x Cin (weights KRSC, TMA tiled loads). One producer warp
// group feeds a ring of shared-memory stages, one consumer warp group issues wgmma from shared memory, then runs the
// epilogue. CUTLASS 4.2's sm90 convolutions have only this (non-persistent) schedule; PingpongFprop runs the same
// mainloop under CUTLASS's persistent ping-pong GEMM kernel. A config is a kernel, a tile shape, a cluster shape, a
// stage count and an epilogue (kConfigs).
#include <cstdio>
#include <cstring>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/conv/convnd_problem_shape.hpp>
#include <cutlass/conv/convolution.h>
#include <cutlass/conv/device/conv_universal_adapter.hpp>
#include <cutlass/conv/dispatch_policy.hpp>
#include <cutlass/conv/kernel/conv_universal.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "keep_hash.h"

using namespace cute;

// What a call passes: NHWC bf16 x [n, h, w, c], KRSC bf16 weights [k, 3, 3, c], the output y [n, h, w, k]; res (like
// y), bias (fp32 [k], or null: none), sum and sumsq (fp32 [n h w / 128, k]) only for the configs whose epilogue has
// them (else null). A dgrad config reads dy as x and writes dx as y; the one with the activation's sums (EPI_ACT_SUMS)
// also reads aux, the GroupNorm input that made the convolution's input (bf16, dx's shape and layout), and coef,
// fp32 [n, 2, c]: that GroupNorm's (u, v) per sample and channel (its affine output is aux u + v), and takes silu,
// the activation's form (0 none, 1 y sigmoid(y), 2 through tanh.approx: GroupNormAct.silu_mode); its sums are then
// of g = dx SiLU'(aux u + v) and g aux, per 128 pixels and channel: [n h w / 128, c]. With thr > 0 the GroupNorm
// had dropout: g = dx keep / (1 - p) SiLU'(...), keep replayed from the step's seed (int64 [1] on the device) as
// keep_hash.h draws it (thr = p 2^24, or p 2^16 with pair), inv_keep = 1 / (1 - p).
struct Operands {
  const void* x;
  const void* wt;
  void* y;
  const void* res;
  const float* bias;
  float* sum;
  float* sumsq;
  int n, h, w, c, k;
  const void* aux = nullptr;
  const float* coef = nullptr;
  int silu = 0;
  const int64_t* seed = nullptr;
  int thr = 0, pair = 0;
  float inv_keep = 1.0f;
};

// Checks, then launches one kernel on `stream`: 0, or an error code with what went wrong in err.
template <class Adapter, class Kernel>
int launch(typename Adapter::Arguments const& args, cudaStream_t stream, char* err, int errlen) {
  if (Adapter::can_implement(args) != cutlass::Status::kSuccess) {
    snprintf(err, errlen, "CUTLASS cannot implement this problem with this config");
    return 1;
  }
  if (size_t bytes = Adapter::get_workspace_size(args)) {
    snprintf(err, errlen, "this config asks for a workspace (%zu bytes); none is passed", bytes);
    return 2;
  }
  // The shared-memory attribute, set once and outside any CUDA-graph capture (a config's first call is never
  // captured: the benchmark checks its answer before timing it).
  static int blocks_per_sm = Adapter::maximum_active_blocks();
  if (blocks_per_sm <= 0) {
    snprintf(err, errlen, "no block fits an SM (%d bytes of shared memory)", int(Kernel::SharedStorageSize));
    return 3;
  }
  auto params = Kernel::to_underlying_arguments(args, nullptr);
  if (Adapter::run(params, stream) != cutlass::Status::kSuccess) {
    snprintf(err, errlen, "launch failed: %s", cudaGetErrorString(cudaGetLastError()));
    return 4;
  }
  return 0;
}

// A call's problem: 3x3, padding 1, stride 1.
template <class Problem>
Problem conv_problem(const Operands& o) {
  return Problem(cutlass::conv::Mode::kCrossCorrelation, {o.n, o.h, o.w, o.c}, {o.k, 3, 3, o.c}, {1, 1}, {1, 1},
                 {1, 1}, {1, 1}, 1);
}

// The persistent kernels' grid: one block an SM of the current device (asked once).
int sm_count() {
  static int count = [] {
    int device = 0;
    cudaGetDevice(&device);
    return cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
  }();
  return count;
}

int plain_only(const Operands& o, char* err, int errlen) {
  if (o.res || o.bias || o.sum || o.sumsq || o.aux || o.coef) {
    snprintf(err, errlen, "this config has no epilogue: no residual, bias, sums or activation operands");
    return 6;
  }
  return 0;
}

// Stages 0: as many as the shared memory holds beside the epilogue's; else that many (fewer: two blocks an SM, one's
// epilogue beside the other's main loop). Epilogue: CUTLASS's choice for these types (registers straight to global
// memory), or its TMA warp-specialized one, the one whose visitor trees (EVT) fuse bias, residual and reductions.
// Op: the forward convolution (A = x [n, h, w, c], D = y [n, h, w, k]) or the data gradient (kDgrad: A = dy
// [n, h, w, k], D = dx [n, h, w, c]), the weights KRSC either way (Operands' x, wt, y; c and k the forward's).
template <class TileShape, class ClusterShape, int Stages = 0, class EpilogueSchedule = void,
          cutlass::conv::Operator Op = cutlass::conv::Operator::kFprop>
struct Fprop {
  using Element = cutlass::bfloat16_t;
  static constexpr int Align = 8;  // 16 bytes of bf16: channels a multiple of 8
  using Layout = cutlass::layout::TensorNHWC;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, Layout, Align,  // no source tensor: D = acc
      Element, Layout, Align,
      cute::conditional_t<cute::is_void_v<EpilogueSchedule>, cutlass::epilogue::collective::EpilogueScheduleAuto,
                          EpilogueSchedule>>::CollectiveOp;

  using StageCount = cute::conditional_t<
      Stages == 0,
      cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::conv::collective::StageCount<Stages>>;

  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op, Element, Layout, Align, Element, Layout, Align, float,
      TileShape, ClusterShape, StageCount, cutlass::conv::collective::KernelScheduleAuto>::CollectiveOp;

  using Problem = cutlass::conv::ConvProblemShape<Op, Mainloop::DispatchPolicy::NumSpatialDimensions>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, Mainloop, Epilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;

  static int stages() { return Mainloop::DispatchPolicy::Stages; }
  static int smem_bytes() { return Kernel::SharedStorageSize; }

  static int run(const Operands& o, cudaStream_t stream, char* err, int errlen) {
    if (int rc = plain_only(o, err, errlen)) return rc;
    auto problem = conv_problem<Problem>(o);
    typename Kernel::StrideD stride_d;
    cute::for_each(cute::make_seq<cute::rank<0>(typename Kernel::StrideD{})>{}, [&](auto i) {
      cute::get<0, i>(stride_d) = problem.stride_C[Problem::RankT - 2 - i];
    });
    typename Conv::Arguments args{
        problem,
        {static_cast<const Element*>(o.x), static_cast<const Element*>(o.wt)},
        {{1.0f, 0.0f}, nullptr, typename Kernel::StrideC{}, static_cast<Element*>(o.y), stride_d}};
    return launch<Conv, Kernel>(args, stream, err, errlen);
  }
  static int occupancy() { return Conv::maximum_active_blocks(); }
};

// CUTLASS's conv mainloop as its persistent GEMM kernels take a GEMM mainloop, so that two consumer warp groups
// alternate tiles (ping-pong: one's epilogue beside the other's main loop) over a grid of one block an SM. What
// differs: the kernels read the problem as a rank-4 (M, N, K, L) tuple (here the linearized conv problem: M = output
// pixels, K = (C, S, R)) and slice the weights' tiles by an L coordinate, which a conv has not (a trailing mode of 1 is
// appended, and dropped again before the conv's own load); the conv problem itself travels in the arguments, for the
// im2col TMA descriptor. The output is the GEMM's row-major [pixels, channels] matrix: NHWC as it lies.
template <class Conv, class KernelSchedule>
struct AsGemmMainloop : Conv {
  using ConvProblem = typename Conv::ProblemShape;
  struct DispatchPolicy : Conv::DispatchPolicy {
    using Schedule = KernelSchedule;
  };
  using StrideA = cute::Stride<int64_t, _1, _0>;  // read only by the kernels' rank checks
  using StrideB = cute::Stride<int64_t, _1, _0>;
  static constexpr uint32_t NumProducerThreadEvents = 1;  // one elected thread issues both TMA loads of a stage
  // (pixels, channels, (C, S, R), 1): the L as a run-time int, as the GEMM epilogue's TMA types are declared
  static auto problem_mnkl(ConvProblem const& problem) {
    auto [m, n, k, l] = Conv::get_problem_shape_MNKL(problem);
    return cute::make_shape(int(m), int(n), k, int(1));
  }
  using ProblemMNKL = decltype(problem_mnkl(ConvProblem{}));
  using Params = typename Conv::Params;
  struct Arguments {
    typename Conv::Arguments conv;
    ConvProblem problem;
  };

  template <class P>
  static Params to_underlying_arguments(P const&, Arguments const& args, void* workspace) {
    return Conv::to_underlying_arguments(args.problem, args.conv, workspace);
  }
  template <class P>
  static bool can_implement(P const&, Arguments const& args) {
    return Conv::can_implement(args.problem, args.conv);
  }

  template <class T>
  CUTLASS_DEVICE static auto with_l(T const& t) {
    return make_tensor(t.data(), append(t.layout(), make_layout(_1{}, _0{})));
  }
  template <class P>
  CUTLASS_DEVICE auto load_init(P const& problem_mnkl, Params const& params) {
    auto inputs = Conv::load_init(problem_mnkl, params);
    return cute::make_tuple(get<0>(inputs), with_l(get<1>(inputs)));  // the kernels read no L of A
  }
  template <class Inputs, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Conv::MainloopPipeline pipeline,
                           typename Conv::PipelineState state, Inputs const& inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           typename Conv::TensorStorage& shared_tensors) {
    auto gA = get<0>(inputs);
    auto gB = get<1>(inputs)(_, _, _, _, Int<0>{});
    Conv::load(params, pipeline, state, cute::make_tuple(gA, gB),
               make_coord(get<0>(blk_coord), get<1>(blk_coord), get<2>(blk_coord), Int<0>{}), k_tile_iter,
               k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
  }
};

// The conv mainloop with another TiledMma: the builder makes one consumer warp group's, the cooperative kernel wants
// two that split the tile's M (its conv builder would, but its dispatch policy refuses the persistent schedules).
template <class Collective, class TiledMma>
struct WithTiledMma;
template <class P, class T, class EA, class EB, class TM, class TA, class TB, class TiledMma>
struct WithTiledMma<cutlass::conv::collective::CollectiveConv<P, T, EA, EB, TM, TA, TB>, TiledMma> {
  using type = cutlass::conv::collective::CollectiveConv<P, T, EA, EB, TiledMma, TA, TB>;
};

// A persistent kernel of the conv mainloop (AsGemmMainloop) and a GEMM epilogue over the [pixels, channels] output,
// and one call of it with the epilogue's own arguments (a linear combination's, or a visitor tree's) and its source
// C (the residual, or none).
template <class Mainloop_, class Epilogue_>
struct Persistent {
  using Mainloop = Mainloop_;
  using Epilogue = Epilogue_;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<typename Mainloop::ProblemMNKL, Mainloop, Epilogue>;
  // CUTLASS's conv adapter launches any 3.x kernel; its GEMM adapter would pull in the 2.x GemmUniversal, whose
  // specialization then matches the non-persistent conv kernel too.
  using Gemm = cutlass::conv::device::ConvUniversalAdapter<Kernel>;

  static int stages() { return Mainloop::DispatchPolicy::Stages; }
  static int smem_bytes() { return Kernel::SharedStorageSize; }
  static int occupancy() { return Gemm::maximum_active_blocks(); }

  static int call(const Operands& o, typename Epilogue::FusionCallbacks::Arguments thread, const void* source,
                  cudaStream_t stream, char* err, int errlen) {
    using Element = typename Epilogue::ElementD;
    using ConvProblem = typename Mainloop::ConvProblem;
    auto problem = conv_problem<ConvProblem>(o);
    int out_channels = ConvProblem::ConvOp == cutlass::conv::Operator::kDgrad ? o.c : o.k;  // D: dx, or y
    auto stride = cutlass::make_cute_packed_stride(typename Kernel::StrideD{},
                                                   cute::make_shape(o.n * o.h * o.w, out_channels, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        Mainloop::problem_mnkl(problem),
        {{static_cast<const Element*>(o.x), static_cast<const Element*>(o.wt)}, problem},
        {thread, static_cast<const typename Epilogue::ElementC*>(source), stride, static_cast<Element*>(o.y), stride},
        {0, sm_count()}};
    return launch<Gemm, Kernel>(args, stream, err, errlen);
  }
};

// Persistent: ping-pong (two consumer warp groups alternate whole tiles, one's epilogue beside the other's main
// loop), or cooperative (Coop: the two split each tile's rows, 64 a warp group at M = 128, half the accumulator a
// thread, and run the epilogue together while the producer loads the next tile).
template <class TileShape, class ClusterShape, int Stages, bool Coop,
          cutlass::conv::Operator Op = cutlass::conv::Operator::kFprop>
struct PingpongParts {
  using Base = Fprop<TileShape, ClusterShape, Stages, cutlass::epilogue::TmaWarpSpecialized, Op>;
  using Element = typename Base::Element;
  using RowMajor = cutlass::layout::RowMajor;
  using EpilogueSchedule = cute::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                               cutlass::epilogue::TmaWarpSpecialized>;
  // The output as the GEMM's row-major [pixels, channels] matrix; Source void (none) or the residual's type, and
  // the fusion: D = acc when void, else a visitor tree's callbacks.
  template <class Source = void, class Fusion = cutlass::epilogue::fusion::LinearCombination<Element, float, void>>
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Source, RowMajor, Base::Align, Element, RowMajor,
      Base::Align, EpilogueSchedule, Fusion>::CollectiveOp;
  using CoopMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShape, cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      Layout<Shape<_2, _1, _1>>{}));
  using Mainloop = cute::conditional_t<
      Coop,
      AsGemmMainloop<typename WithTiledMma<typename Base::Mainloop, CoopMma>::type,
                     cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
      AsGemmMainloop<typename Base::Mainloop, cutlass::gemm::KernelTmaWarpSpecializedPingpong>>;
};

template <class TileShape, class ClusterShape, int Stages = 0, bool Coop = false,
          cutlass::conv::Operator Op = cutlass::conv::Operator::kFprop,
          class Parts = PingpongParts<TileShape, ClusterShape, Stages, Coop, Op>>
struct PingpongFprop : Persistent<typename Parts::Mainloop, typename Parts::template Epilogue<>> {
  static int run(const Operands& o, cudaStream_t stream, char* err, int errlen) {
    if (int rc = plain_only(o, err, errlen)) return rc;
    return PingpongFprop::call(o, {1.0f, 0.0f}, nullptr, stream, err, errlen);  // D = 1 acc + 0 C
  }
};

// Ping-pong with the epilogue the next GroupNorm needs (NOTES 46 step 2), as a visitor tree on the accumulator:
//   out = bf16(acc [+ residual])                     stored: what the next GroupNorm reads
//   sum[t, c] = sum over tile t's rows of out[., c], sumsq[t, c] likewise of out^2 (fp32, of the bf16 values)
// t = the M tile (128 output pixels: within one sample at 32x32 and 16x16, so per-(sample, tile, channel) partial
// sums that the next GroupNorm's finalize combines; any per-(sample, channel) bias it adds later shifts them exactly:
// sum(x + b) = sum(x) + n b, sum((x + b)^2) = sumsq + 2 b sum + n b^2). The residual is the epilogue's source C.

// The sums as a visitor node of our own. CUTLASS's Sm90RowReduction keeps each thread's partial row for the whole
// tile, which ends up in local memory (f0b3d0a: a 752-byte stack frame, the epilogue 2-3x the main loop;
// results/h200/conv-cutlass-epilogue-f0b3d0a). Here a thread keeps one column block's values only (the subtiles of
// one epi_n share their columns and the epilogue visits them one after another), adds up those in one column (their
// offsets from the thread's first value are static: the sums are grouped at compile time), folds each column's sums
// over the lanes that hold it (wgmma's accumulator layout: lanes l, l^4, l^8, l^16) and lanes 0-3 store the warp's
// sums in shared memory, a slot per (warp, column): no atomics, every slot written each tile. The tile's last
// subtile adds the warps' slots and writes one fp32 partial per tile and column.
//
// ActGrad (the dgrad's epilogue, NOTES 48 and 50: the backward reduction of the GroupNorm + SiLU whose output was the
// convolution's input): for each value d (dx as stored, bf16) at pixel m and channel c, the two sums are of
// g = d SiLU'(y) and g x, x = aux[m, c] (that GroupNorm's input), y = x u + v with (u, v) = coef[sample, :, c]; a
// 128-pixel tile lies in one sample (the caller checks h w % 128 == 0). x comes as the epilogue's source C (loaded
// by TMA ahead of the subtile, as a residual is: the node's second input); the tile's (u, v) (one sample, TileN
// channels) are staged in shared memory once a tile, as Sm90RowBroadcast stages a row, and a subtile's taken into
// registers as it begins (the first form read x and (u, v) per value from global memory: 3.6x the plain dgrad's
// time, results/h200/dgrad-sums-5d32a20; the second, (u, v) from global memory once a subtile, 1.9x).
// d SiLU'(y) (gn_kernels._silu_grad) up to a constant factor the tile's sums take once at their end (act_scale):
// Mode 2 (tanh.approx) takes z = y / 2 (the staged (u, v) halved) and returns 2 d SiLU'(y) = d (1 + t + z (1 - t^2)),
// t = tanh(z): five operations; Mode 1 d y sigmoid(y)'s derivative; Mode 0 d. Branch-free, Mode a template parameter.
template <int Mode>
CUTLASS_DEVICE float act_grad(float d, float z) {
  if constexpr (Mode == 2) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(z));
    return fmaf(d, fmaf(z, fmaf(-t, t, 1.0f), t), d);
  } else if constexpr (Mode == 1) {
    float s = __fdividef(1.0f, 1.0f + __expf(-z));  // not 1 / (.): its IEEE slow path is a call per value
    return d * s * (1.0f + z * (1.0f - s));
  } else {
    return d;
  }
}
CUTLASS_DEVICE float act_coef_scale(int mode) { return mode == 2 ? 0.5f : 1.0f; }  // (u, v) as staged
CUTLASS_DEVICE float act_scale(int mode, float inv_keep) {  // the sums' factor: Mode 2's 1 / 2, dropout's 1 / (1 - p)
  return (mode == 2 ? 0.5f : 1.0f) * inv_keep;
}

// Bare (with ActGrad; a measurement, NOTES 50): the same data movement, x in and the two sums out, without the
// arithmetic: the sums of d and d x, no (u, v), SiLU' or mask.
template <class CtaTileShapeMNK, int MaxWarps = 4, bool ActGrad = false, bool Bare = false>
struct TileColumnSums {
  static constexpr int TileM = cute::size<0>(CtaTileShapeMNK{});
  static constexpr int TileN = cute::size<1>(CtaTileShapeMNK{});
  struct SumsStorage {
    float sums[2][MaxWarps][TileN];
  };
  struct ActGradStorage : SumsStorage {
    float coef[2][TileN];  // the tile's (u, v)
  };
  using SharedStorage = cute::conditional_t<ActGrad, ActGradStorage, SumsStorage>;
  struct Arguments {
    float* ptr_sum = nullptr;
    float* ptr_sumsq = nullptr;
    float const* ptr_coef = nullptr;  // ActGrad's (u, v)
    int hw = 0, silu = 0;
    int64_t const* ptr_seed = nullptr;  // ActGrad's dropout: the step's seed, thr 0 for none
    int thr = 0, pair = 0;
    float inv_keep = 1.0f;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE TileColumnSums() {}
  CUTLASS_HOST_DEVICE TileColumnSums(Params const& params, SharedStorage const& shared)
      : params(params), shared(const_cast<SharedStorage*>(&shared)) {}
  Params params;
  SharedStorage* shared = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class RelCoords, class TileCoords, class TileCoord, class ProblemShape, int Elems>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    RelCoords rel;     // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) -> (m, n) from the thread's first value: static
    TileCoords tcoord; // the same -> (m, n) in the tile
    TileCoord tile;
    ProblemShape problem;
    int thread_idx, threads;
    Params const& params;
    SharedStorage* shared;
    float part[2][Elems];
    float cu[ActGrad ? Elems : 1], cv[ActGrad ? Elems : 1];  // ActGrad: the subtile's values' (u, v)
    uint32_t seed = 0;  // ActGrad with dropout: the mixed seed

    CUTLASS_DEVICE void begin() {  // ActGrad: the tile's (u, v) into shared memory (the epilogue syncs after)
      if constexpr (ActGrad && !Bare) {
        int c = get<1>(problem);
        float const* coef = params.ptr_coef + size_t(int(get<0>(tile)) * TileM / params.hw) * 2 * c +
                            int(get<1>(tile)) * TileN;
        float half = act_coef_scale(params.silu);
        for (int i = thread_idx; i < 2 * TileN; i += threads) shared->coef[i / TileN][i % TileN] =
            half * __ldg(coef + (i / TileN) * c + i % TileN);
        if (params.thr) seed = keep_mix_seed(uint32_t(__ldg(params.ptr_seed)));
      }
    }
    CUTLASS_DEVICE bool begin_sync_needed() const { return ActGrad && !Bare; }

    CUTLASS_DEVICE void begin_loop(int epi_m, int epi_n) {
      if constexpr (ActGrad && !Bare) {
        // A value's channel in the tile from tcoord (rel counts from the thread's first value of the whole tile:
        // f405b95 added the subtile's offset twice). Values in one column (rel's columns are static) share a load.
        auto rel_mn = rel(_, _, _, epi_m, epi_n);
        auto tile_mn = tcoord(_, _, _, epi_m, epi_n);
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < Elems; ++k) {
          int first = k;
          CUTLASS_PRAGMA_UNROLL
          for (int j = k - 1; j >= 0; --j) first = get<1>(rel_mn(j)) == get<1>(rel_mn(k)) ? j : first;
          if (first < k) {
            cu[k] = cu[first];
            cv[k] = cv[first];
          } else {
            int ch = int(get<1>(tile_mn(k)));
            cu[k] = shared->coef[0][ch];
            cv[k] = shared->coef[1][ch];
          }
        }
      }
    }

    CUTLASS_DEVICE ConsumerStoreCallbacks(RelCoords r, TileCoords t, TileCoord c, ProblemShape p, int idx, int n,
                                          Params const& prm, SharedStorage* s)
        : rel(r), tcoord(t), tile(c), problem(p), thread_idx(idx), threads(n), params(prm), shared(s) {}

    template <int FragmentSize>
    CUTLASS_DEVICE void add(int epi_v, int epi_m, int i, float v, float w) {  // the terms (v, v w) of value k
      int k = epi_v * FragmentSize + i;
      part[0][k] = epi_m == 0 ? v : part[0][k] + v;
      part[1][k] = epi_m == 0 ? v * w : part[1][k] + v * w;
    }

    template <class ElementAccumulator, class ElementInput, int FragmentSize>  // the sums of v and v^2
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int,
                              cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      static_assert(!ActGrad, "ActGrad's node takes the stored value and x");
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        float v = static_cast<float>(frg_input[i]);
        add<FragmentSize>(epi_v, epi_m, i, v, v);
      }
      return frg_input;
    }

    // ActGrad's terms of one fragment, Mode and Drop fixed: a straight line over its values. (c121b76 branched on
    // the SiLU mode and the dropout per value: the branches split the values' chains, which then ran one after
    // another at their full latencies, 6x the plain dgrad's time; results/h200/dgrad-sums-2c0013c.) Drop: 0 none,
    // 1 a hash a value, 2 the pair form, one hash for values i and i + 1 (i even): the fragment holds the R2S copy's
    // 32-bit registers, each two adjacent channels of one pixel, the first even (conv_dgrad's check at the dropout
    // sites fails if not).
    template <int Mode, int Drop, class ElementInput, class ElementX, int FragmentSize>
    CUTLASS_DEVICE void act_terms(int epi_v, int epi_m, int epi_n,
                                  cutlass::Array<ElementInput, FragmentSize> const& frg_input,
                                  cutlass::Array<ElementX, FragmentSize> const& frg_x) {
      static_assert(FragmentSize % 2 == 0, "values in pairs");
      auto tile_mn = tcoord(_, _, _, epi_m, epi_n);
      uint32_t c = get<1>(problem), m0 = uint32_t(get<0>(tile)) * TileM, n0 = uint32_t(get<1>(tile)) * TileN;
      uint32_t thr = params.thr;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        int k = epi_v * FragmentSize + i;
        float d0 = static_cast<float>(frg_input[i]), d1 = static_cast<float>(frg_input[i + 1]);
        if constexpr (Drop) {  // the forward's dropout: (m, c)'s index in (n, hw, c) order is m c + channel
          uint32_t index = (m0 + uint32_t(get<0>(tile_mn(k)))) * c + n0 + uint32_t(get<1>(tile_mn(k)));
          bool keep0, keep1;
          if constexpr (Drop == 2) {
            uint32_t z = keep_hash(seed, index >> 1);
            keep0 = (z & 0xFFFFu) >= thr;
            keep1 = (z >> 16) >= thr;
          } else {
            keep0 = (keep_hash(seed, index) >> 8) >= thr;
            keep1 = (keep_hash(seed, index + 1) >> 8) >= thr;
          }
          d0 = keep0 ? d0 : 0.0f;  // 1 / (1 - p) in act_scale
          d1 = keep1 ? d1 : 0.0f;
        }
        float x0 = static_cast<float>(frg_x[i]), x1 = static_cast<float>(frg_x[i + 1]);
        add<FragmentSize>(epi_v, epi_m, i, act_grad<Mode>(d0, fmaf(x0, cu[k], cv[k])), x0);
        add<FragmentSize>(epi_v, epi_m, i + 1, act_grad<Mode>(d1, fmaf(x1, cu[k + 1], cv[k + 1])), x1);
      }
    }

    template <class ElementAccumulator, class ElementInput, class ElementX, int FragmentSize>  // ActGrad's
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_input,
                              cutlass::Array<ElementX, FragmentSize> const& frg_x) {
      static_assert(ActGrad, "only ActGrad's node takes x");
      if constexpr (Bare) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i)
          add<FragmentSize>(epi_v, epi_m, i, static_cast<float>(frg_input[i]), static_cast<float>(frg_x[i]));
      } else if (params.thr && params.pair) {  // uniform branches, once a fragment
        if (params.silu == 2) act_terms<2, 2>(epi_v, epi_m, epi_n, frg_input, frg_x);
        else if (params.silu == 1) act_terms<1, 2>(epi_v, epi_m, epi_n, frg_input, frg_x);
        else act_terms<0, 2>(epi_v, epi_m, epi_n, frg_input, frg_x);
      } else if (params.thr) {
        if (params.silu == 2) act_terms<2, 1>(epi_v, epi_m, epi_n, frg_input, frg_x);
        else if (params.silu == 1) act_terms<1, 1>(epi_v, epi_m, epi_n, frg_input, frg_x);
        else act_terms<0, 1>(epi_v, epi_m, epi_n, frg_input, frg_x);
      } else {
        if (params.silu == 2) act_terms<2, 0>(epi_v, epi_m, epi_n, frg_input, frg_x);
        else if (params.silu == 1) act_terms<1, 0>(epi_v, epi_m, epi_n, frg_input, frg_x);
        else act_terms<0, 0>(epi_v, epi_m, epi_n, frg_input, frg_x);
      }
      return frg_input;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const& sync_fn, int epi_m, int epi_n, bool is_last_iteration,
                               VTensor) {
      if (epi_m != cute::size<3>(rel) - 1) return;  // the column block continues in the next subtile
      int lane = thread_idx % 32, warp = thread_idx / 32;
      auto rel_mn = rel(_, _, _, epi_m, epi_n);
      auto tile_mn = tcoord(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < Elems; ++k) {
        int col = get<1>(rel_mn(k));
        bool first = true;  // the first value of its column: every comparison here folds at compile time
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < k; ++j) first = first && get<1>(rel_mn(j)) != col;
        if (!first) continue;
        float a = 0.0f, b = 0.0f;
        CUTLASS_PRAGMA_UNROLL
        for (int j = k; j < Elems; ++j) {
          if (get<1>(rel_mn(j)) == col) {
            a += part[0][j];
            b += part[1][j];
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int mask = 4; mask < 32; mask *= 2) {
          a += __shfl_xor_sync(0xffffffff, a, mask);
          b += __shfl_xor_sync(0xffffffff, b, mask);
        }
        if (lane < 4) {
          int c = get<1>(tile_mn(k));
          shared->sums[0][warp][c] = a;
          shared->sums[1][warp][c] = b;
        }
      }
      if (is_last_iteration) {
        sync_fn();
        int n = get<1>(problem), warps = threads / 32;
        size_t row = size_t(get<0>(tile)) * n + size_t(get<1>(tile)) * TileN;
        float scale = 1.0f;  // ActGrad: the factor act_grad left out
        if constexpr (ActGrad && !Bare) scale = act_scale(params.silu, params.thr ? params.inv_keep : 1.0f);
        for (int c = thread_idx; c < TileN; c += threads) {
          float a = 0.0f, b = 0.0f;
          for (int w = 0; w < warps; ++w) {
            a += shared->sums[0][w][c];
            b += shared->sums[1][w][c];
          }
          params.ptr_sum[row + c] = a * scale;
          params.ptr_sumsq[row + c] = b * scale;
        }
        sync_fn();  // read before the next tile writes its slots
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    // args.tCcD counts from the thread's first value (static; the epilogue compares it with a residue taken from
    // there); the tile coordinates come from partitioning the tile's identity the same way.
    auto tCcT = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(take<0, 2>(args.tile_shape_mnk)), args.epi_tile, args.tiled_copy, args.thread_idx);
    constexpr int Elems = decltype(cute::size(args.tCcD(_, _, _, 0, 0)))::value;
    static_assert(decltype(cute::size(args.tiled_mma))::value <= 32 * MaxWarps, "more warps than sum slots");
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(tCcT), decltype(args.tile_coord_mnkl),
                                  decltype(args.problem_shape_mnkl), Elems>(
        args.tCcD, tCcT, args.tile_coord_mnkl, args.problem_shape_mnkl, args.thread_idx,
        int(cute::size(args.tiled_mma)), params, shared);
  }
};

template <class TileShape, bool Residual, int Warps, bool ActGrad = false, bool Bare = false>
struct StatsCallbacks {
  using Element = cutlass::bfloat16_t;
  static constexpr auto RN = cutlass::FloatRoundStyle::round_to_nearest;
  // With the residual, a per-channel bias too (the residual sum's: model.conv_cutlass), 0 where its pointer is null.
  using Bias = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float>;
  using Out = cute::conditional_t<
      Residual,
      cutlass::epilogue::fusion::Sm90EVT<
          cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, Element, float, RN>,
          cutlass::epilogue::fusion::Sm90EVT<cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, float, float, RN>,
                                             cutlass::epilogue::fusion::Sm90AccFetch, Bias>,
          cutlass::epilogue::fusion::Sm90SrcFetch<Element>>,
      cutlass::epilogue::fusion::Sm90EVT<
          cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, Element, float, RN>,
          cutlass::epilogue::fusion::Sm90AccFetch>>;
  using Fetch = cutlass::epilogue::fusion::Sm90SplitTreeFetch;
  // ActGrad's node sums the stored value with x, the epilogue's source C
  using Sums = cute::conditional_t<
      ActGrad,
      cutlass::epilogue::fusion::Sm90EVT<TileColumnSums<TileShape, Warps, true, Bare>, Fetch,
                                         cutlass::epilogue::fusion::Sm90SrcFetch<Element>>,
      cutlass::epilogue::fusion::Sm90EVT<TileColumnSums<TileShape, Warps>, Fetch>>;
  // Out evaluated once; its value is stored (the output tree: the fetch itself) and summed
  using Callbacks = cutlass::epilogue::fusion::Sm90SplitTreeVisitor<Out, Fetch, Sums>;
};

template <class TileShape, class ClusterShape, bool Residual, bool Coop = false,
          class Parts = PingpongParts<TileShape, ClusterShape, 0, Coop>,
          class Source = cute::conditional_t<Residual, typename Parts::Element, void>,
          class Callbacks = typename StatsCallbacks<TileShape, Residual, Coop ? 8 : 4>::Callbacks>
struct PingpongStatsFprop : Persistent<typename Parts::Mainloop, typename Parts::template Epilogue<Source, Callbacks>> {
  static int run(const Operands& o, cudaStream_t stream, char* err, int errlen) {
    if (Residual != (o.res != nullptr) || !o.sum || !o.sumsq) {
      snprintf(err, errlen, "this config needs %s residual and both sums", Residual ? "a" : "no");
      return 6;
    }
    if ((!Residual && o.bias) || o.aux || o.coef) {
      snprintf(err, errlen, "this config adds no bias (the residual configs do) and reads no activation operands");
      return 6;
    }
    typename Callbacks::Arguments args{};  // op_0 Out, op_1 Sums, op_2 the output tree (the fetch: none)
    if constexpr (Residual) args.op_0.op_0.op_1 = {o.bias};  // Out = (acc + bias) + source: the bias node
    args.op_1 = {{}, {o.sum, o.sumsq}};
    return PingpongStatsFprop::call(o, args, o.res, stream, err, errlen);
  }
};

// The dgrad under the ping-pong kernel with the backward reduction's sums in its epilogue (ActGrad above): dx stored
// as bf16, the sums of (g, g x) per 128 pixels and channel.
template <class TileShape, bool Bare = false,
          class Parts = PingpongParts<TileShape, Shape<_1, _1, _1>, 0, false, cutlass::conv::Operator::kDgrad>,
          class Callbacks = typename StatsCallbacks<TileShape, false, 4, true, Bare>::Callbacks>
struct PingpongDgradSums : Persistent<typename Parts::Mainloop,
                                      typename Parts::template Epilogue<typename Parts::Element, Callbacks>> {
  static int run(const Operands& o, cudaStream_t stream, char* err, int errlen) {
    if (o.res || o.bias || !o.sum || !o.sumsq || !o.aux || !o.coef) {
      snprintf(err, errlen, "this config needs both sums, aux and coef, and takes no residual or bias");
      return 6;
    }
    if ((o.h * o.w) % cute::size<0>(TileShape{}) || o.silu < 0 || o.silu > 2 || o.thr < 0 ||
        (o.thr && !o.seed) || (o.pair && o.c % 2)) {
      snprintf(err, errlen, "h w = %d is not a whole number of %d-pixel tiles, silu %d is not 0, 1 or 2, or the "
               "dropout's threshold %d, seed %p and pair %d (of %d channels) do not go together",
               o.h * o.w, int(cute::size<0>(TileShape{})), o.silu, o.thr, static_cast<const void*>(o.seed), o.pair, o.c);
      return 6;
    }
    typename Callbacks::Arguments args{};  // op_0 Out, op_1 Sums, op_2 the output tree (the fetch: none)
    args.op_1 = {{}, {}, {o.sum, o.sumsq, o.coef, o.h * o.w, o.silu, o.seed, o.thr, o.pair, o.inv_keep}};
    // (fetch, x, the node)
    return PingpongDgradSums::call(o, args, o.aux, stream, err, errlen);  // x as the source C
  }
};

// name, run, stages, shared memory, blocks an SM, the epilogue's extras (EPI_RESIDUAL | EPI_STATS | EPI_ACT_SUMS)
enum { EPI_RESIDUAL = 1, EPI_STATS = 2, EPI_ACT_SUMS = 4 };
enum { OP_FPROP = 0, OP_DGRAD = 1 };
struct Config {
  const char* name;
  int (*run)(const Operands&, cudaStream_t, char*, int);
  int (*stages)();
  int (*smem)();
  int (*occupancy)();
  int epilogue;
  int op = OP_FPROP;
};

#define FPROP(M, N, K, CM, CN, ...) Fprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_##CM, _##CN, _1>, ##__VA_ARGS__>
#define CONFIG(name, ...)                                                                                          \
  {name, FPROP(__VA_ARGS__)::run, FPROP(__VA_ARGS__)::stages, FPROP(__VA_ARGS__)::smem_bytes,                   \
   FPROP(__VA_ARGS__)::occupancy, 0}
using TmaEpilogue = cutlass::epilogue::TmaWarpSpecialized;
#define PINGPONG(M, N, K, CM, CN, ...) \
  PingpongFprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_##CM, _##CN, _1>, ##__VA_ARGS__>
#define PCONFIG(name, ...)                                                                                         \
  {name, PINGPONG(__VA_ARGS__)::run, PINGPONG(__VA_ARGS__)::stages, PINGPONG(__VA_ARGS__)::smem_bytes,          \
   PINGPONG(__VA_ARGS__)::occupancy, 0}
#define COOP(M, N, K) PingpongFprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_1, _1, _1>, 0, true>
#define CCONFIG(name, M, N, K) \
  {name, COOP(M, N, K)::run, COOP(M, N, K)::stages, COOP(M, N, K)::smem_bytes, COOP(M, N, K)::occupancy, 0}
#define STATS(M, N, K, RES, CO) PingpongStatsFprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_1, _1, _1>, RES, CO>
#define SCONFIG(name, M, N, K, RES, CO)                                                                            \
  {name, STATS(M, N, K, RES, CO)::run, STATS(M, N, K, RES, CO)::stages, STATS(M, N, K, RES, CO)::smem_bytes,     \
   STATS(M, N, K, RES, CO)::occupancy, EPI_STATS | (RES ? EPI_RESIDUAL : 0)}

// The K tile is a tuple (Shape<_64>): it tiles the filter's (C, S, R) mode, C first, as CUTLASS's conv examples do.
// A consumer warp group holds its whole tile's fp32 accumulator: 128 x 128 or 64 x 256 is 128 registers a thread,
// 128 x 64 / 64 x 128 half. Clusters of 2 along M share each weight tile by TMA multicast; along N, each input tile.
// The first call (results/h200/conv-cutlass-e8b3991) put the non-persistent kernel with its default epilogue
// (registers to global memory, 0.64x cuDNN) and every other config under the TMA epilogue's 0.82x: those are gone.
constexpr auto kDgrad = cutlass::conv::Operator::kDgrad;
#define DGRAD(M, N, K) Fprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_1, _1, _1>, 0, TmaEpilogue, kDgrad>
#define DCONFIG(name, M, N, K) \
  {name, DGRAD(M, N, K)::run, DGRAD(M, N, K)::stages, DGRAD(M, N, K)::smem_bytes, DGRAD(M, N, K)::occupancy, 0, OP_DGRAD}
#define DPINGPONG(M, N, K) PingpongFprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_1, _1, _1>, 0, false, kDgrad>
#define DPCONFIG(name, M, N, K)                                                                                   \
  {name, DPINGPONG(M, N, K)::run, DPINGPONG(M, N, K)::stages, DPINGPONG(M, N, K)::smem_bytes,                    \
   DPINGPONG(M, N, K)::occupancy, 0, OP_DGRAD}

#define ACT(BARE) PingpongDgradSums<Shape<_128, _128, Shape<_64>>, BARE>
#define ACONFIG(name, BARE)                                                                                      \
  {name, ACT(BARE)::run, ACT(BARE)::stages, ACT(BARE)::smem_bytes, ACT(BARE)::occupancy, EPI_STATS | EPI_ACT_SUMS,  \
   OP_DGRAD}

static const Config kConfigs[] = {
    CONFIG("128x128x64", 128, 128, 64, 1, 1, 0, TmaEpilogue),
    CONFIG("128x128x64 cluster 2x1", 128, 128, 64, 2, 1, 0, TmaEpilogue),
    CONFIG("64x256x64", 64, 256, 64, 1, 1, 0, TmaEpilogue),
    CONFIG("128x64x64", 128, 64, 64, 1, 1, 0, TmaEpilogue),
    PCONFIG("pingpong 128x128x64", 128, 128, 64, 1, 1),
    PCONFIG("pingpong 128x128x64 cluster 2x1", 128, 128, 64, 2, 1),
    PCONFIG("pingpong 128x128x64 cluster 1x2", 128, 128, 64, 1, 2),
    PCONFIG("pingpong 64x256x64", 64, 256, 64, 1, 1),
    PCONFIG("pingpong 128x64x64", 128, 64, 64, 1, 1),
    PCONFIG("pingpong 64x128x64", 64, 128, 64, 1, 1),
    SCONFIG("pingpong 128x128x64 + sums", 128, 128, 64, false, false),
    SCONFIG("pingpong 128x128x64 + residual + sums", 128, 128, 64, true, false),
    CCONFIG("cooperative 128x128x64", 128, 128, 64),
    CCONFIG("cooperative 256x128x64", 256, 128, 64),
    SCONFIG("cooperative 128x128x64 + sums", 128, 128, 64, false, true),
    // The data gradient (NOTES 48: the backward reduction's sums would go in its epilogue), non-persistent and
    // under the persistent ping-pong kernel.
    DCONFIG("dgrad 128x128x64", 128, 128, 64),
    DPCONFIG("dgrad pingpong 128x128x64", 128, 128, 64),
    ACONFIG("dgrad pingpong 128x128x64 + act sums", false),
    ACONFIG("dgrad pingpong 128x128x64 + act sums (bare)", true),  // a measurement (Bare above)
};

extern "C" {
int cutconv_count() { return sizeof(kConfigs) / sizeof(kConfigs[0]); }
const char* cutconv_name(int i) { return kConfigs[i].name; }
int cutconv_stages(int i) { return kConfigs[i].stages(); }
int cutconv_smem(int i) { return kConfigs[i].smem(); }
int cutconv_occupancy(int i) { return kConfigs[i].occupancy(); }
int cutconv_epilogue(int i) { return kConfigs[i].epilogue; }
int cutconv_op(int i) { return kConfigs[i].op; }
int cutconv_fprop(int i, const void* x, const void* w, void* y, const void* res, const float* bias, float* sum,
                  float* sumsq, int n, int h, int wd, int c, int k, void* stream, char* err, int errlen) {
  if (i < 0 || i >= cutconv_count()) {
    snprintf(err, errlen, "config %d: there are %d", i, cutconv_count());
    return 5;
  }
  return kConfigs[i].run({x, w, y, res, bias, sum, sumsq, n, h, wd, c, k}, static_cast<cudaStream_t>(stream), err, errlen);
}
// A dgrad config with the activation's sums (EPI_ACT_SUMS): dy, w, dx as cutconv_fprop's x, w, y; aux, coef, silu,
// seed, thr, pair, inv_keep as Operands says.
int cutconv_dgrad_sums(int i, const void* dy, const void* w, void* dx, const void* aux, const float* coef, float* sum,
                       float* sumsq, int n, int h, int wd, int c, int k, int silu, const int64_t* seed, int thr,
                       int pair, float inv_keep, void* stream, char* err, int errlen) {
  if (i < 0 || i >= cutconv_count()) {
    snprintf(err, errlen, "config %d: there are %d", i, cutconv_count());
    return 5;
  }
  Operands o{dy, w, dx, nullptr, nullptr, sum, sumsq, n, h, wd, c, k};
  o.aux = aux;
  o.coef = coef;
  o.silu = silu;
  o.seed = seed;
  o.thr = thr;
  o.pair = pair;
  o.inv_keep = inv_keep;
  return kConfigs[i].run(o, static_cast<cudaStream_t>(stream), err, errlen);
}
}
