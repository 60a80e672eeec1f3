"""The eager engine's ledger of held outputs: what becomes of each output a kept op made.

Every ``HeldOutput`` has one ``Fate`` at a time, and sits in the one record that fate names:

* ``PENDING``: made in the open segment, not yet proven read or unread;
* ``UNDECIDED``: still referenced when its segment closed, so it may yet be read;
* ``WAITING``: unread and unreferenced, kept alive only while a cheap op that read it has an
  output whose fate is unknown (``cheap.CheapReruns`` decides which of the two to hold);
* ``HELD``: the replay is served it;
* ``RELEASED``: dropped (the replay gets a placeholder), rerun instead, or served.

The ledger counts the region's references to each storage (one reference-count path,
``_unref``) and indexes live outputs by storage, so "the outputs at this storage" is one lookup.
Its sweeps settle what the ops so far prove: a storage autograd packed is held; one nothing
references, packs or pins any more is dropped (after asking the cheap-op rule).

Imports ``held`` (the records), ``_torch_internals``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from actplan._engine.held import (
    Fate,
    HeldOutput,
    Site,
    Wrapped,
    inner_tensors,
    is_dense_tensor,
    is_parameter,
    leaf_tensors,
    tensor_args,
    wrapper_alias,
)
from actplan._torch_internals import storage_key_of, storage_use_count, tensor_version
from actplan.units import MarkerInterval

_PENDING, _UNDECIDED, _WAITING, _HELD, _RELEASED = (
    Fate.PENDING, Fate.UNDECIDED, Fate.WAITING, Fate.HELD, Fate.RELEASED,
)  # fmt: skip


class UnreadRule(Protocol):
    """What the ledger asks before it drops an unread output (``cheap.CheapReruns``)."""

    def forget_storage(self, key: int) -> None: ...

    def take_unread(self, storage: int, outputs: list[HeldOutput]) -> bool: ...

    def revisit(self, final: bool) -> None: ...

    def rerun_at_end(self) -> None: ...


class ProducedLog(Protocol):
    """A learning call's record of what kept ops produced (``probe.LearningProbe``)."""

    def produced_by(self, held: HeldOutput) -> None: ...

    def forget_produced(self, held: HeldOutput) -> None: ...


def _unguarded(held: HeldOutput) -> Exception:
    return RuntimeError(f"an output of {held.producer} was written in place after it was held")


