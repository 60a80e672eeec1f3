"""The eager engine's write guard: in-place writes and aliases of held outputs.

A held output is served to the replay as the forward made it, so a write into it after it is
held would hand backward other values. ``WriteGuard`` is the one place that watches for that:

* **in the forward**, an in-place op writing into a held output is an error once anything reads
  it (``KeptTensorMutatedError``), and marks an undecided one (an error if it is later held).
  A routing output is the exception: top-k weights normalised with ``/=``, as many Hugging Face
  routers do. The replay is served a copy taken before the write and reruns the write on it.
* **aliases** that do not share the output's version counter (``_unsafe_view``) are tracked with
  it, so a write through one, in a segment nobody watches, still shows when the replay serves it.
* **in the replay**, a served output whose version moved is an error, and so is a write into a
  served routing copy after autograd saved it (as autograd's own version check would be).

Imports ``held``, ``ledger``, ``region`` (the errors), ``interval_plan``, ``_torch_internals``.
"""

from __future__ import annotations

from typing import Any

import torch

from actplan._engine.held import (
    Fate,
    HeldOutput,
    inner_tensors,
    is_dense_tensor,
    leaf_tensors,
    single_inner,
    tensor_args,
)
from actplan._engine.interval_plan import IntervalPlan
from actplan._engine.ledger import Ledger
from actplan._engine.region import KeptTensorMutatedError, mutation_error, rewrite_error
from actplan._torch_internals import detach_alias, storage_key_of, tensor_version


class WriteGuard:
    """In-place writes into held outputs, their untracked aliases, and routing copies."""

    def __init__(self, ledger: Ledger, plan: IntervalPlan, layer_name: str | None) -> None:
        self.ledger, self.plan, self.layer_name = ledger, plan, layer_name
        # Routing outputs written in place after they were held (their copies, by storage), and
        # in the replay, the version at which autograd first saved each served copy.
        self.rewritten: dict[int, HeldOutput] = {}
        self.saved_versions: dict[int, tuple[torch.Tensor, int]] = {}

    def mutation(self, held: HeldOutput) -> KeptTensorMutatedError:
        kept = None if held.interval is None else self.plan.describe(held.interval)
        return mutation_error(self.layer_name, held.mutated_by, held.producer, kept, held.routing)

    def check_writes(self, func: Any, mutated, args, kwargs, saved: int | None) -> bool:
        """An op that writes its arguments at ``mutated`` (position, name) ran in a watched
        segment: check its writes into held outputs, and pin what else it reads (``saved``: the
        saved-tensor count now). ``True`` when a routing output was copied before the write."""
        ledger, copied = self.ledger, False
        written: set[int] = set()
        for position, name in mutated:
            target = args[position] if position < len(args) else kwargs.get(name)
            if isinstance(target, torch.Tensor):
                written.update(id(inner) for inner in inner_tensors(target))
        for leaf in tensor_args(args, kwargs):
            found = leaf_tensors(leaf)
            if found is None:
                ledger.pin_all_undecided(saved)  # unseen: it may read any of them
                found = tuple(t for t in inner_tensors(leaf) if id(t) in written)  # writes still checked
            for inner in found:
                if inner.device.type == "meta":
                    continue
                storage = storage_key_of(inner.untyped_storage())
                if storage not in ledger.refs:
                    continue
                if id(inner) in written:
                    copied |= self._written(storage, func)
                else:
                    ledger.pin(storage, saved)
        return copied

    def _written(self, storage: int, func: Any) -> bool:
        # Writing into a held output: fine while nothing reads it, an error once something does.
        copied = False
        for held in list(self.ledger.live_at(storage)):
            if held.fate is Fate.HELD:
                if held.mutated_by is None:
                    if held.routing:
                        self._copy_before_write(held, func)
                        copied = True
                        continue
                    held.mutated_by = func
                    raise self.mutation(held)
            elif held.fate is not Fate.WAITING:
                held.mutated_by = held.mutated_by or func
        return copied

    def _copy_before_write(self, held: HeldOutput, func: Any) -> None:
        # The replay is served a copy taken before the write and reruns the write on it, so it
        # sees what the forward saw. Routing outputs are small (tokens x k); other held outputs
        # stay an error (see ``mutation``).
        value = held.value.clone()
        storage = value.untyped_storage()
        self.ledger.rekey(held, storage_key_of(storage), storage.nbytes())
        held.value, held.version = value, tensor_version(value)
        held.rewritten_by = func
        self.rewritten[held.storage] = held

    def note_alias(self, source: Any, alias: torch.Tensor) -> None:
        """``alias`` shares the storage of a held output but not its version counter: keep an
        alias of it (sharing its counter) with the output. Costs no memory: the storage is held
        anyway."""
        if not is_dense_tensor(source) or not is_dense_tensor(alias):
            return
        key = storage_key_of(source.untyped_storage())
        if key not in self.ledger.refs:
            return
        tracked = detach_alias(alias)
        for held in list(self.ledger.live_at(key)):
            if held.fate is not Fate.WAITING:
                self.ledger.alias(held, tracked, tensor_version(tracked))

    def check_served(self, leaf: HeldOutput) -> None:
        """The replay is about to be served ``leaf``: it must be as the forward left it."""
        if leaf.offloaded:
            return
        value = leaf.value
        if tensor_version(value if leaf.wrapped is None else single_inner(value)[1]) != leaf.version or (
            leaf.aliases and any(tensor_version(a) != v for a, v in leaf.aliases)
        ):
            kept = None if leaf.interval is None else self.plan.describe(leaf.interval)
            raise mutation_error(self.layer_name, None, leaf.producer, kept, leaf.routing)

    def replay_hooks(self, outer: tuple) -> Any:
        """Saved-tensor hooks for a replay segment: the replay reruns the in-place write on a
        routing output's served copy. Autograd may have saved that copy for the routing op's own
        backward before the write (top-k's indices): note its version then."""
        outer_pack, outer_unpack = outer
        rewritten, saved = self.rewritten, self.saved_versions

        def pack(tensor: torch.Tensor) -> Any:
            if is_dense_tensor(tensor):
                key = storage_key_of(tensor.untyped_storage())
                if key in rewritten and key not in saved:
                    saved[key] = (tensor, tensor_version(tensor))
            return outer_pack(tensor)

        return torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack)

    def check_rewrites(self) -> None:
        """The phase ended: a served routing copy autograd saved must not have changed since."""
        saved, self.saved_versions = self.saved_versions, {}
        changed = [key for key, (tensor, version) in saved.items() if tensor_version(tensor) != version]
        if changed:
            held = self.rewritten[changed[0]]
            raise rewrite_error(self.layer_name, held.rewritten_by, held.producer)

