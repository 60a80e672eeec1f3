"""A roofline clock: the time a step would take on a named accelerator, estimated op by op from
the FLOPs it computes and the bytes it moves, for runs on a machine that is not that accelerator
(fake tensors included, where nothing can be timed).

Per op: ``max(FLOPs / peak FLOP/s, bytes read and written / HBM bandwidth)``. FLOPs come from
``torch.utils.flop_counter``'s formulas (matrix products, convolutions, attention kernels, with
the CPU flash-attention op added here), at the accelerator's peak for the op's dtype; every other
op is charged for its bytes only. Views and allocations cost nothing. Collectives are priced on
the accelerator's links and laid on the step's streams (``_collectives``): FSDP's all-gathers
and reduce-scatters beside the compute, tensor and expert parallelism's in its path. These are
*estimates*: vendor peaks, no kernel efficiency, no launch overhead; ratios between plans (same
shapes, same ops) hold better than absolute seconds. Imports torch, ``_storage``,
``_torch_internals`` and ``_collectives``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter

from actplan._storage import storage_key
from actplan._torch_internals import DEVICE_QUERY, TorchDispatchMode, collective_call, op_schema
from actplan.measure._collectives import Collective, Streams, collective_seconds, spans_nodes

__all__ = ["ACCELERATORS", "LINKS", "Accelerator", "RooflineClock", "accelerator", "link_rate", "op_flops"]


@dataclass(frozen=True)
class Accelerator:
    """Peak figures of one accelerator (dense, no sparsity), each from the vendor's datasheet."""

    name: str
    bf16_flops: float  # dense BF16/FP16 tensor-core FLOP/s
    fp32_flops: float  # FP32 FLOP/s without TF32 (PyTorch's default for float32 matmuls)
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float  # one direction, host <-> device
    source: str
    memory_bytes: float = 80e9  # HBM capacity, the datasheet's GB (10^9 bytes)
    # Collectives' links, one direction per GPU: inside a node (NVLink, Infinity Fabric) and
    # across nodes (the node's NICs per GPU), with the source of both.
    intra_node_bytes_per_s: float = 0.0
    inter_node_bytes_per_s: float = 0.0
    gpus_per_node: int = 8
    links_source: str = ""
    # The node's host memory (10^9-byte GB), which every pinned host buffer of its GPUs shares.
    node_host_bytes: float = 2e12


