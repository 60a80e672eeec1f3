"""The eager engine: keep means "hold what backward reads", and pay only where something is saved.

One ``ScopedRegion`` serves one checkpointed call of one layer (``torch.utils.checkpoint``,
non-reentrant; this module supplies its ``context_fn``). It follows the layer's markers
and splits the forward into *segments*, the stretches between two marker events.

Where ops run
    A dispatch mode is pushed only for the segments that save something: those inside a
    kept interval, and those where routing, collective or device-to-host ops ran (learnt on
    a layer's first call, when every segment is watched; a call whose markers differ from
    what was learnt watches every segment from the first difference on and relearns).
    Everything else runs at native speed, in forward and in the replay.

What is held
    Inside a watched segment every output of a *kept* op (any non-view, non-in-place,
    non-random op of a kept interval, and routing/collective ops anywhere) is held
    provisionally, then released as soon as it is proven unread:

    * it is *read by backward* when autograd saves it (a saved-tensor hook, pushed only
      for watched segments, records the storages it packs);
    * it is *read by the replay* when an op that reruns in backward takes it as input
      (seen in watched segments; views and the written argument of an in-place op do not
      count, they only alias);
    * it *may be read later* while anything besides the region still references its
      storage: at each kept op and when the segment closes, an unreferenced storage that
      nothing packed or pinned is dropped, since nothing can read it any more.

    A cheap op held only because it read a held output is rerun in the replay instead when
    everything it read stays held: holding its output too would hold both. And when what it
    read is about to be dropped (nothing references or reads it), it is held instead of the
    op's output if it is the smaller (a bf16 GEMM output against its fp32 cast) and that output
    is read; while that is not known yet, it waits, alive, and only while it is the smaller.

    What is still referenced when its segment closes is held, unless no tensor was saved
    for backward after that point: the replay stops at the last saved tensor
    (``early_stop``), so nothing after it reruns. A dropped output costs nothing: in the
    replay its op is neither rerun nor served, a NaN-filled placeholder of the same shape stands in,
    and no op that reads a placeholder's value runs before the replay stops.

The replay serves each held output once (then lets it go) and refuses a second
backward through the same forward, as torch's own selective checkpointing does.
Imports: ``held`` (its records and helpers), ``interval_plan``, ``learnt``, ``ops``, ``region``,
``_torch_internals``; plus torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from actplan._engine.held import (
    Entry,
    HeldOutput,
    PhaseContext,
    RegionPhase,
    SegmentMode,
    Wrapped,
    dense_leaves,
    inner_tensors,
    input_storages,
    is_dense_tensor,
    is_parameter,
    make_placeholder,
    single_inner,
    tensor_args,
    wrapper_alias,
)
from actplan._engine.interval_plan import IntervalPlan
from actplan._engine.learnt import HeldReport, LearntLayout, LearntState
from actplan._engine.ops import _TRAITS, always_replayed, always_saved, op_traits
from actplan._engine.region import (
    KeptTensorMutatedError,
    MarkerError,
    MarkerState,
    mutation_error,
    rewrite_error,
)
from actplan._torch_internals import (
    TorchDispatchMode,
    TorchInternalsError,
    checkpoint_frame,
    detach_alias,
    disable_current_modes,
    python_storage_refs,
    saved_count,
    storage_key_of,
    storage_use_count,
    tensor_version,
    top_saved_tensors_hooks,
    tree_flatten,
    tree_unflatten,
)
from actplan.markers import LAYER_END
from actplan.units import MarkerInterval

_FORWARD, _REPLAY = RegionPhase.FORWARD, RegionPhase.REPLAY
_ONE, _TUPLE = object(), object()  # an op's output spec: one tensor, or a tuple of tensors
_Tensor = torch.Tensor

# The record of an op the replay reruns carries only the op: one per op, shared (never changed).
_RERUN_ENTRIES: dict[int, Entry] = {}


def _rerunnable_outputs(entry: Entry) -> list[HeldOutput] | None:
    # A held cheap op's outputs, if the replay may rerun it instead: all still held, none a
    # routing output, all floating point.
    made = [leaf for leaf in entry.leaves or () if isinstance(leaf, HeldOutput)]
    if not made or any(o.value is None or o.routing or not o.meta[2].is_floating_point for o in made):
        return None
    return made


def _rerun_entry(func) -> Entry:
    entry = _RERUN_ENTRIES.get(id(func))
    if entry is None:
        entry = _RERUN_ENTRIES[id(func)] = Entry(func)
    return entry


class ScopedRegion(MarkerState):
    """Marker state, watched segments and held outputs for one checkpointed call."""

    def __init__(
        self,
        plan: IntervalPlan,
        learnt: LearntState,
        layer_name: str | None = None,
        layer: Any = None,
        *,
        offloader: Any = None,
        watch_every_segment: bool = False,
        observer: Any = None,
    ) -> None:
        super().__init__(plan, learnt, layer_name)
        self.layer = layer
        self.offloader = offloader
        self.observer = observer  # told of each placeholder the replay serves (verify's)
        self.layout: LearntLayout | None = learnt.layout(layer)
        self.watch_all = self.layout is None or watch_every_segment
        self.relearn = self.layout is None
        self.python_refs = python_storage_refs()
        self.phase = RegionPhase.IDLE
        self.segment = 0  # marker events so far
        self.current_kept: MarkerInterval | None = None  # innermost kept interval open now
        self.segment_kept: list[MarkerInterval | None] = [None]  # per segment, for learning
        self.left_path_at = 0  # the segment where a call left the learnt path
        self.marker_names: list[str] = []
        self.watched: dict[int, list[Entry]] = {}  # segment -> its ops, in forward order
        self.entries: list[Entry] = []  # the watched segment's, while one is open
        self.forward_mode = self.replay_mode = None  # made on first use, reused per segment
        self.routing_segments: set[int] = set()
        self.busy_segments: set[int] = set()  # segments where an op other than a view ran
        self.mode: TorchDispatchMode | None = None
        self.hooks: Any = None
        self.outer_pack: Any = None
        self.frame: Any = None
        # Held outputs: undecided ones by storage; every storage the region references.
        self.pending: dict[int, list[HeldOutput]] = {}
        self.refs: dict[int, int] = {}
        self.held: list[HeldOutput] = []
        self.packed: set[int] = set()
        # Storages read by an op the replay reruns -> saved-tensor count at the first such read
        # (-1 when unknown): a read after the last saved tensor never reruns.
        self.pinned: dict[int, int] = {}
        # Outputs still referenced when their segment closed, by storage, and for those still
        # referenced when an unwatched segment began, the saved-tensor count at the first such
        # start (-1 when unknown): an unwatched segment reruns only if a later tensor is saved.
        self.undecided: dict[int, list[HeldOutput]] = {}
        self.exposed: dict[int, int] = {}
        # Learning calls only, per kept interval (None: routing): the storages autograd saved
        # while it was open, and the storages its kept ops produced (both with their sizes).
        self.saved_in: dict[MarkerInterval | None, dict[int, int]] = {}
        self.produced: dict[MarkerInterval | None, dict[int, int]] = {}
        self.replay_entries: list[Entry] = []
        self.cursor = 0
        self.replayed = False
        # Routing outputs written in place after they were held (their copies, by storage), and
        # in the replay, the version at which autograd first saved each served copy.
        self.rewritten: dict[int, HeldOutput] = {}
        self.saved_versions: dict[int, tuple[torch.Tensor, int]] = {}
        # Cheap ops held because they read a held output, with their inputs' storages: rerun
        # in the replay instead when every input stays held (``_rerun_cheap_ops``).
        self.cheap: list[tuple[Entry, list[list[HeldOutput]]]] = []
        # The same, by the storage of each held output they read: when such an output is about
        # to be dropped, holding it instead of their outputs may cost less (``_drop_unread``).
        self.cheap_readers: dict[int, list[tuple[Entry, list[list[HeldOutput]]]]] = {}
        # Outputs only such ops read, alive until those ops' outputs are settled, by storage.
        self.waiting: dict[int, list[HeldOutput]] = {}

    def contexts(self) -> tuple[PhaseContext, PhaseContext]:
        """``torch.utils.checkpoint``'s ``context_fn`` result: (forward, replay)."""
        return PhaseContext(self, replay=False), PhaseContext(self, replay=True)

    # -- segments -----------------------------------------------------------------------------

    def _watching(self) -> bool:
        if self.watch_all or self.current_kept is not None:
            return True
        return self.layout is not None and self.segment in self.layout.routing_segments

    def _open_segment(self) -> None:
        if self.phase is _FORWARD:
            if not self._watching():
                self._expose()
                return
            self.entries = self.watched[self.segment] = []
            if self.forward_mode is None:
                self.forward_mode = SegmentMode(self.run_forward_op)
            self.mode = self.forward_mode
            if self.outer_pack is not None:
                outer_pack, outer_unpack = self.outer_pack
                packed = self.packed

                saved_in = None
                if self.relearn:
                    saved_in = self.saved_in.setdefault(self.current_kept, {})

                def pack(tensor: torch.Tensor) -> Any:
                    # A subclass (a DTensor around a held output) saves its inner tensors.
                    for inner in (tensor,) if is_dense_tensor(tensor) else inner_tensors(tensor):
                        storage = inner.untyped_storage()
                        key = storage_key_of(storage)
                        packed.add(key)
                        if saved_in is not None and not is_parameter(inner):
                            saved_in[key] = storage.nbytes()
                    return outer_pack(tensor)

                self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)
                self.hooks.__enter__()
            self.mode.__enter__()
        elif self.phase is _REPLAY:
            entries = self.watched.get(self.segment)
            if entries is None:
                return
            self.replay_entries, self.cursor = entries, 0
            if self.replay_mode is None:
                self.replay_mode = SegmentMode(self.run_replay_op)
            self.mode = self.replay_mode
            if self.rewritten and self.outer_pack is not None:
                self._watch_rewritten_saves()
            self.mode.__enter__()

    def _close_segment(self) -> None:
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        if self.hooks is not None:
            hooks, self.hooks = self.hooks, None
            hooks.__exit__(None, None, None)
        if self.phase is _FORWARD:
            self._sweep(closing=True)

    def on_marker(self, marker: str) -> None:
        if self.phase is _REPLAY:
            if self.mode is not None:
                self._close_segment()
            self.segment += 1
            expected = self.marker_names[self.segment - 1] if self.segment <= len(self.marker_names) else None
            if marker != expected:
                raise MarkerError(
                    f"{self.layer_name}: the replay in backward emitted marker {marker!r} where the "
                    f"forward emitted {expected!r}; the layer's forward must take the same path when "
                    "it is recomputed (make the branch depend on inputs, not on global state)"
                )
            if marker != LAYER_END:
                self._open_segment()
            return
        if self.phase is not _FORWARD:
            super().on_marker(marker)
            return
        if self.mode is not None:
            self._close_segment()
        layout, position = self.layout, len(self.marker_names)
        on_path = (
            not self.watch_all
            and layout is not None
            and position < len(layout.markers)
            and layout.markers[position] == marker
        )
        if not on_path and not self.watch_all:
            # Not the path learnt: watch everything from here on, and relearn. The marker
            # state machine, skipped while on the (already validated) path, catches up first.
            self.watch_all = self.relearn = True
            self.left_path_at = self.segment
            for earlier in self.marker_names:
                self.op_count += 1  # none of the intervals closed here ran idle
                super().on_marker(earlier)
        self.marker_names.append(marker)
        self.segment += 1
        if on_path:
            self.current_kept = layout.kept[self.segment]
            if marker == LAYER_END:
                self.finished = True
        else:
            super().on_marker(marker)
            self.current_kept = self.kept[-1] if self.kept else None
        self.segment_kept.append(self.current_kept)
        if marker == LAYER_END:
            self._end_forward()
        else:
            self._open_segment()

    # -- forward ------------------------------------------------------------------------------

    def begin_forward(self) -> None:
        self.phase = _FORWARD
        top = top_saved_tensors_hooks()
        self.frame = checkpoint_frame(top[0]) if top is not None else None
        if self.frame is None:
            # torch.utils.checkpoint pushes its hooks before entering context_fn's forward
            # context; without its frame the engine cannot tell where the replay stops.
            raise TorchInternalsError(
                f"{self.layer_name}: torch {torch.__version__}: the forward of a selectively "
                "checkpointed layer found no torch.utils.checkpoint frame in the saved-tensor "
                "hooks in effect; this torch orders checkpoint's hooks and context_fn differently. "
                "Use mode 'full' for this layer, or a torch release actplan is tested with, and "
                "please report it."
            )
        self.outer_pack = top
        self._open_segment()

    def run_forward_op(self, func, args, kwargs):
        self.op_count += 1
        traits = _TRAITS.get(id(func)) or op_traits(func)
        if traits.plain:
            # Most ops (not a view, routing, collective, in-place, random or host copy): held
            # only inside a kept interval, when expensive or reading a held output.
            if self.relearn:
                self.busy_segments.add(self.segment)
            interval = self.current_kept
            if interval is not None and (traits.expensive or self._reads_held(args, kwargs)):
                if self.pending:
                    self._sweep_pending()
                out = func(*args, **kwargs)
                entry = self._hold(func, out, interval, False)
                if not traits.expensive:
                    self._note_cheap(entry, args, kwargs)
                return out
            if self.pending or self.undecided:
                self._pin_reads(args, kwargs)
            self.entries.append(_rerun_entry(func))
            return func(*args, **kwargs)
        if traits.is_view and not traits.unsafe_alias:
            self.entries.append(_rerun_entry(func))  # a view reruns: free, and it holds nothing
            return func(*args, **kwargs)
        if not traits.is_view:
            self.busy_segments.add(self.segment)
        routing = self.plan.save_collectives and always_saved(traits, args, kwargs)
        replayed = always_replayed(traits, args, kwargs)
        interval = self.current_kept
        # Held: a kept interval's expensive ops, routing ops and ops reading what is held; and
        # routing ops outside every kept interval. (A cheap op whose inputs the replay recomputes
        # anyway reruns: holding its output would cost memory to save a little elementwise work.)
        if not replayed and interval is not None and (
            traits.expensive or routing or self._reads_held(args, kwargs)
        ):
            held = True
        elif not replayed and routing:
            held = True
            self.routing_segments.add(self.segment)
        else:
            held = False
        if not held:
            if self.refs and not traits.is_view and not traits.uninitialized:
                self._pin_inputs(func, traits, args, kwargs)
            self.entries.append(_rerun_entry(func))
            out = func(*args, **kwargs)
            if traits.unsafe_alias and self.refs:
                self._note_alias(args[0], out)
            return out
        if self.pending:
            self._sweep_pending()
        out = func(*args, **kwargs)
        entry = self._hold(func, out, interval, routing and not traits.collective)
        if interval is not None and not traits.expensive and not routing:
            self._note_cheap(entry, args, kwargs)
        return out

    def _note_cheap(self, entry: Entry, args, kwargs) -> None:
        # The held outputs this cheap op read, by identity: a storage address names one live
        # storage now, but may name another by the time the forward ends.
        keys = input_storages(args, kwargs)
        if keys is None:
            return
        holders = []
        for key in keys:
            if key not in self.refs:
                continue  # not held: the replay recomputes it, or it is the layer's input
            found = [
                h
                for h in (*self.pending.get(key, ()), *self.undecided.get(key, ()), *self.held)
                if h.storage == key and h.value is not None
            ]
            if not found:
                return
            holders.append(found)
        self.cheap.append((entry, holders))
        for key in {h.storage for found in holders for h in found}:
            self.cheap_readers.setdefault(key, []).append((entry, holders))

    def _reads_held(self, args, kwargs) -> bool:
        refs = self.refs
        if not refs:
            return False
        for leaf in tensor_args(args, kwargs):
            if is_dense_tensor(leaf):
                if storage_key_of(leaf.untyped_storage()) in refs:
                    return True
            elif not isinstance(leaf, nn.Parameter):
                found = single_inner(leaf)
                if found is None or storage_key_of(found[1].untyped_storage()) in refs:
                    return True  # (a subclass whose storage cannot be checked: assume held)
        return False

    def _pin_reads(self, args, kwargs) -> None:
        # ``_pin_inputs`` for an op that writes nothing: the replay reads its inputs. Only the
        # undecided outputs' pins are ever consulted (what is already held stays held).
        pending, undecided, pinned = self.pending, self.undecided, self.pinned
        for leaf in dense_leaves(args, kwargs):
            storage = storage_key_of(leaf.untyped_storage())
            if (
                (storage in pending or storage in undecided)
                and storage not in pinned
                and leaf.device.type != "meta"
            ):
                saved = self._saved_so_far()
                pinned[storage] = -1 if saved is None else saved

    def _pin_inputs(self, func, traits, args, kwargs) -> None:
        if not traits.mutated:
            self._pin_reads(args, kwargs)
            return
        written = set()
        for position, name in traits.mutated:
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                written.update(id(inner) for inner in inner_tensors(target))
        refs = self.refs
        for leaf in dense_leaves(args, kwargs):
            if leaf.device.type == "meta":
                continue
            storage = storage_key_of(leaf.untyped_storage())
            if storage not in refs:
                continue
            if id(leaf) in written:
                # Writing into a held output: fine while nothing reads it, an error once something does.
                for held in (*self.pending.get(storage, ()), *self.undecided.get(storage, ())):
                    held.mutated_by = held.mutated_by or func
                for held in self.held:
                    if held.storage == storage and held.mutated_by is None:
                        if held.routing:
                            self._copy_before_write(held, func)
                            continue
                        held.mutated_by = func
                        raise self._mutation(held)
                continue
            if storage not in self.pinned:
                saved = self._saved_so_far()
                self.pinned[storage] = -1 if saved is None else saved

    def _note_alias(self, source: Any, alias: torch.Tensor) -> None:
        # ``alias`` shares the storage of a held output but not its version counter: keep an
        # alias of it (sharing its counter) with the output, so the replay sees writes made
        # through it where no segment is watched. Costs no memory: the storage is held anyway.
        if not is_dense_tensor(source) or not is_dense_tensor(alias):
            return
        key = storage_key_of(source.untyped_storage())
        if key not in self.refs:
            return
        tracked = detach_alias(alias)
        for held in (*self.pending.get(key, ()), *self.undecided.get(key, ()), *self.held):
            if held.storage == key and held.value is not None:
                held.aliases = [*(held.aliases or ()), (tracked, tensor_version(tracked))]
                self.refs[key] += 1

    def _release_aliases(self, held: HeldOutput) -> None:
        if held.aliases:
            count = self.refs[held.storage] - len(held.aliases)
            if count:
                self.refs[held.storage] = count
            else:
                del self.refs[held.storage]
        held.aliases = None

    def _copy_before_write(self, held: HeldOutput, func: Any) -> None:
        # A routing output changed in place after it is held (top-k weights normalised with
        # `/=`, as many Hugging Face routers do): the replay is served a copy taken before the
        # write and reruns the write on it, so it sees what the forward saw. Routing outputs
        # are small (tokens x k); other held outputs stay an error (see ``_mutation``).
        value = held.value.clone()
        self._release_aliases(held)
        count = self.refs[held.storage] - 1
        if count:
            self.refs[held.storage] = count
        else:
            del self.refs[held.storage]
        storage = value.untyped_storage()
        held.value, held.storage, held.version = value, storage_key_of(storage), tensor_version(value)
        held.nbytes = storage.nbytes()
        self.refs[held.storage] = self.refs.get(held.storage, 0) + 1
        self.routing_segments.add(self.segment)  # learnt: later calls watch this write too
        held.rewritten_by = func
        self.rewritten[held.storage] = held

    def _hold(self, func, out, interval: MarkerInterval | None, routing: bool) -> Entry:
        if type(out) is _Tensor:
            leaves, spec = [out], _ONE
        elif type(out) is tuple and all(type(leaf) is _Tensor for leaf in out):
            leaves, spec = list(out), _TUPLE
        else:
            leaves, spec = tree_flatten(out)
        kept: list = []
        for leaf in leaves:
            if is_dense_tensor(leaf) and leaf.device.type != "meta":
                kept.append(self._hold_tensor(func, detach_alias(leaf), leaf, interval, routing, None))
            elif isinstance(leaf, torch.Tensor):
                held = None if routing else self._hold_wrapper(func, leaf, interval)
                kept.append(detach_alias(leaf) if held is None else held)  # else held as it is
            else:
                kept.append(leaf)
        entry = Entry(func, kept, spec)
        self.entries.append(entry)
        return entry

    def _hold_wrapper(self, func, leaf: torch.Tensor, interval: MarkerInterval | None) -> HeldOutput | None:
        found = wrapper_alias(leaf)
        if found is None:
            return None
        alias, inner, wrapped = found
        return self._hold_tensor(func, alias, inner, interval, False, wrapped)

    def _hold_tensor(
        self, func, alias, inner, interval: MarkerInterval | None, routing: bool, wrapped: Wrapped | None
    ) -> HeldOutput:
        # Routing and device-to-host outputs are held whatever reads them, and so are integer and
        # boolean outputs (ids, counts, masks): Python may read those without the dispatcher
        # seeing it (``counts.tolist()`` for split sizes), and they are small. A collective's
        # floating-point output is held while read, like a kept op's: dropped, it is not rerun
        # either (the replay gets a placeholder), and an all-gather read only by the held ``cat``
        # after it would otherwise be held twice.
        storage = inner.untyped_storage()
        key = storage_key_of(storage)
        if key not in self.refs:
            # A new storage: what was packed or pinned at this address before is gone.
            self.packed.discard(key)
            self.pinned.pop(key, None)
            self.cheap_readers.pop(key, None)
        held = HeldOutput(
            value=alias,
            interval=interval,
            storage=key,
            nbytes=storage.nbytes(),
            version=tensor_version(inner),
            meta=(inner.size(), inner.stride(), inner.dtype, inner.device),
            producer=func,
            routing=routing,
            wrapped=wrapped,
        )
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.relearn:
            self.produced.setdefault(interval, {})[key] = held.nbytes
        if routing or not (inner.is_floating_point() or inner.is_complex()):
            self.held.append(held)
        else:
            self.pending.setdefault(key, []).append(held)
        return held

    def _dead(self, storage: int) -> bool:
        return storage_use_count(storage) <= self.refs[storage] + self.python_refs

    def _sweep_pending(self) -> None:
        # Before each kept op: let the current segment's outputs nobody references go at once.
        packed, pinned, pending = self.packed, self.pinned, self.pending
        for storage in list(pending):
            outputs = pending.get(storage)  # (a cheap op's output may have gone meanwhile)
            if outputs is None:
                continue
            if storage in packed:
                del pending[storage]
                self._keep(outputs)
            elif storage not in pinned and self._dead(storage):
                del pending[storage]
                self._drop_unread(storage, outputs)
        if self.waiting:
            self._revisit_waiting(final=False)

    def _sweep(self, closing: bool) -> None:
        # Settle what the watched ops so far prove: saved by autograd (held), or unreferenced
        # and unread (dropped). Outputs a rerun op read are settled when the forward ends.
        packed, pinned, exposed, pending, undecided = (
            self.packed, self.pinned, self.exposed, self.pending, self.undecided,
        )  # fmt: skip
        for storage in list(pending):
            outputs = pending.get(storage)
            if outputs is None:
                continue
            if storage in packed:
                del pending[storage]
                self._keep(outputs)
            elif storage not in pinned and self._dead(storage):
                del pending[storage]
                self._drop_unread(storage, outputs)
            elif closing:
                del pending[storage]
                undecided.setdefault(storage, []).extend(outputs)
        for storage in list(undecided):
            outputs = undecided.get(storage)
            if outputs is None:
                continue
            if storage in packed:
                del undecided[storage]
                self._keep(outputs)
            elif storage not in exposed and storage not in pinned and self._dead(storage):
                del undecided[storage]
                self._drop_unread(storage, outputs)
        if self.waiting:
            self._revisit_waiting(final=False)

    def _expose(self) -> None:
        # An unwatched segment begins: what is still referenced may be read there unseen
        # (unless the first call showed that segment runs nothing but views).
        if not self.undecided or (self.layout is not None and self.segment in self.layout.inert_segments):
            return
        self._sweep(closing=False)
        saved = self._saved_so_far()
        for storage in self.undecided:
            self.exposed.setdefault(storage, -1 if saved is None else saved)
        if self.waiting:
            self._revisit_waiting(final=False)  # an exposed output counts as read

    def _keep(self, outputs: list[HeldOutput]) -> None:
        for held in outputs:
            if held.mutated_by is not None:
                raise self._mutation(held)
            self.held.append(held)

    def _drop(self, outputs: list[HeldOutput]) -> None:
        for held in outputs:
            if held.wrapped is not None and not held.wrapped.rebuilds(held.meta):
                self.held.append(held)  # the replay could not be served a placeholder for it
                continue
            if self.relearn and held.value is not None:
                # Dropped: nothing saved it, and its storage's address may come back for another.
                self.produced.get(held.interval, {}).pop(held.storage, None)
            self._release(held)

    def _release(self, held: HeldOutput) -> None:
        if held.value is not None:
            self._release_aliases(held)
            held.value = None
            count = self.refs[held.storage] - 1
            if count:
                self.refs[held.storage] = count
            else:
                del self.refs[held.storage]

    def _drop_unread(self, storage: int, outputs: list[HeldOutput]) -> None:
        # Nothing references or reads these outputs any more, but a held cheap op may have read
        # them (a dtype cast of a GEMM's output): holding them and rerunning that op costs less
        # than holding its output when they are the smaller. Decided as soon as that output's
        # fate is known; until then (only while they are the smaller) they wait, alive.
        if storage in self.cheap_readers and self._settle_for_cheap(storage, outputs, final=False):
            return
        self.cheap_readers.pop(storage, None)
        self._drop(outputs)

    def _revisit_waiting(self, final: bool) -> None:
        # Outputs waiting on a cheap reader's output: decide those whose reader's fate is known
        # now (``final``: the forward ended, decide all).
        for storage, outputs in list(self.waiting.items()):
            del self.waiting[storage]
            if not self._settle_for_cheap(storage, outputs, final):
                self.cheap_readers.pop(storage, None)
                self._drop(outputs)

    def _settle_for_cheap(self, storage: int, outputs: list[HeldOutput], final: bool) -> bool:
        """Hold ``outputs`` instead of what cheap ops made from them, or leave them waiting for
        those ops' outputs to be settled; ``False``: neither, drop them."""
        if any(
            h.mutated_by is not None or h.wrapped is not None or tensor_version(h.value) != h.version
            for h in outputs
        ):
            return False  # changed in place since: a rerun would read other values
        held_now = {id(h) for h in self.held}
        known = (self.packed, self.pinned, self.exposed)
        rerun: list[tuple[Entry, list[HeldOutput]]] = []
        freed: dict[int, int] = {}
        unsettled = 0
        for entry, holders in self.cheap_readers[storage]:
            made = _rerunnable_outputs(entry)
            if not made or any(o.storage == storage for o in made):
                continue
            if not all(id(o) in held_now or any(o.storage in k for k in known) for o in made):
                unsettled += sum(o.nbytes for o in made)  # read later or not: not known yet
                continue
            # Everything else it read must be held already: the replay serves it all.
            if all(
                any(h.storage == storage or (id(h) in held_now and h.value is not None) for h in found)
                for found in holders
            ):
                rerun.append((entry, made))
                freed.update((o.storage, o.nbytes) for o in made)
        cost = outputs[0].nbytes
        if rerun and cost < sum(freed.values()):
            self.cheap_readers.pop(storage, None)
            self._keep(outputs)
            for entry, made in rerun:
                for output in made:
                    self._forget(output)
                    self._release(output)
                entry.leaves = entry.spec = None
            self.held = [h for h in self.held if h.value is not None]
            return True
        if not final and cost < unsettled:
            self.waiting[storage] = outputs
            return True
        return False

    def _forget(self, held: HeldOutput) -> None:
        # Take an output out of the undecided records (it is released, not settled).
        for records in (self.pending, self.undecided, self.waiting):
            found = records.get(held.storage)
            if found is not None and any(h is held for h in found):
                rest = [h for h in found if h is not held]
                if rest:
                    records[held.storage] = rest
                else:
                    del records[held.storage]

    def _rerun_cheap_ops(self) -> None:
        # A cheap op is held when it reads a held output. If what it read stays held, the replay
        # can rerun it from that: holding its output too would hold both (a dtype cast and the
        # tensor it casts) where autograd keeps one. Forward order: an op that read a rerun
        # op's output keeps its own output held.
        changed = False
        for entry, holders in self.cheap:
            outputs = _rerunnable_outputs(entry)
            if not outputs:
                continue
            if not all(any(h.value is not None for h in found) for found in holders):
                continue
            if any(o is h for o in outputs for found in holders for h in found):
                continue
            for output in outputs:
                self._release(output)
            entry.leaves = entry.spec = None
            changed = True
        self.cheap.clear()
        self.cheap_readers.clear()
        if changed:
            self.held = [h for h in self.held if h.value is not None]

    def _saved_so_far(self) -> int | None:
        return None if self.frame is None else saved_count(self.frame)

    def _mutation(self, held: HeldOutput) -> KeptTensorMutatedError:
        kept = None if held.interval is None else self.plan.describe(held.interval)
        return mutation_error(self.layer_name, held.mutated_by, held.producer, kept, held.routing)

    def _end_forward(self) -> None:
        self._sweep(closing=False)
        saved = self._saved_so_far()
        for storage in list(self.undecided):
            outputs = self.undecided.pop(storage, None)
            if outputs is None:
                continue  # released meanwhile: a cheap op's output, rerun instead
            # Held only if a rerun op read it, or an unwatched segment it was exposed to runs,
            # before the replay stops (at the last saved tensor).
            reads = [c for c in (self.exposed.get(storage), self.pinned.get(storage)) if c is not None]
            if reads and (saved is None or min(reads) < saved):  # (-1: unknown, so held)
                self._keep(outputs)
                continue
            self._drop_unread(storage, outputs)
        if self.waiting:
            self._revisit_waiting(final=True)
        self.held = [h for h in self.held if h.value is not None]
        if self.cheap:
            self._rerun_cheap_ops()
        if self.relearn:
            # Inert: watched here and ran only views, or known inert before this call left the path.
            inert = {s for s in self.watched if s not in self.busy_segments}
            if self.layout is not None:
                inert |= {s for s in self.layout.inert_segments if s <= self.left_path_at}
            layout = LearntLayout(
                markers=tuple(self.marker_names),
                kept=tuple(self.segment_kept),
                routing_segments=frozenset(self.routing_segments),
                inert_segments=frozenset(inert),
            )
            self.learnt.learn(self.layer, layout)
        report = self._held_report()
        offloaded = self.plan.offload_intervals
        if offloaded:
            engine = self.offloader
            group = engine.current_group(self.layer_name)
            with disable_current_modes():  # host copies are not the step's device memory
                for held in self.held:
                    if held.interval in offloaded:
                        held.aliases = None  # they would keep the device storage alive
                        moved = engine.offload(held.value, group)
                        if moved is not held.value:
                            held.value, held.offloaded = moved, True
        self.learnt.record_held(self.layer_name, report)

    def _held_report(self) -> HeldReport:
        report = HeldReport()
        seen: set[int] = set()
        for held in self.held:
            if held.storage not in seen:
                seen.add(held.storage)
                report.held[held.interval] = report.held.get(held.interval, 0) + held.nbytes
        if not self.relearn:
            previous = self.learnt.held_reports().get(self.layer_name)
            report.autograd = dict(previous.autograd) if previous is not None else {}
            return report
        for interval in set(self.saved_in) | set(self.produced):
            # Routing outputs are compared with what autograd keeps of them, not with everything
            # saved outside kept intervals.
            kept = dict(self.saved_in.get(interval, {})) if interval is not None else {}
            kept.update((s, n) for s, n in self.produced.get(interval, {}).items() if s in self.packed)
            report.autograd[interval] = sum(kept.values())
        return report

    # -- replay -------------------------------------------------------------------------------

    def begin_replay(self) -> None:
        if self.replayed:
            raise RuntimeError(
                f"{self.layer_name}: backward ran a second time through a forward of this "
                "selectively checkpointed layer; held outputs are handed to the first backward "
                "only (as with torch's selective checkpointing). Run the forward again, or check "
                "this layer fully (mode: full) if you need retain_graph=True."
            )
        self.replayed = True
        self.phase = _REPLAY
        self.segment = 0
        for held in self.held:
            if held.offloaded:
                held.value = held.value.materialize()
                held.version = tensor_version(held.value)
        if self.rewritten:
            self.outer_pack = top_saved_tensors_hooks()  # the replay's own (recompute) hooks
        self._open_segment()

    def _watch_rewritten_saves(self) -> None:
        # The replay reruns the in-place write on a routing output's served copy. Autograd may
        # have saved that copy for the routing op's own backward before the write (top-k's
        # indices): note its version then, as autograd's version counter check would.
        outer_pack, outer_unpack = self.outer_pack
        rewritten, saved = self.rewritten, self.saved_versions

        def pack(tensor: torch.Tensor) -> Any:
            if is_dense_tensor(tensor):
                key = storage_key_of(tensor.untyped_storage())
                if key in rewritten and key not in saved:
                    saved[key] = (tensor, tensor_version(tensor))
            return outer_pack(tensor)

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)
        self.hooks.__enter__()

    def run_replay_op(self, func, args, kwargs):
        entries, index = self.replay_entries, self.cursor
        if index >= len(entries) or entries[index].func is not func:
            expected = entries[index].func if index < len(entries) else "nothing more"
            raise RuntimeError(
                f"{self.layer_name}: the replay in backward ran {func} where the forward ran "
                f"{expected}; the layer's forward must run the same ops when it is recomputed "
                "(check for branches on global state or on values that changed since forward)"
            )
        self.cursor = index + 1
        entry = entries[index]
        leaves = entry.leaves
        if leaves is None:
            return func(*args, **kwargs)
        served = [self._serve(leaf) for leaf in leaves]
        spec = entry.spec
        if spec is _ONE:
            return served[0]
        if spec is _TUPLE:
            return tuple(served)
        return tree_unflatten(served, spec)

    def _serve(self, leaf: Any) -> Any:
        if not isinstance(leaf, HeldOutput):
            return leaf
        value = leaf.value
        if value is None:
            return make_placeholder(leaf.meta, self.observer, leaf.wrapped)
        if not leaf.offloaded and (
            tensor_version(value if leaf.wrapped is None else single_inner(value)[1]) != leaf.version
            or (leaf.aliases and any(tensor_version(a) != v for a, v in leaf.aliases))
        ):
            kept = None if leaf.interval is None else self.plan.describe(leaf.interval)
            raise mutation_error(self.layer_name, None, leaf.producer, kept, leaf.routing)
        leaf.value = leaf.aliases = None  # handed to backward once
        return value

    def end_phase(self, failed: bool) -> None:
        self._close_segment()
        # The frame holds this region (through its replay context), and so do its modes (their
        # handlers are its methods): no cycle past the phase.
        self.frame = self.outer_pack = None
        self.forward_mode = self.replay_mode = None
        self.entries = []
        saved, self.saved_versions = self.saved_versions, {}
        changed = [key for key, (tensor, version) in saved.items() if tensor_version(tensor) != version]
        if self.phase is _REPLAY or failed:
            # Served or not, nothing is held past the replay (or past a failed forward).
            for held in self.held:
                held.value = held.aliases = None
            self.held.clear()
            self.pending.clear()
            self.undecided.clear()
            self.cheap.clear()
            self.cheap_readers.clear()
            self.waiting.clear()
            self.refs.clear()
            self.watched.clear()
        self.phase = RegionPhase.DONE if self.phase is _REPLAY else RegionPhase.FORWARD_DONE
        if changed:
            held = self.rewritten[changed[0]]
            raise rewrite_error(self.layer_name, held.rewritten_by, held.producer)

