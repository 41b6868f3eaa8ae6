"""Data parallelism without the DDP wrapper: every rank's gradients averaged in one all-reduce after the backward.

    reducer = FlatGradReducer(params, grad_dtype=torch.float32)   # after the process group is up
    loss.backward(); reducer(); optimizer.step()                     # p.grad: the average over the ranks

Why (train.ddp_reduce=flat, benchmarks/NOTES.md item 19): the trainer's backward is one compiled graph, so DDP's
all-reduce cannot overlap it anyway, and DDP's reducer pays for its buckets on every step: each of the 304
gradients of ddpm-cifar10 is copied (and divided) into its bucket by a kernel of its own, because the optimizer sets
the gradients to None and the compiled backward hands back new tensors, then one all-reduce per 25 MB bucket. Here
the gradients go into one buffer in a few batched copy kernels, one all-reduce averages it, and each parameter's
.grad becomes a view of it (no copy back). The compiled model is the one-GPU graph: its compile cache is shared.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from ffcv_ddpm.timing import elapsed_ms, mark


def is_dense(t: torch.Tensor) -> bool:
    """Laid out without gaps or overlaps, so that memory order is a 1-D view (contiguous or channels_last)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides along every dimension longer than 1 (a 1x1 conv's weight has strides (I, 1, I, I) in
    channels_last and (I, 1, 1, 1) contiguous: the same memory order, as autograd's layout contract counts it)."""
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def broadcast_parameters(params: list[torch.Tensor], src: int = 0) -> None:
    """Rank src's weights to every rank, once at the start (what DDP's constructor does): the ranks then stay equal,
    since they apply the same averaged gradients (checked at each checkpoint by check_ranks_agree)."""
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src)


class FlatGradReducer:
    """Averages .grad of `params` over the default process group in one all-reduce of a flat buffer.

    The buffer holds every gradient in its parameter's memory order (channels_last weights included: their
    gradients have the parameter's strides, autograd's layout contract), so each .grad is set back as a view of it
    with the parameter's shape and strides. grad_dtype=bfloat16 all-reduces a bf16 copy (half the bytes; the sum is
    NCCL's in bf16, as DDP's bf16_compress_hook) and writes the average back in fp32.

    Gradients that already are those views (after zero_grad(set_to_none=False), which zeroes them in place, a
    backward accumulates into them: micro-batches, or no set_to_none) are averaged where they lie; the others are
    copied in. Every call checks every gradient (present, laid out as its parameter, not at another's place in the
    buffer) from tensor metadata alone: no host-device sync.

    Each all-reduce is timed (CUDA events, no sync; the last 4,096 kept): take_ms() after the caller's sync. A rank
    that reaches the all-reduce early waits in it for the last one, so the ranks' times, side by side, show who
    sets the pace and how long the others wait (benchmarks/NOTES.md item 21)."""

    def __init__(self, params: list[torch.Tensor], grad_dtype: torch.dtype = torch.float32):
        bad = [tuple(p.shape) for p in params if not is_dense(p)]
        if bad:
            raise ValueError(f"FlatGradReducer needs dense parameters (contiguous or channels_last); got strided ones "
                             f"of shapes {bad[:3]}")
        self.params = params
        self.numels = [p.numel() for p in params]
        self.world = dist.get_world_size()
        # NCCL averages in the all-reduce itself; gloo has no AVG: sum, then one division of the buffer.
        self.op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
        first = params[0]
        self.flat = torch.empty(sum(self.numels), dtype=first.dtype, device=first.device)
        self.wire = self.flat if grad_dtype == first.dtype else torch.empty_like(self.flat, dtype=grad_dtype)
        self.views = []
        offset = 0
        for p, n in zip(params, self.numels):
            self.views.append(self.flat[offset:offset + n].as_strided(p.shape, p.stride()))
            offset += n
        # Where each view starts and how it is strided, and the buffer's address range: the per-call checks compare
        # numbers, not tensors.
        self.places = [(v.data_ptr(), v.stride()) for v in self.views]
        self.span = (self.flat.data_ptr(), self.flat.data_ptr() + self.flat.numel() * self.flat.element_size())
        self.cuda = first.device.type == "cuda"
        self.marks: deque = deque(maxlen=4096)

    def take_ms(self) -> list[float]:
        """The all-reduces' milliseconds since the last take (on CUDA: call after a sync, as at a log interval)."""
        out = [elapsed_ms(a, b, self.cuda) for a, b in self.marks]
        self.marks.clear()
        return out

    def outside(self, grads: list) -> list[int]:
        """The indices of the gradients to copy into the buffer (those not already at their place in it); a
        RuntimeError (one line) for a missing gradient, one laid out unlike its parameter, or one inside the buffer
        at another place. Metadata only (addresses, strides): cheap enough for every call, and no sync."""
        missing, odd, misplaced, copy = [], [], [], []
        low, high = self.span
        for i, (g, view, (ptr, stride)) in enumerate(zip(grads, self.views, self.places)):
            if g is view:
                continue  # the view this reducer set, accumulated into in place
            if g is None:
                missing.append(i)
                continue
            at = g.data_ptr()
            laid_out = g.stride() == stride or same_layout(g, view)  # the second only where strides differ
            if at == ptr and laid_out:
                continue  # another tensor over its own place in the buffer
            if low <= at < high:
                misplaced.append(i)
            elif not laid_out:
                odd.append(i)
            else:
                copy.append(i)

        def shapes(idx: list[int]) -> list[tuple]:
            return [tuple(self.params[i].shape) for i in idx[:3]]

        if missing:
            raise RuntimeError(f"no gradient for {len(missing)} parameter(s) (shapes {shapes(missing)}): every "
                               f"parameter must take part in the loss, as with DDP's find_unused_parameters=False")
        if odd:
            raise RuntimeError(f"gradients laid out unlike their parameters (shapes {shapes(odd)})")
        if misplaced:
            raise RuntimeError(f"{len(misplaced)} gradient(s) (shapes {shapes(misplaced)}) lie in the flat "
                               f"all-reduce's buffer at another parameter's place: set .grad to None or to a tensor "
                               f"of its own, not to a view of another gradient")
        return copy

    def __call__(self) -> None:
        grads = [p.grad for p in self.params]
        copy = self.outside(grads)
        if len(copy) == len(grads):
            # Memory order, as a 1-D view: dense in the parameter's layout (checked above). Into the fp32 buffer:
            # CUDA's cat copies in batches of inputs only when the output has their dtype (else one per input).
            torch.cat([g.as_strided((n,), (1,)) for g, n in zip(grads, self.numels)], out=self.flat)
        else:  # some already lie in the buffer (cat cannot write over its own inputs): the others one by one
            for i in copy:
                self.views[i].copy_(grads[i])
        if self.wire is not self.flat:
            self.wire.copy_(self.flat)
        start = mark(self.cuda)
        dist.all_reduce(self.wire, op=self.op)  # NCCL: ordered on the GPU after the cat, no host wait
        self.marks.append((start, mark(self.cuda)))
        if self.op == dist.ReduceOp.SUM:
            self.wire.div_(self.world)
        if self.wire is not self.flat:
            self.flat.copy_(self.wire)
        for p, view in zip(self.params, self.views):
            p.grad = view
