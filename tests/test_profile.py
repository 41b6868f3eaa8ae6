"""benchmarks.speed.profile on CPU: op classes from real kernel names, the CUDA analysis on synthetic events, the
telemetry A/B run with a fake trainer, and the whole command on the tiny preset (trace, tables, charts, summary)."""

import gzip
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import Interval, Kernel

from benchmarks.speed import profile
from benchmarks.speed.profile import telemetry_run
from benchmarks.speed.profile_analysis import CLASSES, analyse, class_lines, classify, top_ops_lines

# Kernel and op names as torch.profiler reports them on H100/A100 runs (cuDNN 9, FlashAttention-2, inductor).
NAMES = {
    "convolution fwd": [
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1"
        "_execute_segment_k_off_kernel__5x_cudnn",
        "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_128x128_32x5_nhwc_align8>"
        "(cutlass_tensorop_bf16_s16816fprop_optimized_bf16_128x128_32x5_nhwc_align8::Params)",
        "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int, float "
        "const*, int, float*, float const*, kernel_conv_params, unsigned long long, int, float, float, int, float "
        "const*, float const*, bool, int, int)",
        "aten::cudnn_convolution", "aten::mkldnn_convolution", "triton_tem_fused_convolution_0",
    ],
    "convolution bwd": [
        "sm80_xmma_dgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x64x64_stage5_warpsize"
        "2x2x1_g1_tensor16x8x16_kernel",
        "void cudnn::cnn::dgrad2d_grouped_direct_kernel<float, int, float, float, true, false, 0, 1, 2>(cudnn::cnn::"
        "GroupedDirectFpropParams, float const*, float const*, float*, float, float, cudnnActivationStruct)",
        "sm90_xmma_wgrad_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1",
        "void cudnn::cnn::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, 512>(int, int, int, float const*, int, "
        "float*, float const*, kernel_grad_params, unsigned long long, int, float, int, int, int, int)",
        "aten::convolution_backward", "autograd::engine::evaluate_function: ConvolutionBackward0",
    ],
    "attention": [
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 256>(void const*, void const*, float*, int, int, int)",
        "void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned int)",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::"
        "bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, false, false, false, true, "
        "true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 4, "
        "2, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >, "
        "false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
        "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "aten::_scaled_dot_product_flash_attention", "triton_per_fused__softmax_3",
    ],
    "normalization": [
        "triton_red_fused_native_group_norm_0",
        "triton_per_fused_add_native_group_norm_silu_12",
        "triton_red_fused_native_group_norm_backward_7",
        "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float, float>(long, float, float const*, "
        "float*, float*)",
        "aten::native_group_norm", "aten::native_group_norm_backward",
        "autograd::engine::evaluate_function: NativeGroupNormBackward0",
    ],
    "elementwise/activation": [
        "triton_poi_fused_add_convolution_silu_3",  # names a convolution, but only adds its bias: not a conv kernel
        "triton_poi_fused_mul_silu_silu_backward_5",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::"
        "{lambda()#1}::operator()() const::{lambda()#8}::operator()() const::{lambda(float)#1}, at::detail::Array"
        "<char*, 2> >(int, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}, "
        "at::detail::Array<char*, 2>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
        "float>, unsigned int, float, 4, 4>)",
        "aten::silu", "aten::add_", "aten::mse_loss", "autograd::engine::evaluate_function: SiluBackward0",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::"
        "ADAM_MODE)1, false>, double, double, double, double, double, double, bool, double*, double*>("
        "at::native::(anonymous namespace)::TensorListMetadata<4>, ...)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous "
        "namespace)::NormType)1, float, float>, float*, int>(at::native::(anonymous namespace)::TensorListMetadata<1>"
        ", at::native::(anonymous namespace)::LpNormFunctor<float, (at::native::(anonymous namespace)::NormType)1, "
        "float, float>, float*, int)",
        "aten::_fused_adamw_", "aten::_foreach_lerp_", "Optimizer.step#AdamW.step",
    ],
    "data/copies": [
        "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoD (Device -> Device)", "Memset (Device)",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
        "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::"
        "operator()() const::{lambda(float)#1}>(at::TensorIteratorBase&, ...)::{lambda(int)#1}>(int, ...)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2>"
        ", unsigned int, 4, 64, 64>(...)",
        "void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true, "
        "(cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nchw2nhwc_params_t<float>, __nv_bfloat16 const*, "
        "__nv_bfloat16*)",
        "triton_poi_fused__to_copy_2", "triton_poi_fused_cat_4", "aten::copy_", "aten::to", "data: next batch",
    ],
    "matmul (gemm)": [
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(cutlass_80_wmma"
        "_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8::Params)",
        "ampere_sgemm_128x64_nn", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
        "aten::addmm", "aten::bmm", "triton_tem_fused_mm_1",
        "autograd::engine::evaluate_function: AddmmBackward0",
    ],
    "communication": [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWork*)", "c10d::allreduce_", "nccl:all_reduce",
    ],
    "other": ["cudaLaunchKernel", "aten::empty_strided", "aten::view", "ProfilerStep*"],
}


