"""The coverage ledger: every completion token the server sampled for an episode, accounted for.

    sampled = trained + sum(excluded[reason])

``sampled`` counts the completion ids of every call row of the episode's log (each choice of an
n>1 call is its own row; a failed call counts the ids it recorded, none when it recorded none).
``trained`` counts the tokens of the episode's rows that carry loss (for the token and per-call
strategies, the row's ``loss_mask``, checked equal to the sampled ids of the calls the row
trains; for retokenize, whose mask comes from re-tokenized text, the sampled ids of the calls
the rows train: the text's own count is the drift the compare report measures). ``excluded``
counts the sampled ids of every call trained in no row, by its reason (fidelity.EXCLUDE_REASONS,
the keys of the manifest's ``excluded_calls``).

A ledger that does not close (a call both trained and excluded, in two rows, in none, or rows
whose loss tokens differ from what their calls sampled) is a reconstruction bug: `check` raises
LedgerError naming the episode and the calls, and the build reports the episode as an error and
writes none of its rows.

The trainer continues the chain: its input is ``trained`` and it counts, by its own reasons, the
trainable tokens its corrections give weight 0 (its ``polar/excluded_tokens_total/<reason>``
metrics); the recon reasons here and the trainer's are disjoint sets of names, so one run's
accounting is the two ledgers side by side.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polar_contracts.log.arrays import Episode

from .strategies import ReconError, Sequence


class LedgerError(ReconError):
    """The sampled tokens of an episode do not equal trained + excluded."""


@dataclass
class Ledger:
    sampled: int = 0  # completion ids the server sampled (all call rows)
    trained: int = 0  # of those, in a row with loss
    excluded: dict[str, int] = field(default_factory=dict)  # reason -> sampled ids trained nowhere
    calls: int = 0  # call rows (samples) counted
    episodes: int = 0

    @property
    def accounted(self) -> int:
        return self.trained + sum(self.excluded.values())

    @property
    def closes(self) -> bool:
        return self.accounted == self.sampled

    def add(self, other: Ledger) -> None:
        self.sampled += other.sampled
        self.trained += other.trained
        self.calls += other.calls
        self.episodes += other.episodes
        for k, v in other.excluded.items():
            self.excluded[k] = self.excluded.get(k, 0) + v

    def to_json(self) -> dict[str, Any]:
        return {"sampled": self.sampled, "trained": self.trained, "excluded": dict(sorted(self.excluded.items())),
                "calls": self.calls, "episodes": self.episodes}

    @classmethod
    def from_json(cls, d: Any, where: str = "ledger") -> Ledger:
        try:
            return cls(int(d["sampled"]), int(d["trained"]), {str(k): int(v) for k, v in d["excluded"].items()},
                       int(d.get("calls", 0)), int(d.get("episodes", 1)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: not a ledger {{sampled, trained, excluded}}: {d!r} ({exc})") from None

    def summary(self) -> str:
        """'N sampled tokens: 100.0% accounted for, X% trained (excluded: reason n, ...)'."""
        if not self.sampled:
            return f"0 sampled tokens ({self.calls} calls)"
        ex = ", ".join(f"{k} {v:,}" for k, v in sorted(self.excluded.items()) if v) or "none"
        return (f"{self.sampled:,} sampled tokens: {100 * self.accounted / self.sampled:.1f}% accounted for, "
                f"{100 * self.trained / self.sampled:.1f}% trained (excluded: {ex})")


def _sampled(c) -> int:
    return 0 if c.completion is None else len(c.completion)


def episode_ledger(ep: Episode, seqs: list[Sequence], excluded: list[tuple[int, str]], *,
                   mask_counts: bool = True) -> Ledger:
    """The ledger of one built episode: `seqs` its rows, `excluded` (call row, reason) of every
    sample trained in none. `mask_counts`: the rows' loss masks are the sampled ids themselves
    (token, per-call) and must sum to them. Raises LedgerError when it does not close."""
    by_row = {c.row: c for c in ep.calls}
    led = Ledger(calls=len(ep.calls), episodes=1)
    led.sampled = sum(_sampled(c) for c in ep.calls)
    where: dict[int, str] = {}
    problems: list[str] = []

    def place(r: int, what: str) -> None:
        if r not in by_row:
            problems.append(f"{what} names call row {r}, which the log does not have")
        elif r in where:
            c = by_row[r]
            problems.append(f"call {c.call_index} (row {r}) is counted twice: {where[r]} and {what}")
        else:
            where[r] = what

    for s in seqs:
        for r in s.call_rows:
            place(r, f"row {s.segment}")
        rows_sampled = sum(_sampled(by_row[r]) for r in s.call_rows if r in by_row)
        if mask_counts:
            loss = int(np.count_nonzero(s.loss_mask))
            if loss != rows_sampled:
                problems.append(f"row {s.segment} trains {loss} tokens but its calls "
                                f"{[by_row[r].call_index for r in s.call_rows if r in by_row]} sampled {rows_sampled}")
            led.trained += loss
        else:
            led.trained += rows_sampled
    for r, reason in excluded:
        place(r, f"excluded ({reason})")
        if r in by_row:
            led.excluded[reason] = led.excluded.get(reason, 0) + _sampled(by_row[r])
    missing = [c for c in ep.calls if c.row not in where]
    if missing:
        n = sum(_sampled(c) for c in missing)
        problems.append(f"{len(missing)} calls ({n} sampled tokens) are neither trained nor excluded: calls "
                        + ", ".join(str(c.call_index) for c in missing[:10]))
    if not problems and not led.closes:
        problems.append(f"trained {led.trained} + excluded {led.accounted - led.trained} != sampled {led.sampled}")
    if problems:
        raise LedgerError(f"episode {ep.episode_id}: the coverage ledger does not close ({led.summary()}): "
                          + "; ".join(problems[:5]))
    return led
