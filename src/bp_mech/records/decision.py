"""What a decision rule returns: one ``Decision`` (a verdict, why, what to do next), the same for every rule.

Every experiment and project decides by a rule written as code with named constants (``bp_mech.book.rules``
lists them). Each rule returns a ``Decision``; a record takes its ``decision`` and ``next_step`` fields from
``Decision.record_fields`` (``bp_mech.records.results.Record``), so no caller unpacks a tuple. The verdict
is one of ``VERDICTS``, or None when nothing was decided: the time ratio is noise, there is nothing to
compare with, the arm failed, or it is the baseline the others are compared with. A record's ``next_step``
says why, then what to do (``"<reason>: <next step>"``), so the record keeps the numbers that decided it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Verdict = Literal["accept", "tune", "reject"]
VERDICTS: tuple[str, ...] = get_args(Verdict)  # the values a record's ``decision`` field takes (or null)


@dataclass(frozen=True)
class Decision:
    """One rule's outcome for one candidate.

    Example:
        >>> d = Decision("tune", "peak saving 7.0% < MIN_PEAK_SAVING 10%", "cover more of the saved activations")
        >>> d.record_fields()["next_step"]
        'peak saving 7.0% < MIN_PEAK_SAVING 10%: cover more of the saved activations'
        >>> Decision.failed("out of memory: CUDA").record_fields()
        {'decision': None, 'next_step': 'failed: out of memory: CUDA: see the failure'}
    """

    verdict: Verdict | None  # accept | tune | reject; None: nothing decided (noise, no baseline, a failure)
    reason: str  # why, in words: which rule fired, with the numbers that made it fire
    next_step: str | None = None  # what to do next (None: nothing; an accepted candidate is used as it is)

    def __post_init__(self):
        if self.verdict is not None and self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; one of {', '.join(VERDICTS)} or None")
        if not self.reason:
            raise ValueError("a decision states its reason")

    def record_fields(self) -> dict[str, str | None]:
        """The record's fields this decision fills (``bp_mech.records.results.Record``'s names).

        Returns:
            ``decision``: the verdict; ``next_step``: why, then what to do (``"<reason>: <next step>"``), or
            None when there is nothing to do.

        Example:
            >>> Decision("accept", "errors within TOL64 1e-10").record_fields()
            {'decision': 'accept', 'next_step': None}
        """
        return dict(decision=self.verdict, next_step=f"{self.reason}: {self.next_step}" if self.next_step else None)

    @classmethod
    def failed(cls, failure: str) -> "Decision":
        """No verdict: the candidate could not be measured.

        Args:
            failure: why it failed, in words (a record's ``failure``).

        Returns:
            A ``Decision`` without a verdict: the reason ``"failed: <failure>"``, the next step to see it.

        Example:
            >>> Decision.failed("no baseline").verdict is None
            True
        """
        return cls(None, f"failed: {failure}", "see the failure")