@pytest.mark.parametrize("cls", sorted(NAMES))
def test_kernel_and_op_names_classify(cls):
    for name in NAMES[cls]:
        assert classify(name) == cls, name


def test_context_decides_what_a_generic_kernel_is():
    gemm = "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"
    # cuDNN runs some 1x1 convolutions as plain GEMMs; the op that launched it says it is a convolution.
    assert classify(gemm, ["ProfilerStep*", "aten::conv2d", "aten::convolution", "aten::cudnn_convolution"]) == (
        "convolution fwd")
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, ...>"
    assert classify(add, ["Optimizer.step#AdamW.step", "aten::add_"]) == "optimizer"
    assert classify("aten::add_", ["autograd::engine::evaluate_function: NativeGroupNormBackward0"]) == (
        "normalization")
    assert classify("aten::randperm", ["data: next batch"]) == "data/copies"
    # A specific kernel name beats its context; wrappers of compiled code say nothing.
    assert classify("triton_red_fused_native_group_norm_0", ["CompiledFunction", "## Call CompiledFxGraph f1 ##"]) \
        == "normalization"
    assert set(CLASSES) >= set(NAMES)


def _ev(name, start, end, device=DeviceType.CPU, parent=None, self_cpu=None):
    return SimpleNamespace(name=name, device_type=device, time_range=Interval(start, end), cpu_parent=parent,
                           is_async=False, is_user_annotation=False, kernels=[],
                           self_cpu_time_total=(end - start) if self_cpu is None else self_cpu,
                           cpu_time_total=end - start, self_device_time_total=0.0)


def _launch(op, kernel):
    """What the profiler does for each kernel: file it (name, device, duration) under the op that launched it."""
    op.kernels.append(Kernel(kernel.name, 0, kernel.time_range.elapsed_us()))
    op.self_device_time_total += kernel.time_range.elapsed_us()
    return kernel


def _cuda_events():
    """Two 1 ms steps as torch.profiler reports them on CUDA: each launches a conv (one cuDNN kernel, one GEMM),
    its backward, a fused AdamW under Optimizer.step, and a Triton kernel; the GPU idles 0.1 ms between them."""
    cuda = DeviceType.CUDA
    events = []
    for s in range(2):
        t = 1000.0 * s
        step = _ev("ProfilerStep*", t, t + 1000, self_cpu=50)
        conv = _ev("aten::convolution", t + 10, t + 60, parent=step, self_cpu=10)
        cudnn = _ev("aten::cudnn_convolution", t + 20, t + 50, parent=conv)
        bwd = _ev("aten::convolution_backward", t + 60, t + 100, parent=step)
        opt = _ev("Optimizer.step#AdamW.step", t + 100, t + 150, parent=step, self_cpu=20)
        adam = _ev("aten::_fused_adamw_", t + 110, t + 140, parent=opt)
        events += [step, conv, cudnn, bwd, opt, adam, _ev("cudaLaunchKernel", t + 30, t + 35, parent=cudnn)]
        events += [
            _launch(cudnn, _ev("sm90_xmma_fprop_implicit_gemm_bf16", t + 50, t + 350, cuda)),
            _launch(cudnn, _ev("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", t + 350, t + 450, cuda)),  # conv as GEMM
            _launch(bwd, _ev("sm90_xmma_dgrad_implicit_gemm_bf16", t + 450, t + 750, cuda)),
            _launch(adam, _ev("multi_tensor_apply_kernel<FusedAdamMathFunctor>", t + 750, t + 850, cuda)),
            _ev("triton_poi_fused_add_convolution_silu_0", t + 850, t + 950, cuda),  # launched outside any aten op
        ]
    return events