ACCELERATORS: dict[str, Accelerator] = {
    accel.name: accel
    for accel in (
        Accelerator(
            "a100", 312e12, 19.5e12, 2.039e12, 32e9,
            "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, FP32 19.5 "
            "TFLOPS, HBM2e 2,039 GB/s; PCIe Gen4 x16 32 GB/s per direction; 80 GB HBM2e",
            memory_bytes=80e9,
            intra_node_bytes_per_s=300e9,
            inter_node_bytes_per_s=25e9,
            links_source="A100 datasheet: NVLink 600 GB/s (both directions); NVIDIA DGX A100 "
            "datasheet: 8 single-port ConnectX-6 200 Gb/s for the cluster network, one per GPU, and 2 TB "
            "of system memory",
        ),
        Accelerator(
            "h100", 989.4e12, 66.9e12, 3.35e12, 64e9,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity (989 "
            "dense), FP32 67 TFLOPS, HBM3 3.35 TB/s; PCIe Gen5 x16 64 GB/s per direction; 80 GB HBM3",
            memory_bytes=80e9,
            intra_node_bytes_per_s=450e9,
            inter_node_bytes_per_s=50e9,
            links_source="H100 datasheet (SXM5): NVLink 900 GB/s (both directions); NVIDIA DGX "
            "H100 datasheet: 8 ConnectX-7 400 Gb/s for the cluster network, one per GPU, and 2 TB of "
            "system memory",
        ),
        Accelerator(
            "h200", 989.4e12, 66.9e12, 4.8e12, 64e9,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity (989 "
            "dense), FP32 67 TFLOPS, HBM3e 4.8 TB/s; PCIe Gen5 x16 64 GB/s per direction; 141 GB HBM3e",
            memory_bytes=141e9,
            intra_node_bytes_per_s=450e9,
            inter_node_bytes_per_s=50e9,
            links_source="H200 datasheet (SXM): NVLink 900 GB/s (both directions); NVIDIA HGX "
            "H200 reference: one 400 Gb/s ConnectX-7 per GPU for the cluster network; NVIDIA DGX H200 "
            "datasheet: 2 TB of system memory",
        ),
        Accelerator(
            "b200", 2.25e15, 80e12, 8e12, 64e9,
            "NVIDIA HGX B200 datasheet (per GPU): FP16/BF16 4.5 PFLOPS with sparsity (2.25 dense), "
            "FP32 80 TFLOPS, HBM3e 8 TB/s; PCIe Gen5 x16 64 GB/s per direction; 180 GB HBM3e",
            memory_bytes=180e9,
            intra_node_bytes_per_s=900e9,
            inter_node_bytes_per_s=50e9,
            links_source="HGX B200 datasheet: NVLink 1.8 TB/s per GPU (both directions); NVIDIA "
            "DGX B200 datasheet: 8 single-port ConnectX-7 400 Gb/s for the cluster network, and 2 TB of "
            "system memory (up to 4 TB)",
        ),
        Accelerator(
            "mi300x", 1307.4e12, 163.4e12, 5.3e12, 64e9,
            "AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense, FP32 163.4 TFLOPS, HBM3 "
            "5.3 TB/s; PCIe Gen5 x16 64 GB/s per direction; 192 GB HBM3",
            memory_bytes=192e9,
            intra_node_bytes_per_s=448e9,
            inter_node_bytes_per_s=50e9,
            links_source="MI300X datasheet: 7 Infinity Fabric links of 128 GB/s (both directions) "
            "to the platform's other 7 GPUs; AMD Instinct MI300X platform: a 400 Gb/s NIC per GPU; "
            "host memory taken as a DGX-class node's 2 TB (set --host-budget)",
        ),
    )
}  # fmt: skip


LINKS: dict[str, tuple[float, str]] = {
    "pcie4": (32e9, "PCIe 4.0 x16: 16 GT/s on 16 lanes, about 32 GB/s per direction"),
    "pcie5": (64e9, "PCIe 5.0 x16: 32 GT/s on 16 lanes, about 64 GB/s per direction"),
    "pcie6": (128e9, "PCIe 6.0 x16: 64 GT/s on 16 lanes, about 128 GB/s per direction"),
    "nvlink-c2c": (450e9, "NVIDIA GH200 datasheet: NVLink-C2C 900 GB/s (both directions), CPU to GPU"),
    "nvlink3": (300e9, "A100 datasheet: NVLink 600 GB/s (both directions)"),
    "nvlink4": (450e9, "H100 datasheet: NVLink 900 GB/s (both directions)"),
    "nvlink5": (900e9, "B200 datasheet: NVLink 1.8 TB/s (both directions)"),
    "hdr": (25e9, "InfiniBand HDR: 200 Gb/s per port"),
    "ndr": (50e9, "InfiniBand NDR: 400 Gb/s per port"),
    "xdr": (100e9, "InfiniBand XDR: 800 Gb/s per port"),
    "eth-100g": (12.5e9, "Ethernet (RoCE) 100 Gb/s per port"),
    "eth-200g": (25e9, "Ethernet (RoCE) 200 Gb/s per port"),
    "eth-400g": (50e9, "Ethernet (RoCE) 400 Gb/s per port"),
}
"""Links by name, one direction (a network port counts per GPU: one NIC each), with the
standard or datasheet each rate comes from; ``link_rate`` reads them."""

_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(GB/s|Gb/s|TB/s)\s*$")


def link_rate(text: str, what: str = "link") -> float:
    """Bytes per second, one direction, of a link named in ``LINKS`` (``'pcie4'``, ``'ndr'``)
    or written as a rate (``'25GB/s'``, ``'400Gb/s'``). ``what`` names the flag in errors."""
    found = LINKS.get(text.strip().lower())
    if found is not None:
        return found[0]
    match = _RATE.match(text)
    if match:
        value = float(match.group(1)) * {"GB/s": 1e9, "Gb/s": 1e9 / 8, "TB/s": 1e12}[match.group(2)]
        if value > 0:
            return value
    known = ", ".join(f"{name} ({rate / 1e9:g} GB/s)" for name, (rate, _) in LINKS.items())
    raise ValueError(f"unknown {what} {text!r}; known: {known}; or a rate per direction such as '25GB/s'")


def accelerator(name: str | Accelerator) -> Accelerator:
    """The table's entry for ``name`` (case-insensitive); an error lists the table otherwise.
    An ``Accelerator`` (one of the table's with a field changed, say) is taken as it is."""
    if isinstance(name, Accelerator):
        return name
    found = ACCELERATORS.get(name.lower())
    if found is None:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
    return found


def _cpu_flash_forward(query, key, value, *args, out_val=None, **kwargs) -> int:
    shapes = flop_counter.get_shape(query), flop_counter.get_shape(key), flop_counter.get_shape(value)
    return flop_counter.sdpa_flop_count(*shapes)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    shapes = [flop_counter.get_shape(t) for t in (grad_out, query, key, value)]
    return flop_counter.sdpa_backward_flop_count(*shapes)


_aten = torch.ops.aten
_EXTRA_FORMULAS: dict[Any, Any] = {
    # The CPU flash-attention kernel (what fake runs on the CPU device use) does the work of the
    # GPU one; torch's counter has formulas for the GPU kernels only.
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


# Attention kernels -> where their query argument sits (after grad_out in the backward ones).
_QUERY_AT: dict[Any, int] = {
    **dict.fromkeys(
        (
            _aten._scaled_dot_product_flash_attention_for_cpu,
            _aten._scaled_dot_product_flash_attention,
            _aten._scaled_dot_product_efficient_attention,
            _aten._scaled_dot_product_cudnn_attention,
        ),
        0,
    ),
    **dict.fromkeys(
        (
            _aten._scaled_dot_product_flash_attention_for_cpu_backward,
            _aten._scaled_dot_product_flash_attention_backward,
            _aten._scaled_dot_product_efficient_attention_backward,
            _aten._scaled_dot_product_cudnn_attention_backward,
        ),
        1,
    ),
}


def _broadcast_key_value(args: tuple, query_at: int) -> tuple:
    # Grouped-query attention: key and value have fewer heads than the query, and the kernel
    # broadcasts them. torch < 2.13's formulas reject such shapes, so they are given the shapes
    # broadcast to the query's heads (the formulas read shapes only; newer torch does the same).
    query, key, value = args[query_at : query_at + 3]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return args
    heads = query.shape[1]
    if key.shape[1] == heads:
        return args
    key, value = (torch.Size((t.shape[0], heads, *t.shape[2:])) for t in (key, value))
    return (*args[: query_at + 1], key, value, *args[query_at + 3 :])


def op_flops(func, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op call (0 for ops without a formula: elementwise work is charged for
    its bytes)."""
    packet = getattr(func, "overloadpacket", func)
    query_at = _QUERY_AT.get(packet)
    if query_at is not None and len(args) >= query_at + 3:
        args = _broadcast_key_value(args, query_at)
    formula = _EXTRA_FORMULAS.get(packet) or flop_counter.flop_registry.get(packet)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _tensor_bytes(leaves) -> int:
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@dataclass
class OpCost:
    """What one kind of op added up to: calls, FLOPs, bytes moved and estimated seconds."""

    calls: int = 0
    flops: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0


class RooflineClock(TorchDispatchMode):
    """A dispatch mode that adds up estimated seconds on ``accelerator`` for every op it sees.

    ::

        clock = RooflineClock("h100")
        with clock:
            train_step(model, batch)
        clock.seconds, clock.flops, clock.bytes_moved, clock.by_op

    Enter it around forward and backward (a recomputing checkpoint replays its ops in backward,
    so they are counted; ops a kept unit's cache serves are not). Works on real and fake tensors.
    """

    def __init__(self, accelerator_name: Accelerator | str = "h100") -> None:
        super().__init__()
        self.accelerator = (
            accelerator(accelerator_name) if isinstance(accelerator_name, str) else accelerator_name
        )
        self.running = 0  # blocks entered and not yet left (the copy timer times only then)
        self.reset()

    def reset(self) -> None:
        """Zero the totals."""
        self.streams = Streams()
        self.flops = 0
        self.bytes_moved = 0
        self.by_op: dict[str, OpCost] = defaultdict(OpCost)
        self.collective_bytes: dict[str, int] = defaultdict(int)  # by kind, as each rank counts

    @property
    def seconds(self) -> float:
        """The step so far: compute, and the communication it waits for (``streams``)."""
        return self.streams.end

    @property
    def compute_seconds(self) -> float:
        return self.streams.compute_seconds

    @property
    def exposed_comm_seconds(self) -> float:
        """Communication the compute waits for: blocking collectives, all-gathers not hidden
        behind the unit before, reduce-scatters still running at the end."""
        return self.streams.exposed - self.streams.exposed_copies

    @property
    def exposed_copies_seconds(self) -> float:
        """Offload copies the compute waits for (``copy_timer``)."""
        return self.streams.exposed_copies

    def copy_timer(self) -> CopyTimer:
        """Times an offload engine's copies on this clock's streams at the host link, while the
        clock runs (``OffloadEngine.time_copies``)."""
        return CopyTimer(self)

    def __enter__(self) -> RooflineClock:
        self.running += 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.running -= 1
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return args[0].device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _ALLOCATES_ONLY:
            return out  # memory handed out, no kernel: nothing is read or written
        call = collective_call(func, args, kwargs, out)
        if call is not None:
            self._collective(func, *call)
            return out
        in_leaves = _tensors_in((args, kwargs), [])
        out_leaves = _tensors_in(out, [])
        writes = _WRITES.get(func)
        if writes is None:
            schema = op_schema(func)
            writes = schema is not None and any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
            )
            _WRITES[func] = writes
        if not writes:
            if not out_leaves:
                return out  # metadata (sizes, devices), no kernel
            read = {_storage_id(t) for t in in_leaves}
            if all(_storage_id(t) in read for t in out_leaves):
                return out  # a view (``_unsafe_view`` included): no work
        flops = op_flops(func, args, kwargs, out)
        moved = _tensor_bytes(in_leaves) + _tensor_bytes(out_leaves)
        seconds = self.op_seconds(flops, moved, _dtype_of(in_leaves))
        cost = self.by_op[str(getattr(func, "overloadpacket", func))]
        cost.calls += 1
        cost.flops += flops
        cost.bytes_moved += moved
        cost.seconds += seconds
        self.flops += flops
        self.bytes_moved += moved
        self.streams.compute(seconds)
        return out

    def _collective(self, func: Any, kind: str, blocking: bool, nbytes: int, ranks: list[int]) -> None:
        accel = self.accelerator
        across = spans_nodes(ranks, accel.gpus_per_node)
        link = accel.inter_node_bytes_per_s if across else accel.intra_node_bytes_per_s
        seconds = collective_seconds(Collective(kind), nbytes, len(ranks), link)
        cost = self.by_op[str(getattr(func, "overloadpacket", func))]
        cost.calls += 1
        cost.bytes_moved += nbytes
        cost.seconds += seconds
        self.collective_bytes[kind] += nbytes
        if blocking:
            self.streams.blocking(seconds)
        elif kind == "all-gather":
            self.streams.gather(seconds)
        else:
            self.streams.reduce(seconds)

    def op_seconds(self, flops: int, bytes_moved: int, dtype: torch.dtype | None) -> float:
        accel = self.accelerator
        peak = accel.fp32_flops if dtype in (torch.float32, torch.float64) else accel.bf16_flops
        return max(flops / peak, bytes_moved / accel.hbm_bytes_per_s)


# Ops that launch no kernel: allocations, and pointing a tensor at another storage (offload's
# reload on real tensors; a fake one is rebuilt by views, which cost nothing either).
_ALLOCATES_ONLY = frozenset(
    (
        _aten.empty.memory_format,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
        _aten.empty_like.default,
        _aten.set_.source_Storage_storage_offset,
        _aten.set_.source_Storage,
    )
)


@dataclass(frozen=True)
class CopyDone:
    """An offload copy on the clock: done at once for memory (a fake run has no values to
    wait for), ending at ``at`` seconds on the clock's streams."""

    at: float

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CopyTimer:
    """An offload engine's copies on a ``RooflineClock``'s copy streams at its accelerator's
    host link (see ``_collectives.Streams``); copies while the clock is not running cost nothing."""

    def __init__(self, clock: RooflineClock) -> None:
        self.clock = clock

    def copy_out(self, nbytes: int) -> CopyDone | None:
        clock = self.clock
        if not clock.running:
            return None
        return CopyDone(clock.streams.copy_out(nbytes / clock.accelerator.host_link_bytes_per_s))

    def copy_in(self, nbytes: int, after: CopyDone | None) -> CopyDone | None:
        clock = self.clock
        if not clock.running:
            return None
        seconds = nbytes / clock.accelerator.host_link_bytes_per_s
        return CopyDone(clock.streams.copy_in(seconds, after.at if after is not None else 0.0))

    def use(self, done: CopyDone | None) -> None:
        if done is not None and self.clock.running:
            self.clock.streams.use(done.at)


_WRITES: dict[Any, bool] = {}  # by op: whether its schema writes to an argument


def _tensors_in(tree: Any, into: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists, dicts of them), in order:
    ``tree_flatten``'s leaves that are tensors, without its generic walk (an op per call)."""
    if isinstance(tree, torch.Tensor):
        into.append(tree)
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            _tensors_in(item, into)
    elif isinstance(tree, dict):
        for item in tree.values():
            _tensors_in(item, into)
    return into


def _storage_id(tensor: torch.Tensor) -> int:
    try:
        return storage_key(tensor)
    except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
        return id(tensor)


def _dtype_of(leaves) -> torch.dtype | None:
    return next((t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
