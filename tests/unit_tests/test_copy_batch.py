"""CopyBatch: dense same-dtype floating pairs go to one foreach call per dtype, the rest (strided, integer,
LARGE) one by one; finite_flags and FiniteCheck: one flag per tensor, in order, whichever reduction or kernel
checked it."""

import numpy as np
import pytest
import torch

from megatron_ext.copies import LARGE, CopyBatch, FiniteCheck, finite_flags


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


def _cuda_kernels(batch) -> list[str]:
    """The CUDA kernels one run of ``batch`` launches (profiler names), after the runs before it finished."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        batch.run()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return kernels


def test_groups_and_exact_copies():
    pairs = _pairs("cpu")
    batch = CopyBatch(pairs)
    assert [len(d) for d, _ in batch.groups] == [20, 1] and len(batch.single) == 3 and len(batch) == len(pairs)
    batch.run()
    for dst, src in pairs:
        assert torch.equal(dst, src)
    # kernel=True where no kernel runs (CPU): the same groups and copies, nothing checked
    batch = CopyBatch(_pairs("cpu"), kernel=True)
    assert batch.fused == [] and [len(d) for d, _ in batch.groups] == [20, 1] and len(batch.single) == 3
    assert batch.run() is None


@pytest.mark.gpus(1)
def test_dense_pairs_take_one_multi_tensor_kernel_on_gpu():
    """Profiler kernel names: the 20 dense bf16 pairs are one multi-tensor launch, not 20 memcpys."""
    pairs = _pairs("cuda")
    batch = CopyBatch(pairs)
    batch.run()
    kernels = _cuda_kernels(batch)
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


def _checked_pairs(device):
    """Pairs the fused kernel takes (dense, q/k/v-like row blocks of a fused weight, an odd length, an
    unaligned start, fp32 / fp16 / bf16, one longer than a chunk) and ones it leaves to copy_ (a column
    slice: runs of 3 elements; integers, which are not checked)."""
    from megatron_ext.copy_check import CHUNK

    g = torch.Generator().manual_seed(1)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device, dtype)

    fused = rand(4, 6 * 64, 256)
    pairs = [
        (torch.empty(1000, device=device, dtype=torch.bfloat16), rand(1000)),
        (torch.empty(4, 4 * 64, 256, device=device, dtype=torch.bfloat16), fused[:, : 4 * 64]),  # strided source
        (torch.empty(4, 64, 256, device=device, dtype=torch.bfloat16), fused[:, 5 * 64 :]),
        (torch.empty(2 * CHUNK + 77, device=device), rand(2 * CHUNK + 77, dtype=torch.float32)),
        (torch.empty(513, device=device, dtype=torch.float16)[1:], rand(512, dtype=torch.float16)),  # unaligned
        (torch.empty(300, 3, device=device, dtype=torch.bfloat16), rand(300, 8)[:, 2:5]),  # runs of 3: copy_
        (torch.empty(4, device=device, dtype=torch.int64), torch.arange(4, device=device)),
    ]
    return pairs


def _check_flags(device):
    """Clean: every flag 0 and exact copies. Then a NaN or Inf in the last element of each checked source in
    turn (the last element of a strided view, of a tail past the last full block, of a second chunk)
    flags exactly that pair."""
    pairs = _checked_pairs(device)
    batch = CopyBatch(pairs, check=True)
    assert batch.run().tolist() == [0] * len(pairs)
    for dst, src in pairs:
        assert torch.equal(dst, src)
    for i in _each_last_not_finite(pairs):
        flags = batch.run().tolist()
        assert flags == [int(j == i) for j in range(len(pairs))], (i, flags)
    return batch


def _each_last_not_finite(pairs):
    """Each source of ``pairs`` but the last (the integers) with a NaN or Inf in its last element, in turn (restored
    after): yields the pair's index."""
    for i, (_, src) in enumerate(pairs[:-1]):
        last = (-1,) * src.dim()
        keep = src[last].item()
        src[last] = float("nan") if i % 2 else float("inf")
        try:
            yield i
        finally:
            src[last] = keep