def test_analysis_of_cuda_events():
    a = analyse(_cuda_events())
    assert a["steps"] == 2 and a["basis"] == "GPU kernel time" and a["cpu_step_ms"] == pytest.approx(1.0)
    g = a["gpu"]
    assert g["span_ms_per_step"] == pytest.approx(0.95)  # first kernel at 50 us, last ends at 1950 us
    assert g["busy_ms_per_step"] == pytest.approx(0.9) and g["idle_share"] == pytest.approx(0.1 / 1.9)  # one gap
    cls = {c["class"]: c for c in a["classes"]}
    assert cls["convolution fwd"]["ms_per_step"] == pytest.approx(0.4)  # cuDNN 0.3 + the GEMM it launched 0.1
    assert cls["convolution bwd"]["ms_per_step"] == pytest.approx(0.3)
    assert cls["optimizer"]["ms_per_step"] == pytest.approx(0.1)
    assert cls["elementwise/activation"]["ms_per_step"] == pytest.approx(0.1)
    assert sum(c["pct_of_total"] for c in a["classes"]) == pytest.approx(100)
    assert cls["convolution fwd"]["pct_of_step"] == pytest.approx(100 * 0.4 / 0.95)
    k = a["top_kernels"]
    assert [r["name"][:20] for r in k[:2]] == ["sm90_xmma_fprop_impl", "sm90_xmma_dgrad_impl"]
    assert k[0]["calls_per_step"] == 1 and k[0]["launched_by"] == "aten::cudnn_convolution"
    assert next(r for r in k if r["name"].startswith("nvjet"))["class"] == "convolution fwd"
    assert next(r for r in k if r["name"].startswith("triton"))["launched_by"] == "-"
    assert sum(r["pct_of_step"] for r in k) <= 100
    ops = {r["name"]: r for r in a["top_ops"]}
    assert a["top_ops"][0]["name"] == "aten::cudnn_convolution" and ops["aten::cudnn_convolution"]["self_cuda_ms"] == (
        pytest.approx(0.4))
    assert ops["aten::_fused_adamw_"]["class"] == "optimizer"
    assert "cudaLaunchKernel" in ops and ops["cudaLaunchKernel"]["class"] == "convolution fwd"  # its launcher's


def test_profiler_overhead_events_are_not_gpu_time():
    """CUPTI's "Command Buffer Full" shows up as a device event (and as an op): it must not count as kernel time."""
    events = _cuda_events()
    for s in range(2):
        events.append(_ev("Command Buffer Full", 1000.0 * s + 860, 1000.0 * s + 900, DeviceType.CUDA))
        events.append(_ev("Command Buffer Full", 1000.0 * s + 860, 1000.0 * s + 900))
    a, ref = analyse(events), analyse(_cuda_events())
    assert a["classes"] == ref["classes"] and a["gpu"] == ref["gpu"]
    assert all(r["name"] != "Command Buffer Full" for r in a["top_ops"] + a["top_kernels"])


