// CUTLASS 3's sm90 implicit-GEMM convolution (forward), nothing fused, as a C library that Python calls with torch's
// pointers and stream (benchmarks/speed/conv_cutlass.py builds and loads it; NOTES 46 step 1).
//
// The GEMM: M = the output pixels (N*P*Q, im2col TMA loads of the NHWC input: the padding is TMA's zero fill, a tile
// may span samples), N = the output channels, K = 9 taps x Cin (weights KRSC, TMA tiled loads). One producer warp
// group feeds a ring of shared-memory stages, one consumer warp group issues wgmma from shared memory, then runs the
// epilogue. CUTLASS 4.2's sm90 convolutions have only this (non-persistent) schedule, so a config is a tile shape, a
// cluster shape, a stage count and an epilogue (kConfigs).
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

using namespace cute;

// Stages 0: as many as the shared memory holds beside the epilogue's; else that many (fewer: two blocks an SM, one's
// epilogue beside the other's main loop). Epilogue: CUTLASS's choice for these types (registers straight to global
// memory), or its TMA warp-specialized one, the one whose visitor trees (EVT) fuse bias, residual and reductions.
template <class TileShape, class ClusterShape, int Stages = 0, class EpilogueSchedule = void>
struct Fprop {
  using Element = cutlass::bfloat16_t;
  static constexpr int Align = 8;  // 16 bytes of bf16: channels a multiple of 8
  using Layout = cutlass::layout::TensorNHWC;
  static constexpr cutlass::conv::Operator Op = cutlass::conv::Operator::kFprop;

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

  // 0 when launched; else a CUTLASS status or CUDA error, said in err.
  static int run(const void* x, const void* w, void* y, int n, int h, int wd, int c, int k, cudaStream_t stream,
                 char* err, int errlen) {
    Problem problem(cutlass::conv::Mode::kCrossCorrelation, {n, h, wd, c}, {k, 3, 3, c}, {1, 1}, {1, 1}, {1, 1},
                    {1, 1}, 1);
    typename Kernel::StrideD stride_d;
    cute::for_each(cute::make_seq<cute::rank<0>(typename Kernel::StrideD{})>{}, [&](auto i) {
      cute::get<0, i>(stride_d) = problem.stride_C[Problem::RankT - 2 - i];
    });
    typename Conv::Arguments args{
        problem,
        {static_cast<const Element*>(x), static_cast<const Element*>(w)},
        {{1.0f, 0.0f}, nullptr, typename Kernel::StrideC{}, static_cast<Element*>(y), stride_d}};
    if (Conv::can_implement(args) != cutlass::Status::kSuccess) {
      snprintf(err, errlen, "CUTLASS cannot implement n=%d h=%d w=%d c=%d k=%d with this config", n, h, wd, c, k);
      return 1;
    }
    if (Conv::get_workspace_size(args) != 0) {
      snprintf(err, errlen, "this config asks for a workspace (%zu bytes); none is passed",
               Conv::get_workspace_size(args));
      return 2;
    }
    // The shared-memory attribute once, outside any CUDA-graph capture (the first call is never captured: the
    // benchmark checks each config's answer before timing it).
    static int blocks_per_sm = Conv::maximum_active_blocks();
    if (blocks_per_sm <= 0) {
      snprintf(err, errlen, "no block fits an SM (%d bytes of shared memory)", smem_bytes());
      return 3;
    }
    auto params = Kernel::to_underlying_arguments(args, nullptr);
    if (Conv::run(params, stream) != cutlass::Status::kSuccess) {
      snprintf(err, errlen, "launch failed: %s", cudaGetErrorString(cudaGetLastError()));
      return 4;
    }
    return 0;
  }
  static int occupancy() { return Conv::maximum_active_blocks(); }
};

// name, run, stages, shared memory, blocks an SM
struct Config {
  const char* name;
  int (*run)(const void*, const void*, void*, int, int, int, int, int, cudaStream_t, char*, int);
  int (*stages)();
  int (*smem)();
  int (*occupancy)();
};

#define FPROP(M, N, K, CM, CN, ...) Fprop<Shape<_##M, _##N, Shape<_##K>>, Shape<_##CM, _##CN, _1>, ##__VA_ARGS__>
#define CONFIG(name, ...)                                                                                          \
  {name, FPROP(__VA_ARGS__)::run, FPROP(__VA_ARGS__)::stages, FPROP(__VA_ARGS__)::smem_bytes,                   \
   FPROP(__VA_ARGS__)::occupancy}
using TmaEpilogue = cutlass::epilogue::TmaWarpSpecialized;

// The K tile is a tuple (Shape<_64>): it tiles the filter's (C, S, R) mode, C first, as CUTLASS's conv examples do.
// One consumer warp group holds the whole tile's fp32 accumulator: 128 x 128 is 128 registers a thread, the most
// that leaves room for the rest; 64 x 256 the same, 128 x 64 / 64 x 128 half. Clusters of 2 along M share each
// weight tile by TMA multicast; along N, each input tile.
static const Config kConfigs[] = {
    CONFIG("128x128x64", 128, 128, 64, 1, 1),
    CONFIG("128x128x64 cluster 2x1", 128, 128, 64, 2, 1),
    CONFIG("128x128x64 cluster 1x2", 128, 128, 64, 1, 2),
    CONFIG("64x256x64", 64, 256, 64, 1, 1),
    CONFIG("64x256x64 cluster 2x1", 64, 256, 64, 2, 1),
    CONFIG("128x64x64", 128, 64, 64, 1, 1),
    CONFIG("64x128x64", 64, 128, 64, 1, 1),
    CONFIG("128x128x32", 128, 128, 32, 1, 1),
    CONFIG("128x128x64 3 stages", 128, 128, 64, 1, 1, 3),
    CONFIG("128x64x64 4 stages", 128, 64, 64, 1, 1, 4),
    CONFIG("128x128x64 TMA epilogue", 128, 128, 64, 1, 1, 0, TmaEpilogue),
    CONFIG("128x128x64 3 stages TMA epilogue", 128, 128, 64, 1, 1, 3, TmaEpilogue),
};

extern "C" {
int cutconv_count() { return sizeof(kConfigs) / sizeof(kConfigs[0]); }
const char* cutconv_name(int i) { return kConfigs[i].name; }
int cutconv_stages(int i) { return kConfigs[i].stages(); }
int cutconv_smem(int i) { return kConfigs[i].smem(); }
int cutconv_occupancy(int i) { return kConfigs[i].occupancy(); }
int cutconv_fprop(int i, const void* x, const void* w, void* y, int n, int h, int wd, int c, int k, void* stream,
                  char* err, int errlen) {
  if (i < 0 || i >= cutconv_count()) {
    snprintf(err, errlen, "config %d: there are %d", i, cutconv_count());
    return 5;
  }
  return kConfigs[i].run(x, w, y, n, h, wd, c, k, static_cast<cudaStream_t>(stream), err, errlen);
}
}