def test_checked_copies_flag_each_pair_on_cpu():
    """Without the kernel (CPU), the flags come from one reduction over the destinations after the copy."""
    batch = _check_flags("cpu")
    assert batch.fused == []
    assert CopyBatch(_checked_pairs("cpu")).run() is None  # no check: no flags


def _check_many(device):
    """CopyBatch.many (a refit's rounds): batches built together, their flags parts of one buffer and the kernel's
    tables one pass, copy exactly and flag as one built alone: a NaN or Inf in one batch's pair flags that pair
    and raises that batch's second word only; a kernel=True batch beside it copies a NaN without flagging it."""
    pairs = _checked_pairs(device)
    others = [(torch.empty_like(src), src.clone()) for _, src in _checked_pairs(device)[:4]]
    words = torch.zeros(2, dtype=torch.int32, device=device)  # the checked batch's "header" word, and another
    checked, copied, empty = CopyBatch.many(
        [
            (pairs, dict(check=True, also_flag=[words[0]] * len(pairs))),
            (others, dict(kernel=True)),
            ([], dict(check=True)),
        ]
    )
    base = checked.bad.untyped_storage().data_ptr()
    assert copied.bad.untyped_storage().data_ptr() == base and copied.bad.data_ptr() != checked.bad.data_ptr()
    assert checked.run().tolist() == [0] * len(pairs) and copied.run() is None and empty.run().tolist() == []
    for dst, src in pairs + others:
        assert torch.equal(dst, src)
    others[0][1][-1] = float("nan")  # copied as it is, flagged nowhere
    copied.run()
    assert torch.isnan(others[0][0][-1]) and checked.run().tolist() == [0] * len(pairs)
    assert words.tolist() == [0, 0], words
    for i in _each_last_not_finite(pairs):
        flags = checked.run().tolist()
        assert flags == [int(j == i) for j in range(len(pairs))] and words.tolist() == [1, 0], (i, flags, words)
        words.zero_()
    return checked, copied


def test_batches_built_together_copy_and_flag_alone_on_cpu():
    checked, copied = _check_many("cpu")
    assert checked.fused == copied.fused == []


@pytest.mark.gpus(1)
def test_batches_built_together_copy_and_flag_alone_on_gpu():
    """... and on CUDA, where the kernel copies them: every batch's launches are slices of one table."""
    from megatron_ext.copy_check import available, prewarm

    assert available(), "Triton must import next to torch on a GPU machine"
    prewarm("cuda", (torch.bfloat16, torch.float32, torch.float16), wait=True)
    checked, copied = _check_many("cuda")
    launches = [t for batch in (checked, copied) for f in batch.fused for t, _, _ in f.launches]
    assert len(launches) >= 4 and len({t.untyped_storage().data_ptr() for t in launches}) == 1


def _finite_check_tensors(device):
    """Tensors for FiniteCheck, their expected flags: a NaN in the last element, clean bf16, an integer tensor
    and an empty one (never flagged), an Inf in a column slice (the kernel cuts it into runs on CUDA) and a NaN
    in a two-column slice (too narrow for the kernel: reduced)."""
    g = torch.Generator().manual_seed(1)
    last = torch.randn(3000, generator=g).to(device)
    last[-1] = float("nan")
    wide = torch.randn(8, 3 * 512, generator=g).to(device, torch.bfloat16)
    wide[3, 700] = float("inf")
    narrow = torch.randn(6, 9, generator=g).to(device)
    narrow[5, 4] = float("nan")
    tensors = [
        last,
        torch.randn(70_001, generator=g).to(device, torch.bfloat16),
        torch.arange(9, device=device),
        torch.empty(0, device=device),
        wide[:, 512:1024],
        narrow[:, 3:5],
    ]
    return tensors, [1, 0, 0, 0, 1, 1]


def test_finite_check_flags_each_tensor_in_order_on_cpu():
    """FiniteCheck, built once and run again: one int32 flag per tensor in the order given (unchecked dtypes and
    empty tensors 0), from the reduction on CPU; the next run overwrites the flags."""
    tensors, want = _finite_check_tensors("cpu")
    check = FiniteCheck(tensors)
    assert check.fused == [] and len(check) == len(tensors)
    assert check.run().tolist() == want
    tensors[0][-1], tensors[4][3, 700 - 512] = 0.0, 1.0
    assert check.run().tolist() == [0, 0, 0, 0, 0, 1]
    assert FiniteCheck([]).run().tolist() == []


