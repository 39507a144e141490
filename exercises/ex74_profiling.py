"""Exercises for Part 02 · 74 — profiling and diagnosis of a training step.

Three pieces of the diagnosis: what a remedy saves at the peak once the ledger lines it removes are
known, the rule that attributes the logits line to the chunked loss, and the replay of the
profiler's memory timeline that gives the bytes of each category at each instant; then a variant
(the hot-spot list's self times, from the nesting of the profiler's intervals) and a prediction
(what the chunked loss removes from the logits line, before measuring it).

Check your solutions with ``bp-mech check 74`` (or
``pytest tests/test_exercises.py -m ch74 --impl exercises``). The checks compare with references
written independently of the answers: a brute-force maximum over random ledgers, the ledger of a
real chunked-loss step (tracked storages of ``bp_mech.chunked_loss`` on small Qwen2 models), and
``torch.profiler``'s own memory timeline of a real training step.

A ledger here is a dict ``{point: {class: bytes}}``: points are the lifecycle stages of Part 02 · 43
(``load``, ``forward``, ``backward_peak``, ``backward``, ``optimizer_peak``, ``zero_grad``) plus
``forward_peak`` (the largest moment inside the forward); classes are ``parameters``,
``gradients``, ``optimizer_states``, ``saved_activations``, ``logits_loss``, ``other``.
"""


def predicted_saving(stages: dict, change: dict) -> int:
    """The bytes a remedy saves at the peak of a training step.

    The peak is the largest stage total, ``max_s sum_c stages[s][c]``. A remedy changes
    some lines: ``change[s][c]`` bytes (negative: removed, positive: added, e.g. a
    recomputed layer); a stage or a class ``change`` omits is unchanged. The saving is
    the peak before minus the peak after, and the peak after is again a maximum over
    *every* stage: it may sit at another stage than before.

    Args:
        stages: ``{stage: {class: bytes}}``, the plain step's ledger.
        change: ``{stage: {class: bytes}}``, the remedy's changes (a subset of the
            stages and classes).

    Returns:
        The saving in bytes, an int (negative if the remedy makes the peak larger).

    Contract: ``stages`` and ``change`` are not modified; the result is a Python
    ``int`` (not a float, a bool or a numpy integer); the order of the stages and of
    the classes in either dict does not matter; a class that ``change[s]`` names and
    ``stages[s]`` lacks still counts (a new line at that stage); an empty ``change``
    saves 0; an empty ``stages`` (no peak) raises ``ValueError``.
    """
    raise NotImplementedError("ex74: predicted_saving")


def chunked_loss_changes(rows: dict, tokens: int, vocab: int, hidden: int,
                         chunk: int) -> dict:
    """The changes a chunked loss over the vocabulary (``bp_mech.chunked_loss``) makes
    to the logits line of a plain step's ledger ``rows`` (float32; ``rows`` also has
    ``forward_peak``).

    Notation: n = ``tokens`` (B T), V = ``vocab``, C = ``hidden``, c = min(``chunk``,
    n), and k = 2 when the loss takes more than one chunk (a chunk's logits are computed
    while the previous chunk's are still referenced by the loop's variable), k = 1 when
    one chunk covers all n tokens. What the chunked loss holds in the logits & loss
    line:

    * at every point: 12 n bytes (the per-token log-sum-exp, fp32, and the target,
      int64);
    * at ``forward_peak``, besides: k chunks' logits, k * 4 c V;
    * at ``backward_peak``, besides: the gradient of the hidden states, 4 n C, and the
      larger of k * 4 c V (chunks' logits, as in the forward) and 4 c V + 4 V C (one
      chunk's dz and its product dz^T h). The weight's gradient dW (4 V C) is allocated
      at the start of the loss's backward, before anything else: it joins the
      *gradients* line at ``backward_peak``, where the plain step has no gradient yet —
      but only where the logits line shrinks there.

    The line never grows: where the plain line is already smaller, the change is 0.

    Args:
        rows: ``{point: {class: bytes}}``, the plain step's ledger (``logits_loss`` at
            each point).
        tokens: n, tokens per forward (B T).
        vocab: V.
        hidden: C, the hidden size.
        chunk: tokens per chunk.

    Returns:
        ``{point: {"logits_loss": bytes <= 0}}`` for every point of ``rows``, and at
        ``backward_peak`` also ``"gradients": 4 V C`` where its logits line shrinks.

    Contract: ``rows`` is not modified; every point of ``rows`` is in the result (a
    point other than ``forward_peak`` and ``backward_peak`` keeps the 12 n bytes only)
    and no other; each value is a Python ``int`` (the result can be written to JSON);
    a point has exactly the keys above (no ``"gradients"`` where the line does not
    shrink); a row needs only its ``logits_loss`` (other classes may be missing).
    """
    raise NotImplementedError("ex74: chunked_loss_changes")


