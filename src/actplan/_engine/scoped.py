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
    Inside a watched segment every output of an op ``ops.keep_decision`` holds is held
    provisionally (``ledger.Ledger``), then released as soon as it is proven unread:

    * it is *read by backward* when autograd saves it (a saved-tensor hook, pushed only
      for watched segments, records the storages it packs);
    * it is *read by the replay* when an op that reruns in backward takes it as input
      (seen in watched segments; views and the written argument of an in-place op do not
      count, they only alias);
    * it *may be read later* while anything besides the region still references its
      storage: at each kept op and when the segment closes, an unreferenced storage that
      nothing packed or pinned is dropped, since nothing can read it any more.

    A cheap op held only because it read a held output never costs both its input and its
    output: ``cheap.CheapReruns`` keeps the one the replay needs.

    What is still referenced when its segment closes is held, unless no tensor was saved
    for backward after that point: the replay stops at the last saved tensor
    (``early_stop``), so nothing after it reruns. A dropped output costs nothing: in the
    replay its op is neither rerun nor served, a NaN-filled placeholder of the same shape stands in,
    and no op that reads a placeholder's value runs before the replay stops.

The replay serves each held output once (then lets it go) and refuses a second
backward through the same forward, as torch's own selective checkpointing does.

The other parts: ``guard.WriteGuard`` (in-place writes and aliases) and, while a call learns,
``probe.LearningProbe``. Imports those, ``ledger``, ``cheap``, ``held``, ``ops``,
``interval_plan``, ``learnt``, ``region``, ``_torch_internals``; plus torch.
"""

from __future__ import annotations

from typing import Any

import torch

from actplan._engine.cheap import CheapReruns
from actplan._engine.guard import WriteGuard
from actplan._engine.held import (
    Entry,
    HeldOutput,
    PhaseContext,
    RegionPhase,
    SegmentMode,
    is_dense_tensor,
    make_placeholder,
    storages_read,
)
from actplan._engine.interval_plan import IntervalPlan
from actplan._engine.learnt import LearntLayout, LearntState
from actplan._engine.ledger import Ledger
from actplan._engine.ops import _TRAITS, Keep, keep_decision, op_traits
from actplan._engine.probe import LearningProbe, held_report
from actplan._engine.region import MarkerError, MarkerState
from actplan._torch_internals import (
    TorchDispatchMode,
    TorchInternalsError,
    checkpoint_frame,
    detach_alias,
    disable_current_modes,
    python_storage_refs,
    saved_count,
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
_RERUN, _HOLD, _HOLD_ROUTING = Keep.RERUN, Keep.HOLD, Keep.HOLD_ROUTING

# The record of an op the replay reruns carries only the op: one per op, shared (never changed).
_RERUN_ENTRIES: dict[int, Entry] = {}


def _rerun_entry(func) -> Entry:
    entry = _RERUN_ENTRIES.get(id(func))
    if entry is None:
        entry = _RERUN_ENTRIES[id(func)] = Entry(func)
    return entry


class ScopedRegion(MarkerState):
    """Marker state, watched segments and the per-op handlers of one checkpointed call.

    Its parts: the ``Ledger`` of held outputs (fates, references, the evidence that settles
    them), the ``CheapReruns`` rule, the ``WriteGuard`` for in-place writes and aliases, and,
    while the call learns its layout, a ``LearningProbe``."""

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
        self.phase = RegionPhase.IDLE
        # Segments: marker events so far, the innermost kept interval open now (and per segment),
        # where a call left the learnt path, and the ops of each watched segment in forward order.
        self.segment = 0
        self.current_kept: MarkerInterval | None = None
        self.segment_kept: list[MarkerInterval | None] = [None]
        self.left_path_at = 0
        self.marker_names: list[str] = []
        self.watched: dict[int, list[Entry]] = {}
        self.entries: list[Entry] = []  # the watched segment's, while one is open
        self.routing_segments: set[int] = set()
        self.forward_mode = self.replay_mode = None  # made on first use, reused per segment
        self.mode: TorchDispatchMode | None = None
        self.hooks = self.outer_pack = self.frame = None  # this phase's, while it runs
        # The parts. The hot path reads the ledger's records through these names (same objects).
        unread = frozenset() if self.layout is None else self.layout.unread_sites  # (learnt path)
        self.ledger = ledger = Ledger(self._saved_so_far, python_storage_refs(), unread)
        self.guard = WriteGuard(ledger, plan, self.layer_name)
        self.cheap = ledger.cheap = CheapReruns(ledger)
        ledger.on_mutated = self.guard.mutation
        self.probe: LearningProbe | None = LearningProbe() if self.layout is None else None
        ledger.probe = self.probe
        self.pending, self.undecided, self.refs = ledger.pending, ledger.undecided, ledger.refs
        self._reads_held, self._pin_reads = ledger.reads_held, ledger.pin_reads
        # The replay: the watched ops of the segment it is in, and how far it got.
        self.replay_entries: list[Entry] = []
        self.cursor = 0  # (the replay's own hooks for routing copies: ``guard.replay_hooks``)
        self.replayed = False

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
                # What is still referenced may be read unseen here (unless the first call showed
                # that this segment runs nothing but views).
                inert = self.layout is not None and self.segment in self.layout.inert_segments
                if self.undecided and not inert:
                    self.ledger.expose()
                return
            self.entries = self.watched[self.segment] = []
            if self.forward_mode is None:
                self.forward_mode = SegmentMode(self.run_forward_op)
            self.mode = self.forward_mode
            if self.outer_pack is not None:
                probe = self.probe
                saved_in = None if probe is None else probe.saved_in.setdefault(self.current_kept, {})
                self.hooks = self.ledger.saved_tensor_hooks(self.outer_pack, saved_in)
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
            if self.guard.rewritten and self.outer_pack is not None:
                self.hooks = self.guard.replay_hooks(self.outer_pack)
                self.hooks.__enter__()
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
            self.ledger.sweep(closing=True)

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
            self.watch_all = True
            self.probe = self.ledger.probe = LearningProbe(busy=self.watched)
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
            probe = self.probe
            if probe is not None:
                probe.busy.add(self.segment)
            interval, reads_held = self.current_kept, self._reads_held
            if interval is not None and keep_decision(traits, args, kwargs, True, False, reads_held) is _HOLD:
                if self.pending:
                    self.ledger.sweep_pending()
                out = func(*args, **kwargs)
                entry = self._hold(func, out, interval, False)
                if not traits.expensive:
                    self.cheap.note(entry, storages_read(args, kwargs))
                return out
            if self.pending or self.undecided:
                self._pin_reads(args, kwargs)
            self.entries.append(_rerun_entry(func))
            return func(*args, **kwargs)
        if traits.is_view and not traits.unsafe_alias:
            self.entries.append(_rerun_entry(func))  # a view reruns: free, and it holds nothing
            return func(*args, **kwargs)
        if not traits.is_view and self.probe is not None:
            self.probe.busy.add(self.segment)
        interval = self.current_kept
        decision = keep_decision(
            traits, args, kwargs, interval is not None, self.plan.save_collectives, self._reads_held
        )
        held = decision is not _RERUN
        if held and interval is None:
            self.routing_segments.add(self.segment)  # a routing op outside every kept interval
        if not held:
            if self.refs and not traits.is_view and not traits.uninitialized:
                if traits.mutated:
                    if self.guard.check_writes(func, traits.mutated, args, kwargs, self._saved_so_far()):
                        self.routing_segments.add(self.segment)  # learnt: later calls watch the write
                else:
                    self._pin_reads(args, kwargs)
            self.entries.append(_rerun_entry(func))
            out = func(*args, **kwargs)
            if traits.unsafe_alias and self.refs:
                self.guard.note_alias(args[0], out)
            return out
        if self.pending:
            self.ledger.sweep_pending()
        out = func(*args, **kwargs)
        entry = self._hold(func, out, interval, decision is _HOLD_ROUTING)
        if interval is not None and not traits.expensive and decision is _HOLD:
            self.cheap.note(entry, storages_read(args, kwargs))  # held as it reads a held output
        return out

    def _hold(self, func, out, interval: MarkerInterval | None, routing: bool) -> Entry:
        if type(out) is _Tensor:
            leaves, spec = [out], _ONE
        elif type(out) is tuple and all(type(leaf) is _Tensor for leaf in out):
            leaves, spec = list(out), _TUPLE
        else:
            leaves, spec = tree_flatten(out)
        kept, ledger = [], self.ledger
        for leaf in leaves:
            site = (self.segment, len(self.entries), len(kept))
            if is_dense_tensor(leaf) and leaf.device.type != "meta":
                kept.append(ledger.hold_tensor(func, detach_alias(leaf), leaf, interval, routing, None, site))
            elif isinstance(leaf, torch.Tensor):
                held = None if routing else ledger.hold_wrapper(func, leaf, interval, site)
                kept.append(detach_alias(leaf) if held is None else held)  # else held as it is
            else:
                kept.append(leaf)
        entry = Entry(func, kept, spec)
        self.entries.append(entry)
        return entry

    def _saved_so_far(self) -> int | None:
        return None if self.frame is None else saved_count(self.frame)

    def _end_forward(self) -> None:
        ledger = self.ledger
        ledger.end_forward()
        if self.probe is not None:
            seen = (self.marker_names, self.segment_kept, self.routing_segments, self.watched)
            self.learnt.learn(self.layer, self.probe.layout(*seen, self.layout, self.left_path_at))
        previous = None if self.probe is not None else self.learnt.held_reports().get(self.layer_name)
        report = held_report(ledger.held.values(), self.probe, ledger.packed, previous)
        offloaded = self.plan.offload_intervals
        if offloaded:
            engine = self.offloader
            group = engine.current_group(self.layer_name)
            with disable_current_modes():  # host copies are not the step's device memory
                for held in ledger.held.values():
                    if held.interval in offloaded:
                        held.aliases = None  # they would keep the device storage alive
                        moved = engine.offload(held.value, group)
                        if moved is not held.value:
                            held.value, held.offloaded = moved, True
        self.learnt.record_held(self.layer_name, report)
        self.probe = ledger.probe = None

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
        for held in self.ledger.held.values():
            if held.offloaded:
                held.value = held.value.materialize()
                held.version = tensor_version(held.value)
        if self.guard.rewritten:
            self.outer_pack = top_saved_tensors_hooks()  # the replay's own (recompute) hooks
        self._open_segment()

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
        self.guard.check_served(leaf)
        leaf.value = leaf.aliases = None  # handed to backward once
        return value

    def end_phase(self, failed: bool) -> None:
        self._close_segment()
        # The frame holds this region (through its replay context), and so do its modes (their
        # handlers are its methods): no cycle past the phase.
        self.frame = self.outer_pack = None
        self.forward_mode = self.replay_mode = None
        self.entries = []
        if self.phase is _REPLAY or failed:
            # Served or not, nothing is held past the replay (or past a failed forward).
            self.ledger.clear()
            self.cheap.clear()
            self.watched.clear()
        self.phase = RegionPhase.DONE if self.phase is _REPLAY else RegionPhase.FORWARD_DONE
        self.guard.check_rewrites()