@pytest.mark.gpus(1)
def test_finite_check_reads_by_kernel_where_it_can_cut_runs():
    """On CUDA, FiniteCheck reads the tensors the kernel cuts with its check-only variant (profiler names) and
    reduces only the narrow slice; the flags are the same as on CPU."""
    from megatron_ext import copy_check

    copy_check.prewarm("cuda", (torch.float32, torch.bfloat16), wait=True, check_only=True)
    tensors, want = _finite_check_tensors("cuda")
    check = FiniteCheck(tensors)
    assert sorted(i for f in check.fused for i, *_ in f.pairs) == [0, 1, 4]
    kernels = _cuda_kernels(check)
    assert sum(k.startswith("copy_check") for k in kernels) == sum(len(f.launches) for f in check.fused), kernels
    assert check.bad.tolist() == want


def test_runs_cut_views_into_contiguous_runs():
    from megatron_ext.copy_check import MIN_RUN, runs

    fused = torch.empty(4, 6 * 64, 256)
    dst = torch.empty(4, 64, 256)
    # (source offset, destination offset, runs, run length, source step, destination step) per block of runs
    got = runs(dst, fused[:, 5 * 64 :])  # a row block of a fused weight: the source strided, one block of 4 runs
    assert got.tolist() == [[5 * 64 * 256, 0, 4, 64 * 256, 6 * 64 * 256, 64 * 256]]
    weight = torch.empty(6, 4, 3 * MIN_RUN)  # a column slice of a 3-D weight: a block of 4 runs per leading index
    got = runs(torch.empty(6, 4, MIN_RUN), weight[:, :, MIN_RUN : 2 * MIN_RUN])
    want = [[MIN_RUN + i * 12 * MIN_RUN, i * 4 * MIN_RUN, 4, MIN_RUN, 3 * MIN_RUN, MIN_RUN] for i in range(6)]
    assert got.tolist() == want
    assert runs(torch.empty(10, 3), torch.empty(10, 8)[:, 2:5]) is None  # runs of 3 elements
    whole = [[0, 0, 1, MIN_RUN - 1, 0, 0]]  # short, but the whole tensor: one run
    assert runs(torch.empty(MIN_RUN - 1), torch.empty(MIN_RUN - 1)).tolist() == whole
    assert runs(torch.empty(3, 4), torch.empty(3, 4, dtype=torch.float64)) is None
    # both contiguous (most pairs of a refit): one run from each storage offset, whatever the shape
    a, b = torch.empty(1000), torch.empty(500)
    assert runs(a[100:400].view(3, 100), b[7:307].view(3, 100)).tolist() == [[7, 100, 1, 300, 0, 0]]
    assert runs(a[:300].view(1, 3, 100), b[:300].view(1, 3, 100)).tolist() == [[0, 0, 1, 300, 0, 0]]


@pytest.mark.gpus(1)
def test_checked_copies_are_one_fused_kernel_per_dtype_on_gpu():
    """On CUDA the checked copies the kernel can cut run in the Triton kernel (profiler names: one launch per
    dtype and alignment), and flag exactly as on CPU."""
    from megatron_ext.copy_check import available, prewarm

    assert available(), "Triton must import next to torch on a GPU machine"
    prewarm("cuda", (torch.bfloat16, torch.float32, torch.float16), wait=True)  # (until then: a second read)
    batch = _check_flags("cuda")
    assert [f.launches[0][1].name for f in batch.fused] == ["bf16", "fp32", "fp16"]
    kernels = _cuda_kernels(batch)
    assert sum(k.startswith("copy_check") for k in kernels) == sum(len(f.launches) for f in batch.fused), kernels