def test_copies_are_filed_under_the_op_that_asked_for_them():
    """As in the H200 trace: layout copies inside convolution_backward (contiguous -> clone -> copy_) and an
    autocast cast (to -> _to_copy -> copy_) in the forward; each copy kernel under the op that wanted it."""
    cuda = DeviceType.CUDA
    events = []
    for s in range(2):
        t = 1000.0 * s
        step = _ev("ProfilerStep*", t, t + 1000)
        graph = _ev("## Call CompiledFxGraph f1 ##", t + 10, t + 500, parent=step)
        bwd = _ev("aten::convolution_backward", t + 20, t + 200, parent=graph)
        events += [step, graph, bwd]
        for i in range(2):  # two layout copies in this backward
            contiguous = _ev("aten::contiguous", t + 30 + 50 * i, t + 70 + 50 * i, parent=bwd)
            clone = _ev("aten::clone", t + 31 + 50 * i, t + 69 + 50 * i, parent=contiguous)
            copy = _ev("aten::copy_", t + 32 + 50 * i, t + 68 + 50 * i, parent=clone)
            events += [contiguous, clone, copy,
                       _launch(copy, _ev("elementwise_kernel<128, 4>", t + 100 + 200 * i, t + 300 + 200 * i, cuda))]
        to = _ev("aten::to", t + 600, t + 650, parent=step)
        to_copy = _ev("aten::_to_copy", t + 601, t + 649, parent=to)
        copy = _ev("aten::copy_", t + 602, t + 648, parent=to_copy)
        events += [to, to_copy, copy, _launch(copy, _ev("elementwise_kernel<128, 4>", t + 700, t + 750, cuda))]
    rows = analyse(events)["copies"]
    assert [(r["caller"], r["via"]) for r in rows] == [("aten::convolution_backward", "aten::contiguous"),
                                                       ("ProfilerStep*", "aten::to")]
    assert [r["calls_per_step"] for r in rows] == [2, 1]
    assert [r["ms_per_step"] for r in rows] == [pytest.approx(0.4), pytest.approx(0.05)]
    lines = "\n".join(top_ops_lines(analyse(events)))
    assert "Where the copies come from" in lines and "`aten::convolution_backward` | `aten::contiguous` | 2" in lines


def test_analysis_needs_profiler_steps():
    with pytest.raises(RuntimeError, match="ProfilerStep"):
        analyse([e for e in _cuda_events() if not e.name.startswith("ProfilerStep")])


class FakeTrainer:
    def __init__(self):
        self.steps = 0

    def step(self, images, labels, lr):
        self.steps += 1
        return images.float().mean()


class Counter:
    """An endless scripted GPU whose energy counter grows 50 J between reads (start/stop of each block)."""

    name, power_kind = "Scripted GPU", "scripted"

    def __init__(self):
        self.energy = 0.0

    def read(self):
        return {"power_w": 300.0, "gpu_util_pct": 99, "mem_used_gib": 12.0}

    def energy_j(self):
        self.energy += 50.0
        return self.energy

    def close(self):
        pass


def _batches():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g), torch.zeros(4, dtype=torch.long)


def test_telemetry_run_alternates_blocks_and_gives_j_per_img(tmp_path):
    trainer = FakeTrainer()
    t = telemetry_run(trainer, _batches(), 0.0, torch.device("cpu"), batch=4, steps=3, rounds=2,
                      path=tmp_path / "telemetry.jsonl", interval_s=0.01, source_factory=Counter)
    assert trainer.steps == 2 * 2 * 3 and t["enabled"]
    assert t["images"] == 2 * 3 * 4 and t["energy_j"] == pytest.approx(2 * 50.0)
    assert t["j_per_img"] == pytest.approx(100.0 / 24) and t["energy_source"] == "nvml_counter"
    assert t["mean_power_w"] == pytest.approx(300.0) and t["max_mem_used_gib"] == 12.0
    assert len(t["overhead_ratio_per_round"]) == 2 and t["overhead_ratio"] > 0
    assert (tmp_path / "telemetry.jsonl").read_text().count("\n") >= 4  # both sampled blocks appended to one file
    lines = profile.telemetry_lines(t)
    assert any("overhead ratio" in x for x in lines) and any("J/img" in x for x in lines)


def test_telemetry_run_without_a_gpu_times_the_unsampled_blocks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("ffcv_ddpm.telemetry.NvmlSource", _no_nvml)
    trainer = FakeTrainer()
    t = telemetry_run(trainer, _batches(), 0.0, torch.device("cpu"), batch=4, steps=2, rounds=2,
                      path=tmp_path / "t.jsonl", interval_s=0.1)
    assert capsys.readouterr().out.count("no NVIDIA GPU: telemetry off (NVML not usable: test)") == 1
    assert not t["enabled"] and trainer.steps == 4 and t["ms_per_step_off"] > 0 and "overhead_ratio" not in t
    assert not (tmp_path / "t.jsonl").exists()