class Ledger:
    """Held outputs of one checkpointed call, by fate, with the evidence that settles them.

    ``packed``: storages autograd saved (read by backward). ``pinned``: storages an op the replay
    reruns read, with the saved-tensor count at the first such read (-1: unknown). ``exposed``:
    undecided storages alive when an unwatched segment began, with the count then."""

    def __init__(
        self,
        saved_count: Callable[[], int | None],
        python_refs: int,
        unread_sites: frozenset[Site] = frozenset(),
    ) -> None:
        # The error for a held output written in place (``guard.WriteGuard.mutation``).
        self.on_mutated: Callable[[HeldOutput], Exception] = _unguarded
        self.saved_count = saved_count  # tensors autograd saved so far in this call (None: unknown)
        self.python_refs = python_refs
        # Sites the learning call saw no one read (``LearntLayout.unread_sites``): an unwatched
        # segment on the learnt path does not expose them.
        self.unread_sites = unread_sites
        self.pending: dict[int, list[HeldOutput]] = {}
        self.undecided: dict[int, list[HeldOutput]] = {}
        self.waiting: dict[int, list[HeldOutput]] = {}
        self.held: dict[int, HeldOutput] = {}  # by id(), in the order they were held
        self.at: dict[int, list[HeldOutput]] = {}  # live (not released) outputs by storage
        self.refs: dict[int, int] = {}  # storage -> live outputs and their tracked aliases
        self.packed: set[int] = set()
        self.pinned: dict[int, int] = {}
        self.exposed: dict[int, int] = {}
        self.cheap: UnreadRule | None = None  # set by the region
        self.probe: ProducedLog | None = None  # set while the call learns its layout

    # -- records ------------------------------------------------------------------------------

    def hold_tensor(
        self,
        func: Any,
        alias,
        inner,
        interval: MarkerInterval | None,
        routing: bool,
        wrapped: Wrapped | None,
        site: Site,
    ) -> HeldOutput:
        """Record one output of a held op: ``alias`` (a detached alias) is what the replay is
        served, ``inner`` the plain tensor whose storage it costs.

        Routing and device-to-host outputs are held whatever reads them, and so are integer and
        boolean outputs (ids, counts, masks): Python may read those without the dispatcher
        seeing it (``counts.tolist()`` for split sizes), and they are small. A collective's
        floating-point output is held while read, like a kept op's: dropped, it is not rerun
        either (the replay gets a placeholder), and an all-gather read only by the held ``cat``
        after it would otherwise be held twice."""
        storage = inner.untyped_storage()
        held = HeldOutput(
            value=alias,
            interval=interval,
            storage=storage_key_of(storage),
            nbytes=storage.nbytes(),
            version=tensor_version(inner),
            meta=(inner.size(), inner.stride(), inner.dtype, inner.device),
            producer=func,
            routing=routing,
            wrapped=wrapped,
            site=site,
        )
        self.add(held, settled=routing or not (inner.is_floating_point() or inner.is_complex()))
        if self.probe is not None:
            self.probe.produced_by(held)
        return held

    def hold_wrapper(
        self, func: Any, leaf: torch.Tensor, interval: MarkerInterval | None, site: Site
    ) -> HeldOutput | None:
        """A wrapper-subclass output around one plain tensor, held by that tensor's storage;
        ``None`` when it cannot be (the caller holds it as it is)."""
        found = wrapper_alias(leaf)
        if found is None:
            return None
        alias, inner, wrapped = found
        return self.hold_tensor(func, alias, inner, interval, False, wrapped, site)

    def add(self, held: HeldOutput, settled: bool) -> None:
        """Record a new output: held at once (``settled``) or pending."""
        key = held.storage
        count = self.refs.get(key)
        if count is None:
            # A new storage: what was packed, pinned or read at this address before is gone.
            self.packed.discard(key)
            self.pinned.pop(key, None)
            self.cheap.forget_storage(key)
            self.refs[key] = 1
            self.at[key] = [held]
        else:
            self.refs[key] = count + 1
            self.at[key].append(held)
        if settled:
            held.fate = _HELD
            self.held[id(held)] = held
        else:
            held.fate = _PENDING
            found = self.pending.get(key)
            if found is None:
                self.pending[key] = [held]
            else:
                found.append(held)

    def live_at(self, key: int) -> list[HeldOutput]:
        return self.at.get(key, [])

    def alias(self, held: HeldOutput, tracked, version: int) -> None:
        """Note an alias of ``held`` that does not share its version counter (one more reference)."""
        held.aliases = [*(held.aliases or ()), (tracked, version)]
        self.refs[held.storage] += 1

    def rekey(self, held: HeldOutput, storage: int, nbytes: int) -> None:
        """``held`` now lives in another storage (a copy taken before an in-place write)."""
        self.release_aliases(held)
        self._unref(held.storage, 1)
        self._unindex(held)
        held.storage, held.nbytes = storage, nbytes
        self.refs[storage] = self.refs.get(storage, 0) + 1
        self.at.setdefault(storage, []).append(held)

    def keep(self, outputs: list[HeldOutput]) -> None:
        for held in outputs:
            if held.mutated_by is not None:
                raise self.on_mutated(held)
            self._settle(held)

    def wait(self, storage: int, outputs: list[HeldOutput]) -> None:
        for held in outputs:
            held.fate = _WAITING
        self.waiting[storage] = outputs

    def drop(self, outputs: list[HeldOutput]) -> None:
        probe = self.probe
        for held in outputs:
            if held.wrapped is not None and not held.wrapped.rebuilds(held.meta):
                self._settle(held)  # the replay could not be served a placeholder for it
                continue
            if probe is not None and held.value is not None:
                probe.forget_produced(held)  # its storage's address may come back for another
            self.release(held)

    def release(self, held: HeldOutput) -> None:
        """Let an output go, from whatever record it is in."""
        if held.value is None:
            return
        self.release_aliases(held)
        held.value = None
        self._unref(held.storage, 1)
        self._unindex(held)
        fate, held.fate = held.fate, _RELEASED
        if fate is _HELD:
            self.held.pop(id(held), None)
            return
        records = self.pending if fate is _PENDING else self.undecided if fate is _UNDECIDED else self.waiting
        found = records.get(held.storage)
        if found is not None and any(h is held for h in found):
            rest = [h for h in found if h is not held]
            if rest:
                records[held.storage] = rest
            else:
                del records[held.storage]

    def release_aliases(self, held: HeldOutput) -> None:
        if held.aliases:
            self._unref(held.storage, len(held.aliases))
        held.aliases = None

    def clear(self) -> None:
        for held in self.held.values():
            held.value = held.aliases = None
            held.fate = _RELEASED
        for records in (self.held, self.pending, self.undecided, self.waiting, self.at, self.refs):
            records.clear()

    def _settle(self, held: HeldOutput) -> None:
        held.fate = _HELD
        self.held[id(held)] = held

    def _unref(self, storage: int, n: int) -> None:
        count = self.refs[storage] - n
        if count:
            self.refs[storage] = count
        else:
            del self.refs[storage]

    def _unindex(self, held: HeldOutput) -> None:
        found = self.at[held.storage]
        if len(found) == 1:
            del self.at[held.storage]
        else:
            found.remove(held)  # (identity: records compare by identity)

    # -- evidence -----------------------------------------------------------------------------

    def reads_held(self, args, kwargs) -> bool:
        """Whether an op reads an output this call holds (any fate but released)."""
        refs = self.refs
        if not refs:
            return False
        for leaf in tensor_args(args, kwargs):
            if is_dense_tensor(leaf):
                if storage_key_of(leaf.untyped_storage()) in refs:
                    return True
                continue
            found = leaf_tensors(leaf)
            if found is None:
                return True  # a subclass the engine cannot look into may read anything held
            if any(storage_key_of(inner.untyped_storage()) in refs for inner in found):
                return True
        return False

    def pin_reads(self, args, kwargs) -> None:
        """An op the replay reruns reads its inputs: pin the undecided outputs among them (what
        is already held stays held)."""
        pending, undecided, pinned = self.pending, self.undecided, self.pinned
        for leaf in tensor_args(args, kwargs):
            found = (leaf,) if is_dense_tensor(leaf) else leaf_tensors(leaf)
            if found is None:
                self.pin_all_undecided(self.saved_count())
                continue
            for inner in found:
                storage = storage_key_of(inner.untyped_storage())
                if (
                    (storage in pending or storage in undecided)
                    and storage not in pinned
                    and inner.device.type != "meta"
                ):
                    self.pin(storage, self.saved_count())

    def saved_tensor_hooks(self, outer: tuple, saved_in: dict[int, int] | None) -> Any:
        """Autograd's saved-tensor hooks for a watched forward segment, around ``outer`` (pack,
        unpack): note the storages it packs (read by backward), and in ``saved_in`` (a learning
        call's, for the open kept interval) their sizes."""
        outer_pack, outer_unpack = outer
        packed = self.packed

        def pack(tensor: torch.Tensor) -> Any:
            # A subclass (a DTensor around a held output) saves its inner tensors.
            for inner in (tensor,) if is_dense_tensor(tensor) else inner_tensors(tensor):
                storage = inner.untyped_storage()
                key = storage_key_of(storage)
                packed.add(key)
                if saved_in is not None and not is_parameter(inner):
                    saved_in[key] = storage.nbytes()
            return outer_pack(tensor)

        return torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)

    def dead(self, storage: int) -> bool:
        """Nothing besides the region references the storage: nothing can read it any more."""
        return storage_use_count(storage) <= self.refs[storage] + self.python_refs

    def pin(self, storage: int, saved: int | None) -> None:
        if storage not in self.pinned:
            self.pinned[storage] = -1 if saved is None else saved

    def pin_all_undecided(self, saved: int | None) -> None:
        """An op read something the engine cannot look into: it may read any undecided output."""
        for storage in (*self.pending, *self.undecided):
            self.pin(storage, saved)

    # -- sweeps -------------------------------------------------------------------------------

    def sweep_pending(self) -> None:
        """Before each kept op: let the open segment's outputs nobody references go at once."""
        self._settle_pending(closing=False)
        if self.waiting:
            self.cheap.revisit(final=False)

    def _settle_pending(self, closing: bool) -> None:
        packed, pinned, pending = self.packed, self.pinned, self.pending
        for storage in list(pending):
            outputs = pending.get(storage)  # (a cheap op's output may have gone meanwhile)
            if outputs is None:
                continue
            if storage in packed:
                del pending[storage]
                self.keep(outputs)
            elif storage not in pinned and self.dead(storage):
                del pending[storage]
                self.drop_unread(storage, outputs)
            elif closing:
                del pending[storage]
                for held in outputs:
                    held.fate = _UNDECIDED
                self.undecided.setdefault(storage, []).extend(outputs)

    def sweep(self, closing: bool) -> None:
        """Settle what the watched ops so far prove: saved by autograd (held), or unreferenced
        and unread (dropped). ``closing``: the segment closes, so what is pending becomes
        undecided. Outputs a rerun op read are settled when the forward ends."""
        self._settle_pending(closing)
        packed, pinned, exposed, undecided = self.packed, self.pinned, self.exposed, self.undecided
        for storage in list(undecided):
            outputs = undecided.get(storage)
            if outputs is None:
                continue
            if storage in packed:
                del undecided[storage]
                self.keep(outputs)
            elif storage not in exposed and storage not in pinned and self.dead(storage):
                del undecided[storage]
                self.drop_unread(storage, outputs)
        if self.waiting:
            self.cheap.revisit(final=False)

    def expose(self) -> None:
        """An unwatched segment begins: what is still referenced may be read there unseen, unless
        the learning call, which watched that segment, saw no one read it (a read it did not see,
        on a later call, reaches the placeholder's NaN in the replay: never a wrong value)."""
        self.sweep(closing=False)
        saved, unread = self.saved_count(), self.unread_sites
        for storage, outputs in self.undecided.items():
            if unread and all(held.site in unread for held in outputs):
                continue
            self.exposed.setdefault(storage, -1 if saved is None else saved)
        if self.waiting:
            self.cheap.revisit(final=False)  # an exposed output counts as read

    def end_forward(self) -> None:
        """The forward ended: decide every output still undecided or waiting."""
        self.sweep(closing=False)
        saved = self.saved_count()
        for storage in list(self.undecided):
            outputs = self.undecided.pop(storage, None)
            if outputs is None:
                continue  # released meanwhile: a cheap op's output, rerun instead
            # Held only if a rerun op read it, or an unwatched segment it was exposed to runs,
            # before the replay stops (at the last saved tensor).
            reads = [c for c in (self.exposed.get(storage), self.pinned.get(storage)) if c is not None]
            if reads and (saved is None or min(reads) < saved):  # (-1: unknown, so held)
                self.keep(outputs)
                continue
            self.drop_unread(storage, outputs)
        if self.waiting:
            self.cheap.revisit(final=True)
        self.cheap.rerun_at_end()

    def drop_unread(self, storage: int, outputs: list[HeldOutput]) -> None:
        # Nothing references or reads these outputs any more; the cheap-op rule may hold them
        # instead of what a cheap op made from them, or let them wait.
        if not self.cheap.take_unread(storage, outputs):
            self.drop(outputs)