@pytest.mark.gpus(1)
def test_unchecked_copies_with_kernel_run_in_it_and_check_nothing():
    """kernel=True without check: the pairs the kernel can cut (strided ones among them) are copied by it
    (profiler names: the same launches as checked copies), exactly; nothing is reduced afterwards, a NaN
    is copied, not flagged, and run() returns None. Without kernel=True the strided pairs take a copy_ each."""
    from megatron_ext.copy_check import available, prewarm

    assert available(), "Triton must import next to torch on a GPU machine"
    prewarm("cuda", (torch.bfloat16, torch.float32, torch.float16), wait=True)
    pairs = _checked_pairs("cuda")
    pairs[1][1][0, 0, -1] = float("nan")  # copied as it is
    batch = CopyBatch(pairs, kernel=True)
    assert [f.launches[0][1].name for f in batch.fused] == ["bf16", "fp32", "fp16"]
    assert len(batch.single) == 2 and batch.groups == []  # the runs of 3 and the integers: copy_
    assert batch.run() is None
    kernels = _cuda_kernels(batch)
    assert sum(k.startswith("copy_check") for k in kernels) == sum(len(f.launches) for f in batch.fused), kernels
    assert not any("reduce" in k or "norm" in k for k in kernels), kernels
    for dst, src in pairs:
        torch.testing.assert_close(dst, src, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(pairs[1][0][0, 0, -1])
    assert CopyBatch(pairs).fused == []  # the default: no kernel


@pytest.mark.gpus(1)
def test_check_only_reads_flags_and_writes_nothing():
    """FusedCopyCheck(store=False), the zero-copy senders' check: the kernel (profiler names, no reduction) flags
    exactly the sources with a NaN or Inf (one in the last element of the last one) and writes nothing, not even
    to a destination given apart from the source; a compile still under way checks by a reduction, also without
    writing."""
    from megatron_ext import copy_check

    assert copy_check.available(), "Triton must import next to torch on a GPU machine"
    copy_check.prewarm("cuda", (torch.bfloat16,), wait=True, check_only=True)
    sources = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in (3000, 1 << 18, 70_001)]
    sources.append(torch.randn(64, 3 * 512, device="cuda", dtype=torch.bfloat16)[:, 512:1024])  # strided
    sources[1][5] = float("inf")
    sources[2][-1] = float("nan")
    apart = [torch.zeros_like(t) for t in sources]
    flags = torch.zeros(len(sources), dtype=torch.int32, device="cuda")
    pairs = [(i, None, d, t, copy_check.runs(d, t)) for i, (d, t) in enumerate(zip(apart, sources))]
    check = copy_check.FusedCopyCheck(flags, pairs, store=False)
    kernels = _cuda_kernels(check)
    assert sum(k.startswith("copy_check") for k in kernels) == len(check.launches) and kernels, kernels
    assert not any("reduce" in k or "norm" in k for k in kernels), kernels
    assert flags.tolist() == [0, 1, 1, 0]
    assert all(not d.any() for d in apart)
    flags.zero_()
    check._copy_then_check()  # what a run does while the variant compiles
    assert flags.tolist() == [0, 1, 1, 0] and all(not d.any() for d in apart)
    with pytest.raises(ValueError, match="check=True"):
        copy_check.FusedCopyCheck(flags, pairs, check=False, store=False)


def test_fused_table_follows_a_storage_that_moved():
    """The kernel's table holds addresses. Symmetric-memory staging moves a buffer's storage to a new
    allocation and keeps the Storage object (every view stays valid, fsdp_symm.memory.move_storage): the
    table must follow it, not copy from where the storage was. Built on CPU (no kernel runs here)."""
    from megatron_ext import copy_check

    if not copy_check.available():
        pytest.skip("Triton does not import")
    fused_weight = torch.randn(4, 6 * 64, 256)
    src, dst = fused_weight[:, 5 * 64 :], torch.empty(4, 64, 256)
    flags = torch.zeros(1, dtype=torch.int32)
    fused = copy_check.FusedCopyCheck(flags, [(0, None, dst, src, copy_check.runs(dst, src))])
    (table, _, _), *_ = fused.launches
    assert int(table[0, 0]) == src.data_ptr() and int(table[0, 1]) == dst.data_ptr()
    assert not fused.refresh() and fused.rebuilds == 0
    storage = fused_weight.untyped_storage()  # moved as move_storage does, with the old place still taken
    nbytes, before = storage.nbytes(), src.data_ptr()
    storage.resize_(0)
    taken = torch.empty(nbytes, dtype=torch.uint8)
    storage.resize_(nbytes)
    assert src.data_ptr() != before and taken.numel() == nbytes
    assert fused.refresh() and fused.rebuilds == 1
    (table, _, _), *_ = fused.launches
    assert int(table[0, 0]) == src.data_ptr() and int(table[-1, 1]) >= dst.data_ptr()
    assert not fused.refresh()