def live_by_category(events, categories: dict) -> tuple:
    """Replay a memory timeline (``torch.profiler``'s memory profiler): the live bytes
    per category.

    Each event is ``(time, action, key, version, nbytes)`` in time order. A storage is
    known by ``key``; each in-place write gives it a new ``version``, and each version
    has its own category (``categories[(key, version)]``, ``"unknown"`` where the dict
    lacks it): a parameter's storage is a parameter in every version, but a buffer
    written by backward may become a gradient. Actions:

    * ``"preexisting"`` (alive before the window, time -1) and ``"create"``: ``nbytes``
      join the category of ``(key, version)``;
    * ``"increment_version"``: the storage's ``nbytes`` leave ``(key, version)``'s
      category and join ``(key, version + 1)``'s;
    * ``"destroy"``: ``nbytes`` leave ``(key, version)``'s category.

    Several events may share one time: report one state per distinct time, the state
    after all of them.

    Args:
        events: a list of ``(time, action, key, version, nbytes)`` tuples, time-ordered.
        categories: ``{(key, version): category name}``.

    Returns:
        ``(times, states)``: the distinct times in order, and for each the live bytes
        as ``{category: bytes}`` (a category never seen may be missing; one seen may
        hold 0).

    Contract: ``events`` and ``categories`` are not modified (a missing version is
    read as ``"unknown"``, not written into the dict); the result is a tuple of two
    lists of equal length; each state is its own dict (a snapshot: changing one
    changes no other) of Python ``int`` bytes; no events give ``([], [])``; an
    unknown action raises ``ValueError``.
    """
    raise NotImplementedError("ex74: live_by_category")


def self_time_by_name(intervals) -> dict:
    """The self time of each operator name, from the profiler's nested intervals.

    A hot-spot list ranks operators by *self* time: an interval's duration minus the
    durations of its direct children. Each interval is ``(name, thread, start, end)``,
    half-open ``[start, end)``, in the profiler's microseconds (floats). Within one
    thread intervals nest: two are disjoint or one contains the other. Interval b is
    a child of a when a is the innermost interval of b's thread that contains it:
    ``a.start <= b.start``, ``b.end <= a.end`` and ``b.start < a.end`` (so an
    interval of zero length is nobody's parent, and one at a's end is not a's). An
    interval of another thread is never a child, whatever its times.

        self(a) = (end_a - start_a) - sum of (end_b - start_b) over a's children b
        self(name) = sum of self(a) over the intervals a called name

    Args:
        intervals: a list of ``(name, thread, start, end)`` tuples in any order; no two
            intervals of positive length in one thread have the same start and end.

    Returns:
        ``{name: self time}``: every name of ``intervals`` (0.0 where its intervals
        are all covered by their children), each value a Python ``float``.

    Contract: ``intervals`` is not modified (not even sorted in place); the order of
    the intervals does not matter; no intervals give ``{}``; the result can be written
    to JSON.
    """
    raise NotImplementedError("ex74: self_time_by_name")


def predict_logits_line_saving(tokens: int, vocab: int, hidden: int,
                               chunk: int) -> int:
    """Predict, then measure: the bytes a chunked loss removes from the logits & loss
    line at the backward's peak of a plain float32 step whose peak is the log-softmax
    backward.

    The quantity, in bytes: the plain step's logits & loss line at the backward's
    peak minus the chunked loss's (``bp_mech.chunked_loss``, ``chunk`` tokens per
    chunk) line at the same moment, for n = ``tokens``, V = ``vocab``, C = ``hidden``.
    Predict it from the chapter's formulas alone (no ledger is given). The check
    measures both lines on small Qwen2 models (every storage tracked) and accepts an
    error of at most 4 c C + 64 bytes, c = min(``chunk``, n): the (c, C) product of
    dh's chunk and the loss's scalars, which the formulas leave out.

    Args:
        tokens: n, tokens per forward (B T).
        vocab: V.
        hidden: C.
        chunk: tokens per chunk.

    Returns:
        The bytes removed from the line, a Python ``int`` (negative when the chunked
        loss's line would be the larger one).

    Contract: exactly the chapter's formulas (also checked on drawn settings, where
    one chunk may cover every token or C may be large).
    """
    raise NotImplementedError("ex74: predict_logits_line_saving")
