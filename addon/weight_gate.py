"""The hold around a weight sync, as a state machine (sans-IO: no clock, no sockets, no asyncio).

One gate per upstream server. States:

- ``serving``: model calls are admitted; each gets a Ticket naming the version it starts under.
- ``draining`` (after ``hold``): new calls wait at the gate (the edge bounds the wait); the
  calls in flight finish.
- ``loading`` (after ``load``): the server loads the new weights. Calls still in flight now
  (the drain timed out) have their tickets marked as spanning the old and the new version
  (polar_contracts.weight_versions.spanning): their rows can never be read as one version.
- back to ``serving`` (``release``) with the version the sync ends with: the new one, or after a
  failure the one the server still serves (or an ``unknown:`` marker when the failed load may
  have changed the weights).

Only one sync at a time: ``hold`` outside ``serving`` raises GateBusy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from polar_contracts.weight_versions import spanning

SERVING, DRAINING, LOADING = "serving", "draining", "loading"


class GateBusy(RuntimeError):
    """A sync was asked for while another one runs."""


@dataclass(eq=False)
class Ticket:
    """One admitted model call: the version it started under, and the sync it spanned (if any)."""
    start_version: str | None
    span_to: str | None = None  # the target of a sync whose loading began while this call was in flight
    spanned: bool = False
    done: bool = False

    @property
    def version(self) -> str | None:
        """The row's weight_version: the start version, or the spanning marker."""
        return spanning(self.start_version, self.span_to) if self.spanned else self.start_version


@dataclass
class WeightGate:
    version: str | None = None  # what the upstream serves now (None: unknown)
    state: str = SERVING
    target: str | None = None  # the version the running sync loads
    inflight: set = field(default_factory=set)
    waiting: int = 0  # calls the edge holds at the gate (for the sync's report)
    syncs: int = 0  # successful syncs

    def admit(self) -> Ticket | None:
        """A ticket when calls may go to the server now; None: wait (a sync holds the gate)."""
        if self.state != SERVING:
            return None
        t = Ticket(self.version)
        self.inflight.add(t)
        return t

    def finish(self, t: Ticket) -> None:
        """The call's row is written (or it failed): it no longer counts as in flight. Idempotent."""
        t.done = True
        self.inflight.discard(t)

    @property
    def drained(self) -> bool:
        return not self.inflight

    def hold(self, target: str) -> None:
        """Start a sync to ``target``: new calls wait from now on."""
        if self.state != SERVING:
            raise GateBusy(f"a weight sync to {self.target!r} is already running ({self.state})")
        self.state, self.target = DRAINING, target

    def load(self) -> list[Ticket]:
        """The server is about to load the weights: the calls still in flight span two versions.
        Returns their tickets."""
        if self.state != DRAINING:
            raise RuntimeError(f"load() in state {self.state}, expected {DRAINING}")
        self.state = LOADING
        spanned = list(self.inflight)
        for t in spanned:
            t.spanned, t.span_to = True, self.target
        return spanned

    def release(self, version: str | None, ok: bool) -> None:
        """The sync is over (``ok``: loaded); new calls run under ``version``."""
        if self.state == SERVING:
            raise RuntimeError("release() with no sync running")
        self.state, self.target, self.version = SERVING, None, version
        if ok:
            self.syncs += 1
