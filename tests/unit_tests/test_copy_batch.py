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