def _no_nvml(index):
    raise RuntimeError("NVML not usable: test")


@pytest.mark.cpu_only
def test_profile_command_on_the_tiny_preset(small_dataset, tmp_path, capsys):
    out = tmp_path / "profile"
    # model.norm_impl=torch: nn.GroupNorm's ops say "group_norm"; the scale-shift default is var_mean + elementwise
    # ops, which no name marks as a normalization on the CPU.
    rc = profile.main(["--preset", "tiny", "--data", str(small_dataset), "data.batch_size=8", "data.loader=gpu",
                       "train.precision=fp32", "model.norm_impl=torch", "--iters", "2", "--warmup", "2",
                       "--telemetry-iters", "2",
                       "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "no NVIDIA GPU: telemetry off" in printed or "telemetry overhead ratio" in printed
    with gzip.open(out / "trace.json.gz", "rt") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert len(trace["traceEvents"]) > 100 and "aten::convolution_backward" in names and "data: next batch" in names
    tops = json.loads((out / "top_ops.json").read_text())["top_ops"]
    assert 1 <= len(tops) <= 10 and tops[0]["self_cpu_ms"] > 0
    assert 0 < sum(r["pct_of_step"] for r in tops) <= 100
    s = json.loads((out / "summary.json").read_text())
    a = s["profile"]
    assert a["steps"] == 2 and a["gpu"] is None and s["environment"]["torch"] == torch.__version__
    classes = {c["class"]: c["pct_of_total"] for c in a["classes"]}
    assert sum(classes.values()) == pytest.approx(100) and sum(c["pct_of_step"] for c in a["classes"]) <= 100
    for cls in ("convolution fwd", "convolution bwd", "normalization", "attention", "optimizer", "data/copies"):
        assert classes[cls] > 0, cls  # the tiny UNet has all of these, and the loader has a named region
    assert s["telemetry"]["ms_per_step_off"] > 0 and s["dataset"]["synthetic"] is True
    md = (out / "profile.md").read_text()
    assert "| 1 | `" in md and "### Time by op class" in md and "% of step" in md
    assert "| convolution bwd |" in (out / "op_classes.md").read_text()
    for png in ("top_ops.png", "op_classes.png"):
        assert (out / png).stat().st_size > 10_000
    # The saved trace analysed again (no run): the same steps and the same split by class as the live analysis.
    assert profile.main(["--from-trace", str(out / "trace.json.gz")]) == 0
    again = json.loads((out / "reanalysis.json").read_text())
    assert again["steps"] == a["steps"] and again["gpu"] is None
    live = {c["class"]: c["ms_per_step"] for c in a["classes"]}
    for c in again["classes"]:
        assert c["ms_per_step"] == pytest.approx(live[c["class"]], rel=0.05, abs=0.05), c["class"]
    assert "Where the copies come from" in (out / "reanalysis.md").read_text()


def test_profile_cli_errors(tmp_path, capsys):
    assert profile.main(["--preset", "nope", "--data", str(tmp_path / "x.beton")]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert profile.main(["--preset", "tiny", "--data", str(tmp_path / "x.beton")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert profile.main(["--preset", "tiny", "data.batch_sise=4"]) == 2
    assert "no field 'batch_sise'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # refused by the parser, as every out-of-range option is
        profile.main(["--preset", "tiny", "--iters", "0", "--data", str(tmp_path / "x.beton")])
    assert e.value.code == 2 and "--iters" in capsys.readouterr().err
    assert profile.main(["--from-trace", str(tmp_path / "none.json.gz")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "bad.json.gz").write_bytes(gzip.compress(b"{not json"))
    assert profile.main(["--from-trace", str(tmp_path / "bad.json.gz")]) == 2
    assert "not a readable Chrome trace" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- sweeps


def _keys(overrides):
    return {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides}


@pytest.mark.parametrize("cuda", [True, False])
def test_sweep_rows_start_from_the_trainer_defaults_and_change_only_the_swept_setting(cuda):
    from benchmarks.speed.sweeps import DEFAULTS, NOTE, SWEEPS
    from ffcv_ddpm.config import load_config

    assert DEFAULTS == () and "trainer's defaults" in NOTE
    swept = {"batch": set(), "amp-compile": {"train.precision", "train.compile"},
             "workers": {"data.loader", "data.flip", "data.num_workers"}}
    for name, sweep in SWEEPS.items():
        rows = sweep.rows("tiny", ("data.loader=torch-memory",), cuda)
        assert len(rows) >= 2 and [r.baseline for r in rows] == [True] + [False] * (len(rows) - 1)
        assert len({r.name for r in rows}) == len(rows) and all(isinstance(r.batch, int) for r in rows)
        for row in rows:
            load_config(row.preset, list(row.overrides))
            assert set(_keys(row.overrides)) <= swept[name], (row.name, row.overrides)
    if not cuda:  # what a CPU cannot run is not in its rows
        assert all("fp16" not in r.name for r in SWEEPS["amp-compile"].rows("tiny", ("data.loader=x",), False))


def _sweep_result():
    def row(name, precision, compile_, ms, ok=True):
        cfg = {"train": {"precision": precision, "compile": compile_}, "data": {"num_workers": 0, "loader": "gpu"}}
        raw = {"batch_size": 256, "precision": precision, "iter_ms": [ms] * 4, "wait_ms": [0.0] * 4,
               "first_step_s": 1.0, "peak_mem_bytes": 3 * 2**30}
        return {"name": name, "group": "tiny", "preset": "tiny", "baseline": name == "fp32, eager", "status":
                "ok" if ok else "failed", "error": None if ok else "out of memory", "raw": raw if ok else None,
                "config": cfg if ok else None, "overrides": []}

    return {"table": "sweep-amp-compile", "device_name": "NVIDIA H100 80GB HBM3", "environment": {"torch": "2.x"},
            "flops": {}, "measured_peaks": None,
            "rows": [row("fp32, eager", "fp32", False, 100.0), row("bf16, eager", "bf16", False, 50.0),
                     row("fp32, compile", "fp32", True, 80.0), row("bf16, compile", "bf16", True, 25.0),
                     row("fp16, compile", "fp16", True, 0, ok=False)]}


def test_sweep_curve_from_a_result(tmp_path):
    from benchmarks.speed.report import add_metrics
    from benchmarks.speed.sweeps import SWEEPS, plot_sweep

    result = add_metrics(_sweep_result())
    assert result["rows"][3]["metrics"]["img_per_s"] == pytest.approx(256 / 0.025)
    assert result["rows"][3]["metrics"]["speedup"] == pytest.approx(4.0)
    png = plot_sweep(result, SWEEPS["amp-compile"], tmp_path / "curve.png")
    assert png.stat().st_size > 10_000


def test_sweeps_command_runs_a_row_through_bench(small_dataset, tmp_path, capsys):
    from benchmarks.speed import sweeps

    assert sweeps.main(["--sweep", "nope"]) == 2 and "unknown sweep nope" in capsys.readouterr().err
    out = tmp_path / "sweeps"
    rc = sweeps.main(["--sweep", "batch", "--preset", "tiny", "--data", str(small_dataset), "--rows", "1",
                      "--iters", "2", "--warmup", "0", "--out", str(out)])
    assert rc == 0, capsys.readouterr().out[-3000:]
    result = json.loads((out / "sweep-batch-tiny.json").read_text())
    assert result["table"] == "sweep-batch" and len(result["rows"]) == 1
    row = result["rows"][0]
    assert row["status"] == "ok" and row["raw"]["batch_size"] == row["config"]["data"]["batch_size"]
    assert row["metrics"]["img_per_s"] > 0 and row["config"]["train"]["precision"] == "bf16"
    assert row["config"]["data"]["loader"] == "ffcv"  # the trainer's default loader: the sweep starts there...
    assert "starts from the trainer's defaults" in (out / "sweep-batch-tiny.md").read_text()  # ...and says so
    assert (out / "sweep-batch-tiny-curve.png").stat().st_size > 10_000


def test_communication_overlapped_by_compute_is_not_exposed():
    """DDP's all-reduce runs on NCCL's stream beside the backward: only the part with no compute kernel beside it
    adds to the step (here 0.1 ms of its 0.3 ms in each 1 ms step)."""
    cuda = DeviceType.CUDA
    events = []
    for s in range(2):
        t = 1000.0 * s
        events += [_ev("ProfilerStep*", t, t + 1000),
                   _ev("sm90_xmma_dgrad_implicit_gemm_bf16", t, t + 600, cuda),
                   _ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 400, t + 700, cuda),
                   _ev("multi_tensor_apply_kernel<FusedAdamMathFunctor>", t + 700, t + 900, cuda)]
    a = analyse(events)
    g = a["gpu"]
    assert g["comm_ms_per_step"] == pytest.approx(0.3) and g["comm_exposed_ms_per_step"] == pytest.approx(0.1)
    assert {c["class"]: c["ms_per_step"] for c in a["classes"]}["communication"] == pytest.approx(0.3)
    assert any("communication with no compute beside it" in line for line in class_lines(a))


def test_profile_under_torchrun_profiles_rank_0_of_ddp(small_dataset, tmp_path):
    """Two gloo ranks step together (DDP's all-reduce needs both); rank 0 alone writes the profile."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from ffcv_ddpm.train import NO_MULTICAST

    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST}
    out = tmp_path / "prof"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "benchmarks.speed.profile", "--preset", "tiny", "--data", str(small_dataset), "data.batch_size=8",
           "data.num_workers=1", "data.loader=torch-memory", "train.device=cpu", "--iters", "2", "--warmup", "1",
           "--out", str(out)]  # the dataset in memory: FFCV's pipeline would compile in each rank, and is not checked
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"]["world_size"] == 2 and summary["profile"]["steps"] == 2
    assert "per rank x 2 ranks (train.ddp_reduce=flat, rank 0 shown)" in (out / "profile.md").read_text()
    assert proc.stdout.count("profile: wrote") == 1


def test_the_fused_groupnorm_kernels_are_normalization_under_cuda_graphs():
    # Under reduce-overhead the launching op is the whole compiled graph: the kernel's own name must say it (the
    # profile of 26cefa3 filed three of them under "other" and the backward reduction as elementwise). Every Triton
    # kernel of gn_kernels.py, read from the source so that a renamed or new kernel fails here.
    import re
    from pathlib import Path
    source = (Path(__file__).resolve().parents[1] / "ffcv_ddpm" / "gn_kernels.py").read_text()
    kernels = re.findall(r"@triton\.jit\ndef (\w+_kernel)\(", source)
    assert len(kernels) >= 6, kernels
    for name in kernels:
        assert classify(name, ["ProfilerStep*", "## Call CompiledFxGraph f7nj2dk4 ##"]) == "normalization", name
    assert classify("_apply_kernel_of_something_else") != "normalization"  # exact names only


def test_peak_memory_under_cuda_graphs_includes_the_warm_up():
    # 26cefa3 on an H100: "peak memory 0.8 GiB" for a ~19-GiB step under reduce-overhead (the graphs' pool was
    # allocated while recording, before the profiled steps).
    from benchmarks.speed.profile import _peak_text
    s = {"config": {"train": {"compile_mode": "reduce-overhead"}}, "device_name": "NVIDIA H100 80GB HBM3",
         "peak_mem_gib_profiled": 0.8, "peak_mem_gib_incl_warmup": 18.9}
    assert _peak_text(s).startswith("; peak memory 18.9 GiB including the warm-up") and "alone 0.8 GiB" in _peak_text(s)
    s["config"]["train"]["compile_mode"] = "default"
    assert _peak_text(s) == "; peak memory 0.8 GiB"
    del s["peak_mem_gib_incl_warmup"]  # a summary written before the field existed
    s["config"]["train"]["compile_mode"] = "reduce-overhead"
    assert _peak_text(s) == "; peak memory 0.8 GiB"
