"""CopyBatch: dense same-dtype floating pairs go to one foreach call per dtype, the rest (strided, integer,
LARGE) one by one; finite_flags: one flag per tensor, in order, whichever reduction checked it."""

import pytest
import torch

from megatron_ext.copies import LARGE, CopyBatch, finite_flags


def _pairs(device):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 48, generator=g).to(device, torch.bfloat16)
    pairs = [
        (torch.empty(37, device=device, dtype=torch.bfloat16), torch.randn(37, generator=g).to(device, torch.bfloat16))
        for _ in range(20)
    ]
    pairs.append((torch.empty(5, 3, device=device), torch.randn(5, 3, generator=g).to(device)))  # fp32
    strided = torch.empty(64, 96, device=device, dtype=torch.bfloat16)
    pairs.append((strided[:, 48:], big))  # strided destination
    pairs.append((torch.empty(4, device=device, dtype=torch.int64), torch.arange(4, device=device)))  # integer
    large = torch.randn(LARGE, generator=g).to(device, torch.bfloat16)
    pairs.append((torch.empty_like(large), large))  # a copy of its own
    return pairs


def test_groups_and_exact_copies():
    pairs = _pairs("cpu")
    batch = CopyBatch(pairs)
    assert [len(d) for d, _ in batch.groups] == [20, 1] and len(batch.single) == 3 and len(batch) == len(pairs)
    batch.run()
    for dst, src in pairs:
        assert torch.equal(dst, src)


@pytest.mark.gpus(1)
def test_dense_pairs_take_one_multi_tensor_kernel_on_gpu():
    """Profiler kernel names: the 20 dense bf16 pairs are one multi-tensor launch, not 20 memcpys."""
    pairs = _pairs("cuda")
    batch = CopyBatch(pairs)
    batch.run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        batch.run()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("multi_tensor_apply" in k for k in kernels) == 2, kernels  # bf16 group, fp32 group
    assert len(kernels) <= 2 + 3 + 1, kernels  # + the strided, integer and large copies (+ slack for one helper)
    for dst, src in pairs:
        assert torch.equal(dst, src)


def test_finite_flags_name_each_tensor_in_order():
    """Small tensors share one multi-tensor reduction, LARGE ones get their own; a NaN or Inf anywhere in
    either kind (here the last element of a large one) flags exactly that tensor; integers are not checked."""
    tensors = [torch.ones(LARGE + 1, dtype=torch.bfloat16), torch.ones(7, dtype=torch.bfloat16)]
    tensors += [torch.ones(LARGE), torch.ones(3), torch.arange(4), torch.ones(LARGE, dtype=torch.bfloat16)]
    tensors[0][-1] = float("nan")
    tensors[3][1] = float("-inf")
    flags = {i: bool(f) for idx, fl in finite_flags(tensors) for i, f in zip(idx, fl.tolist())}
    assert flags == {0: False, 1: True, 2: True, 3: False, 5: True}


@pytest.mark.gpus(1)
def test_cuda_finite_check_is_one_kernel_per_dtype_and_flags_exactly_the_bad_tensors():
    """On CUDA the contiguous tensors of a dtype are read by one Triton kernel (``nonfinite`` in the
    profiler); its flags must be the PyTorch path's (the CPU run of the same tensors) with NaN / Inf at a
    tensor's first element, last element and at a chunk boundary (element 65536), in tensors of one
    element, of chunks and a ragged tail, of more than LARGE elements; a strided view takes the fallback."""
    sizes = [1, 1023, 1 << 16, (1 << 16) + 1, 3 * (1 << 16) + 5, LARGE + 7]
    tensors = [torch.ones(n, dtype=dtype) for dtype in (torch.bfloat16, torch.float32, torch.float16) for n in sizes]
    bad_at = {1: (0, float("nan")), 3: (1 << 16, float("inf")), 5: (LARGE + 6, float("-inf"))}
    bad_at.update({9: (1 << 16, float("nan")), 10: (4, float("nan")), 17: (LARGE + 6, float("nan"))})
    for i, (pos, value) in bad_at.items():
        tensors[i][pos] = value
    strided = torch.ones(64, 48, dtype=torch.bfloat16)
    strided[3, 40] = float("nan")
    misaligned = torch.ones(LARGE + 9, dtype=torch.bfloat16)[1:]  # contiguous, 2 bytes past an aligned start
    misaligned[-1] = float("inf")
    tensors += [strided[:, 32:], misaligned, torch.arange(5)]  # fallbacks, and an integer tensor (not checked)
    n = len(tensors)
    want = {i: bool(f) for idx, fl in finite_flags(tensors) for i, f in zip(idx, fl.tolist())}
    assert want == {i: i not in bad_at and i < n - 3 for i in range(n - 1)}
    cuda = [t.cuda() for t in tensors[:-2]] + [torch.ones(LARGE + 9, dtype=torch.bfloat16, device="cuda")[1:]]
    cuda[-1][-1] = float("inf")
    cuda.append(tensors[-1].cuda())
    assert cuda[-2].data_ptr() % 16 == 2
    finite_flags(cuda)  # compiled outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = {i: bool(f) for idx, fl in finite_flags(cuda) for i, f in zip(idx, fl.tolist())}
    assert got == want
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("nonfinite" in k for k in kernels) == 3, kernels  # bf16, fp32, fp16
