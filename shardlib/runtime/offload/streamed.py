"""The host update streamed into the next forward, unit by unit (ZeRO-Offload's overlap, same step).

Under ZeRO-3 with the optimizer on the host, each unit's master pieces are updated on the host and copied
into the unit's device shard, which the unit's next all-gather packs. Nothing in the step needs the update
once the step's checks have passed (the scalars' all-reduce: overflow, the gradient norm and clipping, the
ranks' fingerprints), so ``engine.step`` starts it on a thread and returns: the thread steps the optimizer
one unit at a time, in the order the next forward gathers them (the root unit first), and marks each unit
ready once its shard holds the new values; the next forward's gather of a unit — its prefetch included —
waits for that unit only, so the update of the later units runs beside the forward of the first ones.

The numerics are the synchronous update's: the same elementwise step on every parameter (a unit's
parameters are a subset of the optimizer's, stepped with the hyperparameters the step began with — a
learning-rate schedule advances in the caller's thread at once, on the live groups, as without streaming),
the same values published. The update reads the gradient shards the next backward overwrites; every unit
is ready before the next backward starts (its forward gathered them all), and the engine joins the thread
before it reads a gradient again, and before anything reads the states outside a step (``mapped``).

On a failure inside the update the thread marks every unit ready and the error is raised on the engine's
thread at the next wait, naming the unit: the units before it hold the new values, the others the old.
"""

from __future__ import annotations

import copy
import threading

import torch


class StreamedUpdate:
    """One step's host update in flight (module doc): ``start`` it, ``ready(unit)`` before a unit's gather,
    ``join`` before anything reads the gradients or the states."""

    def __init__(self, offload):
        self.offload = offload
        self._thread: threading.Thread | None = None
        self._events: dict[int, threading.Event] = {}
        self._failed: tuple[str, BaseException] | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, optimizer: torch.optim.Optimizer, units: list) -> None:
        """Step ``optimizer`` unit by unit on a thread (each of ``units`` has ``name`` and ``states``), its
        parameter groups' hyperparameters as they are now."""
        off = self.offload
        trainable = {id(s) for s in off.states}
        order = [(u.name or "<root>", id(u), [s for s in u.states if id(s) in trainable]) for u in units]
        covered = {id(s) for _, _, states in order for s in states}
        rest = [s for s in off.states if id(s) not in covered]
        if rest:                                       # (every state is a unit's under ZeRO-3: none expected)
            order.append(("<rest>", -1, rest))
        for _, _, states in order:                     # the copies this step makes, counted with the step
            for s in states:
                piece = off.device_piece(s)
                off.copies.add("h2d", "params", piece.numel() * piece.element_size())
        # a shadow of the optimizer: its state shared, its groups a snapshot (a schedule stepping the live
        # groups now does not reach the update in flight)
        shadow = copy.copy(optimizer)
        shadow.param_groups = [dict(g) for g in optimizer.param_groups]
        step = type(optimizer).step
        grads = {id(s): s.master.grad for s in off.states}
        self._events = {key: threading.Event() for _, key, _ in order}
        self._failed = None

        def run() -> None:
            name = None
            try:
                for s in off.states:
                    s.master.grad = None
                for name, key, states in order:
                    for s in states:
                        s.master.grad = grads[id(s)]
                    if any(s.master.grad is not None for s in states):
                        step(shadow)
                    with torch.no_grad():
                        for s in states:
                            off.publish_one(s)
                            s.master.grad = None
                    self._events[key].set()
            except BaseException as e:        # noqa: BLE001 — raised on the engine's thread by ready()/join()
                self._failed = (name or "<start>", e)
            finally:
                for s in off.states:
                    s.master.grad = grads[id(s)]
                for ev in self._events.values():
                    ev.set()

        self._thread = threading.Thread(target=run, name="shardlib-streamed-update", daemon=True)
        self._thread.start()

    def ready(self, unit) -> None:
        """Wait until ``unit``'s shard holds this update's values (nothing when none is in flight)."""
        if self._thread is None:
            return
        ev = self._events.get(id(unit))
        if ev is not None:
            ev.wait()
        self._raise()

    def join(self) -> bool:
        """Finish the update in flight, if any; whether one was."""
        t = self._thread
        if t is None:
            return False
        t.join()
        self._thread = None
        self._raise()
        return True

    def _raise(self) -> None:
        if self._failed is None:
            return
        name, e = self._failed
        self._failed = None
        raise RuntimeError(f"step: the host update failed at unit {name} — {type(e).__name__}: {e}. The units "
                           f"before it hold the new parameters, it and the later ones the previous step's: resume "
                           f"from the last checkpoint.") from e
