"""A transfer plan from one :class:`~megatron_ext.sharding.Layout` to another, computed once.

For every destination rank and every segment it keeps (an HF tensor's box in
one of its local tensors), the plan names the source rank and the exact element
ranges on both sides (:class:`Run`: ``count`` runs of ``length`` elements,
``stride`` apart, starting at ``offset`` of the local tensor's flat storage).
Fused tensors (QKV, gate/up) need no gathering: their segments are planned
like any other. A destination that already holds the bytes (colocated layouts)
copies locally. Where several other source ranks hold the same bytes
(data-parallel replicas, expert-DP), the work is split without a funnel by a
rule of the layouts alone (:func:`_holder`): a tensor's cells, in a fixed
order, take consecutive holders from a start hashed from the tensor's name,
and the destinations that need one cell take its holders in turn. A vector of
fewer than :data:`NEAR_BYTES` (a norm every TP rank holds) goes by position
instead, from a rank that sends the destination its shards anyway, so it adds
no pair of its own (:meth:`_Cells.choose`). No choice depends on what other
destinations were given, so a rank could plan its own pairs without planning
the whole job. On the 10 layouts of
``benchmarks/refit_vs_swap.py`` and the simulator's three configurations with
a remote engine, the busiest rank sends no more than with a least-loaded
choice in every one, less in five (colocated TP2·EP2·DP2 -> TP1·EP4: 1.39 GB,
every rank alike, against 1.55 GB).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import itertools
import math
import zlib
from collections import defaultdict
from typing import NamedTuple

from ...sharding.geometry import Box, Layout, LocalTensor, Segment
from ...nogc import paused_gc

__all__ = [
    "ReshardPlan",
    "Run",
    "Transfer",
    "build_reshard_plan",
    "check_reshard_plan",
    "fanout_plans",
    "merge_layouts",
    "pair_summary",
    "run_continues",
    "run_view",
    "sub_layout",
]


class Run(NamedTuple):
    """Elements ``offset + i*stride + [0, length)`` for ``i < count`` of local tensor ``local``. (A named tuple, as
    is :class:`Transfer`: a rank's plan makes thousands, and a tuple is built three times faster than a frozen
    dataclass.)"""

    local: str
    offset: int
    length: int
    stride: int
    count: int

    @property
    def numel(self) -> int:
        return self.length * self.count


class Transfer(NamedTuple):
    """Box ``box`` of HF tensor ``name``: from ``src`` (``src_run``) to ``dst`` (``dst_run``)."""

    name: str
    box: Box
    src: int
    dst: int
    src_run: Run
    dst_run: Run
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.itemsize  # (the box keeps its numel)


def run_continues(a: Run, b: Run) -> bool:
    """Whether run ``b`` continues run ``a``: both one contiguous range (``count == 1``) of one local tensor, ``b``
    starting where ``a`` ends (the one rule by which zero-copy ops and staged copies merge transfers)."""
    return a.count == 1 == b.count and a.local == b.local and a.offset + a.length == b.offset


def run_view(tensor, run: Run):
    """The ``(count, length)`` view of ``run`` in contiguous ``tensor`` (no copy; one ``as_strided``, which
    places the view by the storage alone: a refit's first copies take thousands of these)."""
    if not tensor.is_contiguous():
        raise ValueError(f"{run.local}: a run's view needs a contiguous tensor, got strides {tensor.stride()}")
    return tensor.as_strided((run.count, run.length), (run.stride, 1), tensor.storage_offset() + run.offset)


def _run(lt: LocalTensor, seg: Segment, box: Box) -> Run:
    """Where ``box`` (inside ``seg.box``) sits in ``lt``'s flat storage."""
    row = seg.row + box.ranges[0][0] - seg.box.ranges[0][0]
    nrows = box.shape[0]
    if len(lt.shape) == 1:
        return Run(lt.name, row, nrows, nrows, 1)
    if len(lt.shape) != 2:
        raise ValueError(f"{lt.name}: only 1-D and 2-D tensors are planned, got shape {lt.shape}")
    width = lt.shape[1]
    col = box.ranges[1][0] - seg.box.ranges[1][0]
    ncols = box.shape[1]
    if ncols == width:
        return Run(lt.name, row * width, nrows * width, nrows * width, 1)
    return Run(lt.name, row * width + col, ncols, width, nrows)


@dataclasses.dataclass
class ReshardPlan:
    """Every transfer from ``src`` to ``dst`` layout; reused across refits."""

    src: Layout
    dst: Layout
    transfers: list[Transfer]
    rank: int | None = None  # set: only this rank's transfers (build_reshard_plan(..., rank=))

    def sent_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            if t.src != t.dst:
                out[t.src] += t.nbytes
        return dict(out)

    def received_bytes(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            if t.src != t.dst:
                out[t.dst] += t.nbytes
        return dict(out)

    @functools.cached_property  # the transfers are not changed after planning
    def fingerprint(self) -> str:
        """16 hex digits of every transfer's name, box, source and destination, in plan order."""
        return _digest(self.transfers)[:16]


def _digest(transfers: list[Transfer]) -> str:
    """sha256 (hex) of the transfers' names, boxes, sources and destinations, in order."""
    flat: list[int] = []
    add = flat.extend  # (one list, made an array once: a first refit digests thousands of transfers)
    for t in transfers:  # each field's length first, so no two lists read alike
        ranges = t.box.ranges
        add((len(t.name), len(ranges)))
        for r in ranges:
            add(r)
        add((t.src, t.dst))
    names = "".join([t.name for t in transfers]).encode()
    return hashlib.sha256(array.array("q", flat).tobytes() + names).hexdigest()


def pair_summary(transfers: list[Transfer]) -> dict[int, tuple[set[int], set[int], int]]:
    """Each rank's ``(sends, recvs, digest)`` over the pairs of ``transfers`` (those with ``src != dst``): the
    peers it sends to, the peers it receives from, and the XOR over its pairs of a 60-bit digest of each pair's
    transfers in order. Both ends of a pair add the same digest when they planned alike, so over
    every rank of a job the XOR is 0 exactly when every pair's two ends agree (short of a hash collision):
    each rank checks its own pairs without planning the others' (a rank's plan gives its own entry exactly)."""
    pairs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        if t.src != t.dst:
            pairs[t.src, t.dst].append(t)
    out: dict[int, tuple[set[int], set[int], int]] = {}
    for (a, b), ts in pairs.items():
        d = int(_digest(ts)[:15], 16)
        for r, side, peer in ((a, 0, b), (b, 1, a)):
            sends, recvs, digest = out.get(r, (set(), set(), 0))
            (sends, recvs)[side].add(peer)
            out[r] = (sends, recvs, digest ^ d)
    return out


def _cuts(box: Box, parts: list[Box]) -> list[list[tuple[int, int]]]:
    """Per dim, ``box``'s range cut at every boundary of ``parts`` inside it."""
    cuts = []
    for dim, (a, b) in enumerate(box.ranges):
        points = sorted({a, b, *(p.ranges[dim][i] for p in parts for i in (0, 1))})
        cuts.append([(x, y) for x, y in zip(points, points[1:]) if a <= x < y <= b])
    return cuts


def _cells(box: Box, parts: list[Box]) -> list[Box]:
    """``box`` cut at every boundary of ``parts`` (so each cell lies inside or outside each part)."""
    return [Box(ranges) for ranges in itertools.product(*_cuts(box, parts))]


# A vector (a norm, a bias) of fewer bytes that several ranks hold goes to a destination by position, not from a
# start hashed from its name alone (:meth:`_Cells.choose`): ranks are grouped by their dict of local tensors (a
# Megatron layout's data-parallel replicas share one, so a group is one TP / PP position), and of the ``n`` groups
# of destinations that need a cell, the ``i``-th takes it from holder group ``i * groups // n`` (in it, by the
# hashed rule). Where both sides order their TP ranks alike (TP2 -> TP2, TP2 -> TP4, TP4 -> TP2, TP2xDP2 -> TP2,
# TP4 -> TP2xDP2), a destination then takes a norm that every TP rank holds from a rank that sends it its shards
# anyway, instead of adding a pair for a few KiB. A pair costs a message per refit and, once per process, NCCL's
# connections and their buffers: on 4xH200, TP2 -> TP2 across GPUs spent about 300 MiB on each receiver and 0.2 s
# of its first refit on a pair that carried 28 norms, 0.16 MiB (NCCL_DEBUG=INFO). Weights keep the hashed start,
# which spreads a destination's tensors over their holders (a TP1xDP2 trainer's replicas each send half).
NEAR_BYTES = 1 << 20


def _holder(name: str, cell: int, served: int, holders: int) -> int:
    """Which of ``holders`` serves the ``served``-th destination that needs cell ``cell`` of tensor ``name``
    from another rank (cells numbered over the tensor's destination boxes in a fixed order): consecutive
    cells and destinations take consecutive holders, from a start that a stable hash of the name spreads
    over the holders (the same in every process)."""
    return (_name_hash(name) + cell + served) % holders


@functools.lru_cache(maxsize=1 << 16)
def _name_hash(name: str) -> int:
    return zlib.crc32(name.encode())


class _Destinations:
    """``dst``'s ranks grouped by their local tensors: ranks that share one dict of them (an engine's
    data-parallel replicas, :func:`~.layout.inference_layout`) are indexed once. A tensor's boxes and keepers
    are gathered from the groups when a plan first asks for them, so a rank's plan reads only the tensors it
    keeps or holds."""

    def __init__(self, dst: Layout):
        self.specs, self._small, self._near = dst.specs, {}, {}  # (small: tensor name -> under NEAR_BYTES?)
        self.position = {d: i for i, d in enumerate(dst.ranks)}
        self.group: dict[int, int] = {}  # rank -> its group (the id of its dict of local tensors)
        self.entries: dict[int, list[tuple[LocalTensor, Segment]]] = {}  # group -> its segments, in order
        self.ranks: dict[int, list[int]] = defaultdict(list)  # group -> its ranks, in dst order
        self._by_name: dict[int, dict[str, list[int]]] = {}  # group -> name -> its entry indices
        self._named: dict[str, dict[Box, list[tuple[int, list[int]]]]] = {}  # name -> box -> (group, entries)
        self._keepers: dict[tuple[str, Box], list[tuple[int, int, int]]] = {}
        for d in dst.ranks:
            tensors = dst.tensors.get(d, {})
            g = self.group[d] = id(tensors)
            self.ranks[g].append(d)
            if g in self.entries:
                continue
            entries = self.entries[g] = [(lt, seg) for lt in tensors.values() for seg in lt.segments]
            by_name: dict[str, list[int]] = {}
            for i, (_, seg) in enumerate(entries):
                got = by_name.get(seg.name)
                if got is None:
                    by_name[seg.name] = [i]
                else:
                    got.append(i)
            self._by_name[g] = by_name
        self.names: set[str] = set().union(*self._by_name.values())  # every tensor some rank keeps

    def _where(self, name: str) -> dict[Box, list[tuple[int, list[int]]]]:
        got = self._named.get(name)
        if got is None:
            got = self._named[name] = {}
            for g, by_name in self._by_name.items():
                entries = self.entries[g]
                for i in by_name.get(name, ()):
                    at = got.setdefault(entries[i][1].box, [])
                    if at and at[-1][0] == g:
                        at[-1][1].append(i)
                    else:
                        at.append((g, [i]))
        return got

    def small(self, name: str) -> bool:
        """Whether HF tensor ``name`` is a vector (a norm, a bias) of fewer than :data:`NEAR_BYTES`
        (:meth:`_Cells.choose`)."""
        got = self._small.get(name)
        if got is None:
            spec = self.specs[name]
            got = self._small[name] = len(spec.shape) == 1 and spec.shape[0] * spec.dtype.itemsize < NEAR_BYTES
        return got

    def near(self, name: str, box: Box, holders: dict) -> dict[int, tuple[int, int]]:
        """Each keeper of box ``box`` of tensor ``name`` that needs a cell held by ``holders`` (ranks) from another
        rank: ``(i, n)``, its group the ``i``-th of the ``n`` groups of such keepers, in plan order
        (:meth:`_Cells.choose`)."""
        key = (name, box, tuple(holders))
        got = self._near.get(key)
        if got is None:
            order: dict[int, int] = {}  # group -> its index
            for _, d, _ in self.keepers((name, box)):
                if d not in holders:
                    order.setdefault(self.group[d], len(order))
            got = self._near[key] = {
                d: (order[self.group[d]], len(order)) for _, d, _ in self.keepers((name, box)) if d not in holders
            }
        return got

    def boxes(self, name: str):
        """Every box of tensor ``name`` that some rank keeps."""
        return self._where(name).keys()

    def keepers(self, key: tuple[str, Box]) -> list[tuple[int, int, int]]:
        """``(position, rank, entry index)`` of every segment that keeps box ``key``, in plan order (by rank in
        ``dst``, then by the rank's segments); worked out once per box (a rank asks for a box it keeps and
        again for one it serves)."""
        out = self._keepers.get(key)
        if out is None:
            out = [
                (self.position[d], d, i)
                for g, found in self._where(key[0])[key[1]]
                for d in self.ranks[g]
                for i in found
            ]
            out.sort()
            self._keepers[key] = out
        return out


class _Shape:
    """How the destination boxes of a tensor are cut by the boxes its sources hold, in the tensor's own
    coordinates (no ranks): the same for every tensor whose sources hold the same boxes in the same order and
    whose destinations keep the same boxes (every expert of a layer kind, every layer's weight of a kind), so a
    plan works each one out once. ``first``: each destination box's first cell number (boxes in a fixed order);
    :meth:`cells`: a box's cells, each with the indices of the source boxes that contain it. Keyed by the boxes'
    ranges: another tensor's boxes are equal, not the same objects, and tuples compare without Python calls."""

    def __init__(self, parts: tuple[Box, ...], boxes):
        self.parts, self.first, self._cells = parts, {}, {}
        number = 0
        for box in sorted(boxes, key=lambda b: b.ranges):
            self.first[box.ranges] = number
            inters = [inter for b in parts if (inter := b.intersect(box)) is not None]
            # one cell where every part covers the box (most boxes: held whole by each of their holders)
            number += 1 if all(p == box for p in inters) else math.prod(len(c) for c in _cuts(box, inters))

    def cells(self, box: Box) -> list[tuple[Box, list[int]]]:
        got = self._cells.get(box.ranges)
        if got is None:
            found = [(i, inter) for i, b in enumerate(self.parts) if (inter := b.intersect(box)) is not None]
            cells = _cells(box, [inter for _, inter in found])
            got = self._cells[box.ranges] = [
                (cell, [i for i, inter in found if inter.contains(cell)]) for cell in cells
            ]
        return got


class _Cells:
    """Each destination box's cells and their holders, numbered per tensor over its boxes in a fixed order (the
    holder rule's cell numbers). A tensor's boxes are numbered on first use (counting cells needs no holders); a
    box is cut into its cells only when asked for. Tensors cut alike share one :class:`_Shape`."""

    def __init__(self, src: Layout, dests: _Destinations):
        self.src, self.dests = src, dests
        self.named: dict[str, tuple[_Shape, list[list]]] = {}  # name -> its shape, each source box's holdings
        self.shapes: dict[tuple, _Shape] = {}  # (source boxes, destination boxes) -> their shape
        self.cells: dict[tuple[str, Box], list] = {}
        self.moduli: set[int] | None = None  # set: the numbers of holders the rule was asked to choose among
        # a cell's holders grouped by their dict of local tensors (choose: a vector's rule by position), worked out
        # once per cell: the serve loop asks once per keeper (512 ranks: 256 holders of a norm, 512 keepers)
        self._groups: dict[int, list[list]] = {}

    def choose(self, name: str, cell: int, served: int, holders: list, near: tuple[int, int] | None):
        """The holder that serves the ``served``-th destination that needs cell number ``cell`` of tensor ``name``
        from another rank: by :func:`_holder`, or, for a vector of fewer than :data:`NEAR_BYTES` (``near``: the
        destination's :meth:`_Destinations.near`), by position (:data:`NEAR_BYTES`)."""
        if near is None or len(holders) == 1:
            if self.moduli is not None:
                self.moduli.add(len(holders))
            return holders[_holder(name, cell, served, len(holders))]
        groups = self._groups.get(id(holders))  # (a cell's holders are one list for the plan's life)
        if groups is None:
            tensors, by_dict = self.src.tensors, {}
            for h in holders:
                by_dict.setdefault(id(tensors[h[0]]), []).append(h)
            groups = self._groups[id(holders)] = list(by_dict.values())
        i, n = near
        group = groups[i * len(groups) // n]  # by position; in it, the hashed rule
        if self.moduli is not None:
            self.moduli.add(len(group))
        return group[_holder(name, cell, served, len(group))]

    def of(self, name: str, box: Box) -> tuple[int, list]:
        """``(number of the first cell, cells)``; a cell is ``(box, holders, {rank: its first holding})``."""
        got = self.named.get(name)
        if got is None:
            got = self.named[name] = self._number(name)
        shape, holdings = got
        key = (name, box)
        cells = self.cells.get(key)
        if cells is None:
            cells = self.cells[key] = self._cut(name, box, shape, holdings)
        return shape.first[box.ranges], cells

    def _number(self, name: str) -> tuple[_Shape, list[list]]:
        pieces: dict[Box, list] = {}
        tensors = self.src.tensors
        for rank, local, seg in self.src.holdings(name):
            pieces.setdefault(seg.box, []).append((rank, tensors[rank][local], seg))
        boxes = self.dests.boxes(name)
        key = (tuple(b.ranges for b in pieces), frozenset(b.ranges for b in boxes))
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = _Shape(tuple(pieces), boxes)
        return shape, list(pieces.values())

    def _cut(self, name: str, box: Box, shape: _Shape, holdings: list[list]) -> list:
        cells = []
        for cell, parts in shape.cells(box):
            holders = [h for i in parts for h in holdings[i]]
            if not holders:
                d = next(d for _, d, _ in self.dests.keepers((name, box)))
                raise ValueError(
                    f"destination rank {d} keeps {name} {cell.ranges} but no rank of the "
                    f"source layout ({self.src.description}) holds it; build both layouts from "
                    "the same model specs"
                )
            cells.append((cell, holders, {h[0]: h for h in reversed(holders)}))  # by rank: its first
        return cells


@paused_gc()
def build_reshard_plan(src: Layout, dst: Layout, *, rank: int | None = None) -> ReshardPlan:
    """Plan every byte every ``dst`` rank keeps, from the ``src`` ranks that hold it.

    ``rank``: only the transfers that ``rank`` sends or receives (or copies locally), in the whole plan's
    order: what that rank of the job needs (:attr:`ReshardPlan.rank`). It cuts only the tensors that rank
    holds or keeps and walks only their destinations, so its cost follows the rank's share, not the job's.

    Raises ``ValueError`` naming the first HF tensor of ``dst`` that no source
    holds (e.g. the two layouts were built from different models); with ``rank``, only on the ranks that keep
    or hold that tensor, so a job reports it to the others (``TrainerRefit`` / ``EngineRefit``: at the agreement).
    """
    dests = _Destinations(dst)
    cells = _Cells(src, dests)
    if rank is None:
        for name in sorted(dests.names):  # every box cut up front: a tensor no source holds is named at once
            for box in sorted(dests.boxes(name), key=lambda b: b.ranges):
                cells.of(name, box)
        return ReshardPlan(src, dst, _all_transfers(dst, dests, cells))
    return ReshardPlan(src, dst, _rank_transfers(src, dst, dests, cells, rank), rank=rank)


class _Emit:
    """Builds transfers, each source run once (a fused local tensor holds several HF tensors' boxes)."""

    def __init__(self, dst: Layout):
        self.dst, self.runs, self.itemsize = dst, {}, {}

    def __call__(self, lt: LocalTensor, seg: Segment, cell: Box, choice, d: int) -> Transfer:
        r, slt, sseg = choice
        name = seg.name
        key = (r, slt.name, name, cell)
        run = self.runs.get(key)
        if run is None:
            run = self.runs[key] = _run(slt, sseg, cell)
        return Transfer(name, cell, r, d, run, _run(lt, seg, cell), self.size(name))

    def size(self, name: str) -> int:
        """Tensor ``name``'s itemsize."""
        size = self.itemsize.get(name)
        if size is None:
            size = self.itemsize[name] = self.dst.specs[name].dtype.itemsize
        return size


def _all_transfers(dst: Layout, dests: _Destinations, cells: _Cells) -> list[Transfer]:
    served: dict[tuple[str, Box, int], int] = defaultdict(int)  # destinations given each cell from another rank
    emit, transfers = _Emit(dst), []
    for d in dst.ranks:
        for lt, seg in dests.entries[dests.group[d]]:
            first, cs = cells.of(seg.name, seg.box)
            small = dests.small(seg.name)
            for ci, (cell, holders, by_rank) in enumerate(cs):
                choice = by_rank.get(d)
                if choice is None:  # another rank's: the holder rule (module docstring)
                    key = (seg.name, seg.box, ci)
                    near = dests.near(seg.name, seg.box, by_rank)[d] if small else None
                    choice = cells.choose(seg.name, first + ci, served[key], holders, near)
                    served[key] += 1
                transfers.append(emit(lt, seg, cell, choice, d))
    return transfers


def _rank_transfers(src: Layout, dst: Layout, dests: _Destinations, cells: _Cells, rank: int) -> list[Transfer]:
    """The transfers of the whole plan that ``rank`` sends or receives, in its order (the same holder rule:
    a destination's ``served`` count is the number of keepers of the box before it that need the cell from
    another rank), tensor by tensor. Tensors alike (:class:`_Alike`: every layer's weight of a kind, held and
    kept by the same ranks at the same places) take one worked-out list of transfers with their own names."""
    found: list[tuple[tuple[int, int, int], Transfer]] = []  # (plan order key, transfer)
    alike = _Alike(src, dests, cells, rank, _Emit(dst))
    names: dict[str, None] = {}  # what this rank keeps (in its entries' order), then what it serves to others
    if rank in dests.group:
        names.update((seg.name, None) for _, seg in dests.entries[dests.group[rank]])
    held = {seg.name for lt in src.tensors.get(rank, {}).values() for seg in lt.segments}
    names.update((name, None) for name in sorted(held & dests.names))
    for name in names:
        alike.add(name, found)
    found.sort(key=lambda kt: kt[0])
    return [t for _, t in found]


# A tensor held more times than this (data-parallel replicas of a large job) is worked out by the rule alone, not
# from a template: the rule spreads its cells over the holders by a hash of its name, so no two tensors take one
# template, and the template's bookkeeping grows with the holdings (a TP2xPP2xDP128 trainer: 256 holdings of each
# norm; benchmarks/plan_at_scale.py at 512 ranks, CPU VM: a rank's plan 445 -> 380 ms).
ALIKE_MAX_HOLDINGS = 32


class _Alike:
    """One rank's transfers of each tensor, from a template per kind of tensor. Two tensors are alike when their
    holdings (ranks, local tensor shapes, rows, boxes, in order), their destinations' segments (groups, local
    tensor shapes, rows, boxes, in order), their dtype and vector rule, and their name's hash modulo every number
    of holders the rule chose among, agree: then every choice, cut and run of one is the other's, and only the
    names (the tensor's, its local tensors') and the destinations' entry indices differ. A template lists each
    transfer by the positions of its holding and destination entry; the first tensor of a kind is worked out by
    the rule (:meth:`_work_out`), the others take its template (the 3.6B preset on a TP2 rank: 255 tensors, 9 kinds)."""

    def __init__(self, src: Layout, dests: _Destinations, cells: _Cells, rank: int, emit: _Emit):
        self.src, self.dests, self.cells, self.rank, self.emit = src, dests, cells, rank, emit
        self.kinds: dict[tuple, tuple[tuple[int, ...], dict]] = {}  # key -> (moduli, {residues: template})

    def add(self, name: str, found: list) -> None:
        """Tensor ``name``'s transfers of this rank, ``(plan order key, transfer)``, appended to ``found``."""
        dests, tensors = self.dests, self.src.tensors
        held = self.src.holdings(name)
        if len(held) > ALIKE_MAX_HOLDINGS:  # replicas: the rule tells tensors apart (ALIKE_MAX_HOLDINGS)
            self._work_out(name, held, None, found)
            return
        size = self.emit.size(name)
        ents = [(g, i) for g, by_name in dests._by_name.items() for i in by_name.get(name, ())]  # its entries
        entries = dests.entries
        key = (
            tuple([(r, tensors[r][local].shape, seg.row, seg.box.ranges) for r, local, seg in held]),
            tuple([(g, entries[g][i][0].shape, entries[g][i][1].row, entries[g][i][1].box.ranges) for g, i in ents]),
            size,
            dests.small(name),
        )
        kind = self.kinds.get(key)
        template = None
        if kind is not None:
            moduli, templates = kind
            residues = tuple([_name_hash(name) % m for m in moduli])
            template = templates.get(residues)
        if template is None:
            template, moduli = self._work_out(name, held, ents)
            residues = tuple([_name_hash(name) % m for m in moduli])
            self.kinds.setdefault(key, (moduli, {}))[1][residues] = template
        for p, q, ci, cell, k, r, d, src_run, dst_run in template:
            g, i = ents[q]
            found.append(
                (
                    (p, i, ci),
                    Transfer(name, cell, r, d, Run(held[k][1], *src_run), Run(entries[g][i][0].name, *dst_run), size),
                )
            )

    def _work_out(self, name: str, held: list, ents: list | None, direct: list | None = None) -> tuple[list, tuple]:
        """Tensor ``name``'s transfers for this rank by the rule, as a template: ``(position, destination entry's
        position, cell index, cell, holding's position, source rank, destination rank, source run, destination
        run)`` (runs without their local tensor's name), and the numbers of holders the rule chose among.
        ``direct``: a list the transfers (with their plan order keys) are appended to instead (no template)."""
        dests, cells, rank = self.dests, self.cells, self.rank
        template: list = []
        if direct is not None:

            def emit(lt: LocalTensor, seg: Segment, cell: Box, choice, d: int, key: tuple[int, int, int]) -> None:
                direct.append((key, self.emit(lt, seg, cell, choice, d)))

        else:
            at_holding = {(r, id(seg)): k for k, (r, _, seg) in enumerate(held)}
            at_entry = {e: q for q, e in enumerate(ents)}

            def emit(lt: LocalTensor, seg: Segment, cell: Box, choice, d: int, key: tuple[int, int, int]) -> None:
                r, slt, sseg = choice
                q = at_entry[(dests.group[d], key[1])]
                src_run, dst_run = _run(slt, sseg, cell), _run(lt, seg, cell)
                template.append((key[0], q, key[2], cell, at_holding[(r, id(sseg))], r, d, src_run[1:], dst_run[1:]))

        cells.moduli = set()
        try:
            small = dests.small(name)
            if rank in dests.group:  # what this rank keeps
                g, pos = dests.group[rank], dests.position[rank]
                for si in dests._by_name[g].get(name, ()):
                    lt, seg = dests.entries[g][si]
                    first, cs = cells.of(name, seg.box)
                    keepers = None
                    for ci, (cell, holders, by_rank) in enumerate(cs):
                        choice = by_rank.get(rank)
                        if choice is None and len(holders) == 1:  # one holder: every rule picks it (no count needed)
                            choice = holders[0]
                        elif choice is None:
                            keepers = keepers or dests.keepers((name, seg.box))
                            served = sum(1 for p, d, i in keepers if (p, i) < (pos, si) and d not in by_rank)
                            near = dests.near(name, seg.box, by_rank)[rank] if small else None
                            choice = cells.choose(name, first + ci, served, holders, near)
                        emit(lt, seg, cell, choice, rank, (pos, si, ci))
            if any(r == rank for r, _, _ in held):  # what this rank serves to others
                for box in dests.boxes(name):
                    first, cs = cells.of(name, box)
                    mine = [ci for ci, (_, _, by_rank) in enumerate(cs) if rank in by_rank]
                    if not mine:
                        continue
                    keepers = dests.keepers((name, box))
                    for ci in mine:
                        cell, holders, by_rank = cs[ci]
                        if len(holders) == 1:  # this rank alone: it serves every keeper that needs the cell
                            for p, d, si in keepers:
                                if d != rank:
                                    lt, seg = dests.entries[dests.group[d]][si]
                                    emit(lt, seg, cell, holders[0], d, (p, si, ci))
                            continue
                        served, near = 0, dests.near(name, box, by_rank) if small else None
                        for p, d, si in keepers:
                            if d in by_rank:
                                continue
                            choice = cells.choose(name, first + ci, served, holders, near and near[d])
                            served += 1
                            if choice[0] == rank:
                                lt, seg = dests.entries[dests.group[d]][si]
                                emit(lt, seg, cell, choice, d, (p, si, ci))
            return template, tuple(sorted(cells.moduli))
        finally:
            cells.moduli = None


def check_reshard_plan(plan: ReshardPlan) -> None:
    """Raise ``AssertionError`` unless every element every destination keeps
    arrives exactly once, from a rank that holds it, and nothing else arrives."""
    by_seg: dict[tuple[int, str, str], list[Transfer]] = defaultdict(list)
    for t in plan.transfers:
        by_seg[(t.dst, t.dst_run.local, t.name)].append(t)
        src_ok = any(seg.box.contains(t.box) for r, _, seg in plan.src.holdings(t.name) if r == t.src)
        assert src_ok, f"source rank {t.src} does not hold {t.name} {t.box.ranges}"
    matched = 0
    for d in plan.dst.ranks:
        for lt, seg in plan.dst.segments(d):
            ts = [t for t in by_seg.get((d, lt.name, seg.name), []) if seg.box.contains(t.box)]
            matched += len(ts)
            assert sum(t.box.numel for t in ts) == seg.box.numel, (
                f"rank {d} {seg.name}: {sum(t.box.numel for t in ts)} of {seg.box.numel} elements planned"
            )
            for i, a in enumerate(ts):
                for b in ts[i + 1 :]:
                    assert a.box.intersect(b.box) is None, f"rank {d} {seg.name}: {a.box} and {b.box} overlap"
    assert matched == len(plan.transfers), (
        f"{len(plan.transfers) - matched} transfers deliver bytes no destination segment keeps"
    )


def sub_layout(layout: Layout, ranks) -> Layout:
    """``layout`` restricted to ``ranks`` (e.g. one engine replica)."""
    ranks = tuple(r for r in layout.ranks if r in set(ranks))
    return Layout(ranks, {r: layout.tensors[r] for r in ranks}, layout.specs, f"{layout.description} ranks {ranks}")


def merge_layouts(*layouts: Layout) -> Layout:
    """One source layout from several (trainer ranks and engine replicas that
    already hold the version); a rank in two of them keeps both sets of tensors."""
    ranks, tensors = [], {}
    for lay in layouts:
        for r in lay.ranks:
            if r not in tensors:
                ranks.append(r)
                tensors[r] = {}
            clash = set(tensors[r]) & set(lay.tensors[r])
            if clash:
                raise ValueError(f"rank {r} has local tensor {sorted(clash)[0]!r} in two layouts")
            tensors[r] = {**tensors[r], **lay.tensors[r]}
    return Layout(tuple(ranks), tensors, layouts[0].specs, " + ".join(lay.description for lay in layouts))


def fanout_plans(src: Layout, dst: Layout, replicas: list[list[int]], *, first_wave: int = 1) -> list[ReshardPlan]:
    """Waves of plans that update ``replicas`` (lists of ``dst`` ranks):
    wave 0 updates ``first_wave`` replicas from ``src``; every later wave
    updates as many replicas as are already updated, from ``src`` and those
    replicas, so the number of sources doubles and the trainers' links stop
    being the limit. Run the waves in order; a replica serves only after it
    applied the version (see :class:`~..exec.reshard.FanoutRefit`)."""
    if first_wave < 1:
        raise ValueError(f"first_wave must be >= 1, got {first_wave}")
    plans, done, todo = [], [], list(replicas)
    size = first_wave
    while todo:
        wave, todo = todo[:size], todo[size:]
        sources = merge_layouts(src, *(sub_layout(dst, r) for r in done)) if done else src
        plans.append(build_reshard_plan(sources, sub_layout(dst, [r for rep in wave for r in rep])))
        done += wave
        size = len(done)
    return plans
