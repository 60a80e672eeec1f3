"""The eager engine's cheap-op rule: hold a cheap op's input or its output, never both.

A cheap op (elementwise, a dtype cast) inside a kept interval is held only because it read a
held output. Holding both what it read and what it made would cost both, where autograd keeps
one. ``CheapReruns`` records each such op with the held outputs it read and decides, in two
places of the ledger's life only:

* **when what it read is about to be dropped** (``take_unread``): nothing references or reads
  that input any more. If the op's output is read (packed, pinned, exposed or already held) and
  the input is the smaller (a bf16 GEMM output against its fp32 cast), the input is held, the
  output released, and the replay reruns the op. While the output's fate is unknown, the input
  waits, alive, but only while it is the smaller.
* **when the forward ends** (``rerun_at_end``): a held op whose inputs all stay held reruns
  instead of being served, so its output is released.

Inputs changed in place since the op ran, wrapper-subclass outputs, routing outputs and
non-floating outputs are never chosen: a rerun would read other values, or could not be
served a placeholder.

Imports ``held`` (the records), ``ledger``, ``_torch_internals``.
"""

from __future__ import annotations

from actplan._engine.held import Entry, Fate, HeldOutput
from actplan._engine.ledger import Ledger
from actplan._torch_internals import tensor_version

_HELD = Fate.HELD

# One recorded cheap op: its entry, and per input it read, the held outputs at that storage.
CheapOp = tuple[Entry, list[list[HeldOutput]]]


def rerunnable_outputs(entry: Entry) -> list[HeldOutput] | None:
    """A held cheap op's outputs, if the replay may rerun it instead: all still held, none a
    routing output, all floating point."""
    made = [leaf for leaf in entry.leaves or () if isinstance(leaf, HeldOutput)]
    if not made or any(o.value is None or o.routing or not o.meta[2].is_floating_point for o in made):
        return None
    return made


class CheapReruns:
    """Cheap ops held because they read a held output, and the choice between input and output."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.ops: list[CheapOp] = []  # forward order
        self.readers: dict[int, list[CheapOp]] = {}  # by the storage of each held input

    def note(self, entry: Entry, keys: list[int] | None) -> None:
        """Record a held cheap op that read the storages ``keys`` (``None``: it read something the
        engine cannot look into, so it is never rerun). The held outputs it read are kept by
        identity: a storage address names one live storage now, but may name another by the
        time the forward ends."""
        if keys is None:
            return
        ledger = self.ledger
        holders = []
        for key in keys:
            if key not in ledger.refs:
                continue  # not held: the replay recomputes it, or it is the layer's input
            found = [h for h in ledger.live_at(key) if h.fate is not Fate.WAITING]
            if not found:
                return
            holders.append(found)
        op = (entry, holders)
        self.ops.append(op)
        for key in {h.storage for found in holders for h in found}:
            self.readers.setdefault(key, []).append(op)

    def forget_storage(self, key: int) -> None:
        if self.readers:
            self.readers.pop(key, None)

    def take_unread(self, storage: int, outputs: list[HeldOutput]) -> bool:
        """``outputs`` (unread, unreferenced) are about to be dropped: hold them instead of what
        a cheap op made from them, or let them wait; ``False``: drop them."""
        if storage in self.readers and self._settle(storage, outputs, final=False):
            return True
        self.readers.pop(storage, None)
        return False

    def revisit(self, final: bool) -> None:
        """Decide the waiting outputs whose reader's fate is known now (``final``: all)."""
        waiting = self.ledger.waiting
        for storage, outputs in list(waiting.items()):
            del waiting[storage]
            if not self._settle(storage, outputs, final):
                self.readers.pop(storage, None)
                self.ledger.drop(outputs)

    def _settle(self, storage: int, outputs: list[HeldOutput], final: bool) -> bool:
        if any(
            h.mutated_by is not None or h.wrapped is not None or tensor_version(h.value) != h.version
            for h in outputs
        ):
            return False  # changed in place since: a rerun would read other values
        ledger = self.ledger
        known = (ledger.packed, ledger.pinned, ledger.exposed)
        rerun: list[tuple[Entry, list[HeldOutput]]] = []
        freed: dict[int, int] = {}
        unsettled = 0
        for entry, holders in self.readers[storage]:
            made = rerunnable_outputs(entry)
            if not made or any(o.storage == storage for o in made):
                continue
            if not all(o.fate is _HELD or any(o.storage in k for k in known) for o in made):
                unsettled += sum(o.nbytes for o in made)  # read later or not: not known yet
                continue
            # Everything else it read must be held already: the replay serves it all.
            if all(any(h.storage == storage or h.fate is _HELD for h in found) for found in holders):
                rerun.append((entry, made))
                freed.update((o.storage, o.nbytes) for o in made)
        cost = outputs[0].nbytes
        if rerun and cost < sum(freed.values()):
            self.readers.pop(storage, None)
            ledger.keep(outputs)
            for entry, made in rerun:
                for output in made:
                    ledger.release(output)
                entry.leaves = entry.spec = None
            return True
        if not final and cost < unsettled:
            ledger.wait(storage, outputs)
            return True
        return False

    def rerun_at_end(self) -> None:
        """The forward ended: a held cheap op whose inputs all stay held reruns in the replay
        (holding its output too would hold both). Forward order: an op that read a rerun op's
        output keeps its own output held."""
        for entry, holders in self.ops:
            outputs = rerunnable_outputs(entry)
            if not outputs:
                continue
            if not all(any(h.value is not None for h in found) for found in holders):
                continue
            if any(o is h for o in outputs for found in holders for h in found):
                continue
            for output in outputs:
                self.ledger.release(output)
            entry.leaves = entry.spec = None
        self.clear()

    def clear(self) -> None:
        self.ops.clear()
        self.readers.clear()