def test_check_only_fallback_reads_the_sources_and_writes_nothing():
    """FusedCopyCheck(store=False)'s fallback (while its kernel compiles, or where it cannot run) reduces over the
    sources, not the destinations, and copies nothing: a destination given apart stays as it was. Built and run
    on CPU (the fallback's multi-tensor operations)."""
    from megatron_ext import copy_check

    if not copy_check.available():
        pytest.skip("Triton does not import")
    sources = [torch.randn(3000), torch.randn(1 << 12), torch.randn(64, 1536)[:, 512:1024]]
    sources[1][-1] = float("nan")
    apart = [torch.zeros_like(t) for t in sources]
    flags = torch.zeros(len(sources), dtype=torch.int32)
    pairs = [(i, None, d, t, copy_check.runs(d, t)) for i, (d, t) in enumerate(zip(apart, sources))]
    copy_check.FusedCopyCheck(flags, pairs, store=False)._copy_then_check()
    assert flags.tolist() == [0, 1, 0] and all(not d.any() for d in apart)
    with pytest.raises(ValueError, match="check=True"):
        copy_check.FusedCopyCheck(flags, pairs, check=False, store=False)


def test_without_a_usable_kernel_the_copies_are_checked_by_a_second_read(monkeypatch):
    """Where the kernel cannot run (here: CPU tensors, which Triton cannot launch on; on a GPU machine e.g. no C
    compiler for Triton's launcher), the first run warns once and every run copies and flags the same, by a
    reduction over the destinations."""
    from megatron_ext import copy_check

    if not copy_check.available():
        pytest.skip("Triton does not import")
    monkeypatch.setattr(copy_check, "_UNUSABLE", None)
    src, dst = torch.randn(3000), torch.empty(3000)
    flag, word = torch.zeros(1, dtype=torch.int32), torch.zeros((), dtype=torch.int32)
    fused = copy_check.FusedCopyCheck(flag, [(0, word, dst, src, copy_check.runs(dst, src))])
    with pytest.warns(RuntimeWarning, match="checked by a second read instead"):
        fused.run()
    assert torch.equal(dst, src) and int(flag) == int(word) == 0
    src[-1] = float("inf")
    fused.run()  # no second warning: the reason is kept for the process
    assert torch.equal(dst, src) and int(flag) == int(word) == 1
    assert copy_check._UNUSABLE is not None
    # many pairs (what the fallback also runs while the kernel compiles): strided sources, second words shared by
    # several pairs (a bucket's header): a NaN and an Inf flag exactly their pairs and their pairs' words
    MIN_RUN = copy_check.MIN_RUN
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.randn(10, 2 * MIN_RUN).to(dtype)
        srcs = [base[i, ::2] for i in range(10)]
        dsts = [torch.empty(MIN_RUN, dtype=dtype) for _ in range(10)]
        flags, words = torch.zeros(10, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
        whole = [(0, 0, 1, MIN_RUN, 0, 0)]  # (the fallback copies the views; no kernel reads this)
        fused = copy_check.FusedCopyCheck(
            flags, [(i, words[i % 3] if i % 2 == 0 else None, dsts[i], srcs[i], whole) for i in range(10)]
        )
        fused.run()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)) and not flags.any() and not words.any()
        base[3, -2], base[4, 0] = float("nan"), float("inf")  # pair 3 (no word), pair 4 (word 1)
        fused.run()
        assert flags.tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0] and words.tolist() == [0, 1, 0], (flags, words)
        assert torch.equal(dsts[3].isnan(), srcs[3].isnan()) and dsts[4][0] == float("inf")
    # check=False (CopyBatch(kernel=True)'s copies): the fallback copies and reads nothing again
    monkeypatch.setattr(torch, "_foreach_norm", None)  # a reduction would raise
    dst, flag = torch.empty(3000), torch.zeros(1, dtype=torch.int32)
    unchecked = copy_check.FusedCopyCheck(flag, [(0, None, dst, src, copy_check.runs(dst, src))], check=False)
    unchecked.run()
    assert torch.equal(dst, src) and torch.isinf(dst[-1]) and int(flag) == 0


@pytest.mark.parametrize("store", [True, False], ids=["copy", "check-only"])
def test_fused_table_has_a_row_per_program(store):
    """The kernel's table, built with numpy operations over all blocks at once, holds a row per program: both
    addresses, the number of runs, their length, the two steps between runs, the pair's flag and second word (0
    without one); a program takes whole runs of a block (up to RUNS_PER_PROGRAM, at most CHUNK elements, or
    CHECK_ONLY_CHUNK for a check without stores; ``chunk=`` another) or one chunk of a longer run. Split by
    16-byte alignment (of both addresses and both steps). Checked against rows written out run by run, which
    together cover every element of every pair exactly once."""
    from megatron_ext import copy_check

    if not copy_check.available():
        pytest.skip("Triton does not import")
    size, most = 4, copy_check.RUNS_PER_PROGRAM
    one = torch.ones(8)
    default = copy_check.FusedCopyCheck(
        torch.zeros(1, dtype=torch.int32), [(0, None, one, one, copy_check.runs(one, one))], store=store
    )
    assert default.chunk == (copy_check.CHUNK if store else copy_check.CHECK_ONLY_CHUNK)
    chunk = copy_check.CHUNK if store else copy_check.CHUNK // 4  # (the default check-only chunk: a slow test)
    fused_w = torch.randn(6, 3 * chunk // 2)  # rows longer than a chunk: two programs per run
    short = torch.randn(3 * most + 5, 2 * copy_check.MIN_RUN)  # short runs: RUNS_PER_PROGRAM of them per program
    mid = torch.randn(40, 3 * chunk // 8 + 4)  # runs of 3/8 of a chunk: two per program
    pairs = [
        (torch.empty(6, chunk // 2), fused_w[:, chunk // 2 : chunk]),  # strided, 2 runs of half a chunk a program
        (torch.empty(2 * chunk + 5), torch.randn(2 * chunk + 5)),  # contiguous: one run, three programs
        (torch.empty(6, 3 * chunk // 2 - 1), fused_w[:, 1:]),  # strided, source 4 bytes off: unaligned
        (torch.empty(3 * most + 5, copy_check.MIN_RUN), short[:, : copy_check.MIN_RUN]),
        (torch.empty(40, 3 * chunk // 8), mid[:, 4:]),  # 16-byte aligned addresses and steps
        (torch.empty(40, 3 * chunk // 8 + 1), mid[:, 3:]),  # steps of an odd number of elements: unaligned
    ]
    flags, word = torch.zeros(len(pairs), dtype=torch.int32), torch.zeros((), dtype=torch.int32)
    entries = [(i, word if i == 1 else None, d, s, copy_check.runs(d, s)) for i, (d, s) in enumerate(pairs)]
    fused = copy_check.FusedCopyCheck(flags, entries, store=store, chunk=None if store else chunk)
    want = {True: [], False: []}
    for i, also, dst, src, pieces in entries:
        for s_off, d_off, count, n, s_step, d_step in pieces.tolist():
            group = max(1, min(most, chunk // n)) if n <= chunk else 1
            for first in range(0, count, group):
                for start in range(0, n, chunk):
                    row = [
                        src.untyped_storage().data_ptr() + (s_off + first * s_step + start) * size,
                        dst.untyped_storage().data_ptr() + (d_off + first * d_step + start) * size,
                        min(group, count - first),
                        min(chunk, n - start),
                        s_step,
                        d_step,
                        flags.data_ptr() + 4 * i,
                        0 if also is None else also.data_ptr(),
                    ]
                    steps = row[2] == 1 or (s_step * size % 16 == 0 and d_step * size % 16 == 0)
                    want[row[0] % 16 == 0 and row[1] % 16 == 0 and steps].append(row)
    got = {aligned: table.tolist() for table, _, aligned in fused.launches}
    assert got == {k: v for k, v in want.items() if v}
    # every element of every pair in exactly one program: the source addresses the rows cover, per pair
    covered = {}
    for rows in want.values():
        for src0, _, count, n, s_step, _, flag, _ in rows:
            starts = src0 + np.arange(count)[:, None] * s_step * size
            covered.setdefault(flag, []).append((starts + np.arange(n)[None, :] * size).reshape(-1))
    for i, (_, src) in enumerate(pairs):
        addrs = np.concatenate(covered[flags.data_ptr() + 4 * i])
        assert addrs.size == np.unique(addrs).size == src.numel(), i
    assert any(r[2] == most for r in want[True]) and any(1 < r[2] < most for r in want[True])
    assert want[True] and want[False], "the test needs aligned and unaligned runs"
    # several checks built in one pass (build_tables, a refit's rounds at once; one of another chunk): each
    # launches the rows it has when built alone, in slices of one table
    parts = [(entries[:2], chunk), (entries[2:4], chunk // 2), (entries[4:], chunk)]
    alone = [copy_check.FusedCopyCheck(flags, e, store=store, chunk=c) for e, c in parts]
    together = [copy_check.FusedCopyCheck(flags, e, store=store, chunk=c, build=False) for e, c in parts]
    assert all(not c.launches for c in together)
    copy_check.build_tables(together)
    for a, b in zip(alone, together):
        assert [(t.tolist(), f) for t, _, f in a.launches] == [(t.tolist(), f) for t, _, f in b.launches]
    tables = {t.untyped_storage().data_ptr() for c in together for t, _, _ in c.launches}
    assert len(tables) == 1, "one upload for all the checks"
    # checks whose rows are all aligned (the contiguous pair, alone and twice over): their rows as they come
    one = flags.data_ptr() + 4
    aligned = [
        copy_check.FusedCopyCheck(flags, [entries[1]], store=store, chunk=c, build=False) for c in (chunk, chunk)
    ]
    copy_check.build_tables(aligned)
    for check in aligned:
        assert [(t.tolist(), f) for t, _, f in check.launches] == [([r for r in want[True] if r[6] == one], True)]
    # one left unbuilt builds its own at its first run (refresh), which is not counted as a rebuild
    late = copy_check.FusedCopyCheck(flags, entries, store=store, chunk=chunk, build=False)
    assert not late.built and late.refresh() and late.built and late.rebuilds == 0
    assert [(t.tolist(), f) for t, _, f in late.launches] == [(t.tolist(), f) for t, _, f in fused.launches]
    assert not late.refresh()


def _span_cases(device):
    """Pairs of spans as a refit's staging makes them (a weight's runs, a bucket's contiguous pieces; tensors that
    start inside their storage), each with whether the kernel takes it: a column slice packed into a buffer and
    unpacked from it, two column slices of one box, two contiguous ranges, contiguous rows seen as a strided run,
    and runs of 3 elements (too short: copy_)."""
    from megatron_ext.copy_check import MIN_RUN, Span

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(9, 3 * MIN_RUN, generator=g).to(device)[2:]  # 7 rows, storage offset 6 * MIN_RUN
    other = torch.randn(9, 2 * MIN_RUN, generator=g).to(device)[1:]
    src_buf = torch.randn(40 * MIN_RUN, generator=g).to(device)[37:]
    n = 7 * MIN_RUN
    column = Span(weight, MIN_RUN, 7, MIN_RUN, 3 * MIN_RUN)  # rows' middle third
    cases = [
        (Span(torch.empty(20 * MIN_RUN, device=device)[5:], 11, 1, n, n), column, True),  # pack
        (
            Span(torch.empty(8, 3 * MIN_RUN, device=device)[1:], MIN_RUN, 7, MIN_RUN, 3 * MIN_RUN),
            Span(src_buf, 3, 1, n, n),
            True,
        ),  # unpack into a column slice
        (
            Span(torch.empty(8, 2 * MIN_RUN, device=device), MIN_RUN, 7, MIN_RUN, 2 * MIN_RUN),
            Span(other, 0, 7, MIN_RUN, 2 * MIN_RUN),
            True,
        ),  # two strided sides
        (
            Span(torch.empty(9 * MIN_RUN, device=device)[1:], 0, 1, 5 * MIN_RUN, 5 * MIN_RUN),
            Span(src_buf, 100, 1, 5 * MIN_RUN, 5 * MIN_RUN),
            True,
        ),  # contiguous
        (
            Span(torch.empty(2 * n, device=device), 7, 1, 2 * 3 * MIN_RUN, 2 * 3 * MIN_RUN),
            Span(weight, 3 * MIN_RUN, 2, 3 * MIN_RUN, 3 * MIN_RUN),
            True,
        ),  # whole rows: one range
        (Span(torch.empty(64, device=device), 1, 1, 21, 21), Span(weight, 5, 7, 3, 3 * MIN_RUN), False),  # short
    ]
    return cases


def test_spans_cut_as_their_views_and_copy_exactly_on_cpu():
    """A pair of spans gives the kernel the row runs() gives for the pair's views (or None where runs() does), from
    integers; CopyBatch copies a span pair exactly (on CPU through its views). Spans of one box's runs in other
    shapes are refused by name."""
    from megatron_ext.copy_check import Span, runs, span_row, span_views

    cases = _span_cases("cpu")
    for dst, src, kernel in cases:
        views = span_views(dst, src)
        want = runs(*views)
        assert (want is not None) == kernel
        assert span_row(dst, src) == (None if want is None else tuple(want.reshape(-1).tolist())), (dst, src)
    batch = CopyBatch([(d, s) for d, s, _ in cases], check=True)
    assert batch.run().tolist() == [0] * len(cases)
    for dst, src, _ in cases:
        d, s = span_views(dst, src)
        assert torch.equal(d, s)
    strided = Span(torch.empty(20, 64), 0, 4, 32, 64)
    assert span_row(strided, Span(torch.empty(20, 64), 0, 8, 16, 64)) is None
    with pytest.raises(ValueError, match="a span of 8 runs of 16 viewed as 4 x 32"):
        span_views(strided, Span(torch.empty(20, 64), 0, 8, 16, 64))


@pytest.mark.gpus(1)
def test_span_pairs_take_the_kernel_rows_of_their_views_on_gpu():
    """On CUDA a checked CopyBatch of span pairs builds the same kernel table as one of the pairs' views (the same
    rows, launches and flags), copies exactly, and flags a NaN in a strided source; the short runs take copy_."""
    from megatron_ext.copy_check import available, prewarm, span_views

    assert available(), "Triton must import next to torch on a GPU machine"
    prewarm("cuda", (torch.float32,), wait=True)
    cases = _span_cases("cuda")
    spans = CopyBatch([(d, s) for d, s, _ in cases], check=True)
    views = CopyBatch([span_views(d, s) for d, s, _ in cases], check=True)
    assert len(spans.single) == len(views.single) == 1 and len(spans.fused) == len(views.fused) == 1

    def rows(batch):  # (each row but its flag's address: the two batches' flags are two buffers)
        return [(t[:, [0, 1, 2, 3, 4, 5, 7]].tolist(), d.name, a) for t, d, a in batch.fused[0].launches]

    assert rows(spans) == rows(views) and sum(len(t) for t, *_ in rows(spans)) >= 5
    assert spans.run().tolist() == [0] * len(cases)
    torch.cuda.synchronize()
    for dst, src, _ in cases:
        d, s = span_views(dst, src)
        assert torch.equal(d, s)
    column = cases[0][1]
    column.tensor[4, column.offset + 7] = float("nan")
    assert spans.run().tolist() == [1, 0, 0, 0, 0, 0]
