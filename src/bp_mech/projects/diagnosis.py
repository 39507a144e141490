"""Part 02 · 74 — the diagnosis: dominant state, the two views of memory, remedies ranked and checked.

* ``ledger_rows``: Part 02 · 43's ledger as a table ``{point: {class: bytes}}`` over the six stages
  plus the peak inside the forward (``forward_peak``: the forward row with what only exists at that
  moment, the logits, booked as logits & loss);
* ``dominant_state``: where the peak is and which line holds most of it;
* ``cross_check``: the profiler's categories (``step_profile``) against the ledger's classes at
  each stage, through ``CATEGORY_TO_CLASS``;
* ``predicted_saving``: what a remedy saves at the peak when it changes some lines of the ledger,
  the peak free to move to another stage (the attribution of a ledger line to a remedy);
* ``REMEDIES`` / ``line_changes`` / ``rank``: each remedy is a ``bench.strategy.Strategy`` and the
  changes it makes to the measured plain ledger, line by line: Part 02 · 43's formula for that
  strategy minus the formula for the plain step (``ledger.theoretical``), or, for the chunked loss,
  which the formula does not model, its own rule (``chunked_loss_changes``); ``Attribution`` is one
  remedy of the ranked list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bp_mech import chunked_loss, ledger, state_bytes
from bp_mech.bench.strategy import Strategy, parse
from bp_mech.ledger_table import CLASS_LABELS, CLASSES, STAGE_LABELS, STAGES

POINTS = ("forward_peak", *STAGES)  # the ledger's stages and the peak inside the forward
POINT_LABELS = dict(STAGE_LABELS, forward_peak="peak in forward")

# --- the ledger as a table, its dominant state ---------------------------------------------------


def ledger_rows(led) -> dict[str, dict[str, int]]:
    """``{point: {class: bytes}}`` of a ``ledger_table.Ledger``. The forward's peak comes in as a row: the
    forward stage's row plus the bytes alive only at that moment (the logits and the log-softmax
    output side by side), booked as logits & loss."""
    rows = {s: dict(led.stages[s]) for s in STAGES}
    fpeak = dict(rows["forward"])
    fpeak["logits_loss"] += max(led.forward_peak - led.total("forward"), 0)
    return {"forward_peak": fpeak, **rows}


def peak_point(rows: dict[str, dict[str, int]]) -> str:
    """The point with the most bytes alive (the first of equals, in ``POINTS`` order)."""
    return max(rows, key=lambda p: sum(rows[p].values()))


@dataclass(frozen=True)
class Dominant:
    """Where the peak is, and the line of the ledger that holds most of it."""

    point: str  # the point (a ledger stage, or "forward_peak")
    peak: int  # bytes alive there
    line: str  # the ledger class that holds most of them
    bytes: int  # its bytes
    share: float  # bytes / peak


def dominant_state(rows: dict[str, dict[str, int]]) -> Dominant:
    """The peak's point, its total, and the line (class) that holds most of it, with its share."""
    point = peak_point(rows)
    total = sum(rows[point].values())
    line = max(CLASSES, key=lambda c: rows[point][c])
    return Dominant(point, total, line, rows[point][line], rows[point][line] / total)


def predicted_saving(stages: dict[str, dict[str, int]],
                     change: dict[str, dict[str, int]]) -> int:
    """Bytes a remedy saves at the peak: the largest stage total before, minus the
    largest after each line of ``stages`` ({stage: {class: bytes}}) moved by ``change``
    ({stage: {class: bytes}}, negative: removed; a stage or class it omits is
    unchanged). The peak after may sit at another stage than before: a remedy saves no
    more than the gap to the next-largest stage allows."""
    before = max(sum(row.values()) for row in stages.values())
    after = max(sum(row.values()) + sum(change.get(s, {}).values())
                for s, row in stages.items())
    return before - after


# --- two views of memory: the profiler's categories against the ledger's classes ------------------

# Each profiler category (torch.profiler._memory_profiler.Category) booked under the ledger class
# nearest in meaning. The profiler tells roles apart from data flow, the ledger from where a storage
# is born and what it becomes; ``cross_check`` shows where the two disagree.
CATEGORY_TO_CLASS = dict(parameter="parameters", optimizer_state="optimizer_states", gradient="gradients",
                         activation="saved_activations", autograd_detail="other", temporary="other",
                         input="other", unknown="other")


def cross_check(rows: dict[str, dict[str, int]], profiled: dict[str, dict[str, int]]) -> dict[str, dict]:
    """Per point the profiler has (``step_profile.STAGE_POINTS``): both totals and their difference, and
    per ledger class the ledger's bytes, the profiler's bytes booked to it (``CATEGORY_TO_CLASS``) and
    the difference (ledger minus profiler)."""
    out = {}
    for point, cats in profiled.items():
        mapped = dict.fromkeys(CLASSES, 0)
        for cat, nbytes in cats.items():
            mapped[CATEGORY_TO_CLASS[cat]] += nbytes
        led = rows[point]
        out[point] = dict(ledger_total=sum(led.values()), profiler_total=sum(cats.values()),
                          difference=sum(led.values()) - sum(cats.values()), profiler=dict(cats),
                          by_class={c: dict(ledger=led[c], profiler=mapped[c], difference=led[c] - mapped[c])
                                    for c in CLASSES})
    return out


def known_lines(w) -> dict[str, int]:
    """Storages the two views book differently, sized from the workload (float32, n = B T tokens):
    the logits and the log-softmax output the loss saves (4 n V each), the two (n, V) gradients alive
    in its backward (8 n V), the shifted targets (int64, 8 n) and the labels padded for the shift
    (8 B (T + 1)), RoPE's cos and sin (2 x 4 T d) and its two inverse-frequency buffers (2 x 4 d/2);
    with tied embeddings the two gradients of the shared weight (lm_head's and the embedding's, 2 x 4 V C)
    before they are summed; and W, the bytes of all parameters (of their gradients)."""
    from bp_mech.instruments.workload import ARCHITECTURES

    a = ARCHITECTURES[w.arch]
    n, V, hd = w.batch * w.seq, a["vocab_size"], a["hidden_size"] // a["num_attention_heads"]
    return dict(logits=4 * n * V, log_softmax_output=4 * n * V, log_softmax_backward_buffers=8 * n * V,
                targets=8 * n, padded_labels=8 * w.batch * (w.seq + 1), rope_cos_sin=8 * w.seq * hd,
                rope_buffers=4 * hd, weights=state_bytes.param_bytes(a),
                tied_embedding_gradients=8 * V * a["hidden_size"] if a["tie_word_embeddings"] else 0)


# Where each known line sits in the two views (ledger class -> the class the profiler's category maps
# to), at the points where it is alive: the profiler floods "activation" forward from the inputs, so
# the logits and what the loss saves are activations to it; it calls what backward nodes create
# "autograd detail" (a gradient is a "gradient" once it is accumulated into .grad), and tensors made
# from no input or parameter (RoPE's tables, the shifted targets) "input"; the ledger books all of
# the loss's storages under logits & loss, RoPE's tables under saved activations (they are saved for
# the attention backward), RoPE's buffers under parameters (the profiler sees the one the forward
# reads as an input and never sees the other) and a gradient as a gradient from the moment its node
# sends it. The backward's peak is one of several moments (``backward_moment``), each with its own.
_ROPE = [("rope_buffers", "parameters", "other")]
_FORWARD = [("log_softmax_output", "logits_loss", "saved_activations"), ("rope_cos_sin", "saved_activations", "other")]
MOVES = {
    "forward_peak": [("logits", "logits_loss", "saved_activations"), ("targets", "logits_loss", "other"),
                     ("padded_labels", "logits_loss", "other"), *_FORWARD, *_ROPE],
    "forward": [("targets", "logits_loss", "other"), *_FORWARD, *_ROPE],
    "backward": _ROPE, "optimizer_peak": _ROPE, "zero_grad": _ROPE,
}
BACKWARD_MOVES = {
    "the log-softmax backward": [("log_softmax_backward_buffers", "logits_loss", "other"), *_FORWARD, *_ROPE],
    "the end of the backward (tied embedding)": [("tied_embedding_gradients", "gradients", "other"), *_ROPE],
    "another moment": _ROPE,
}


def backward_moment(row: dict[str, int], known: dict[str, int]) -> str:
    """Which moment the plain step's backward peak ``row`` is, from the lines it holds: the log-softmax
    backward holds the three (n, V) buffers; the end of a tied model's backward all gradients and the
    shared weight's two."""
    if row["logits_loss"] >= known["log_softmax_output"] + known["log_softmax_backward_buffers"]:
        return "the log-softmax backward"
    if known["tied_embedding_gradients"] and row["gradients"] >= known["weights"] + known["tied_embedding_gradients"]:
        return "the end of the backward (tied embedding)"
    return "another moment"


def reconcile(cross: dict[str, dict], known: dict[str, int], rows: dict[str, dict[str, int]]) -> dict[str, dict]:
    """Per point, what is left of each class's difference (ledger minus profiler, ``cross_check``)
    once the known lines (``known_lines``) are moved to where the profiler books them (``MOVES``;
    at the backward's peak ``BACKWARD_MOVES`` of its ``backward_moment``)."""
    out = {}
    for point, c in cross.items():
        left = {cls: v["difference"] for cls, v in c["by_class"].items()}
        moves = BACKWARD_MOVES[backward_moment(rows[point], known)] if point == "backward_peak" else MOVES[point]
        for name, src, dst in moves:
            left[src] -= known[name]
            left[dst] += known[name]
        out[point] = left
    return out


# --- remedies: what each removes, predicted and measured -----------------------------------------

@dataclass(frozen=True)
class Remedy:
    strategy: Strategy  # the mechanism, as every chapter runs it (``bench.step.train_step``)
    line: str  # the ledger class it removes
    how: str  # what it does to that line, in words

    @property
    def name(self) -> str:
        return self.strategy.name

    def unfit(self, w) -> str | None:
        """Why this remedy cannot run on workload ``w`` (None: it can)."""
        k = self.strategy.micro_batches
        return f"batch {w.batch} is not divisible into {k} micro-batches" if w.batch % k else None


REMEDIES = (
    Remedy(parse("chunked-loss"), "logits_loss",
           f"computes the loss over the vocabulary {chunked_loss.DEFAULT_CHUNK} tokens at a time: one chunk's fp32 "
           "logits alive, never all of them"),
    Remedy(parse("checkpoint-all"), "saved_activations",
           "keeps each decoder layer's input only and recomputes the layer in its backward"),
    Remedy(parse("offload"), "saved_activations",
           "moves the saved activations to host memory and copies each back when its backward needs it"),
    Remedy(parse("fp16"), "saved_activations",
           "saves half-precision activations, at the price of half-precision weight copies"),
    Remedy(parse("micro2"), "saved_activations",
           "runs the batch as 2 micro-batches: half the activations and logits, gradients already present"),
)

LOSS_KEEPS_PER_TOKEN = 12  # bytes per token the chunked loss keeps till backward: lse (fp32) + target (int64)


def chunked_loss_changes(rows: dict[str, dict[str, int]], tokens: int, vocab: int,
                         hidden: int, chunk: int) -> dict:
    """The chunked loss's rule, read from its mechanism (``bp_mech.chunked_loss``),
    float32, n = ``tokens``, c = min(``chunk``, n), V = ``vocab``, C = ``hidden``; k = 2
    (1 when one chunk covers every token):

    * between forward and backward the loss keeps ``LOSS_KEEPS_PER_TOKEN`` n bytes (lse,
      targets);
    * at the forward's peak, besides: k chunks' logits, k 4 c V (a chunk's logits are
      computed while the previous chunk's are still referenced by the loop's variable);
    * in the loss's backward, besides: the gradient of the hidden states (4 n C) and the
      weight's gradient dW (4 V C, allocated first: the plain step has no gradient yet
      at that moment), and the larger of k chunks' logits (k 4 c V, as in the forward)
      and one chunk's dz with its product dz^T h (4 c V + 4 V C).

    The logits & loss line of each point shrinks to that (never grows); where the
    backward's peak shrinks, dW joins the gradients line there. Left out: the (c, C)
    product of dh's chunk, the loss's scalars, what Transformers' loss allocates for the
    targets (bytes per token, not per logit)."""
    c, n, V, C = min(chunk, tokens), tokens, vocab, hidden
    k = 2 if n > c else 1
    live = {"forward_peak": k * 4 * c * V,
            "backward_peak": max(k * 4 * c * V, 4 * c * V + 4 * V * C) + 4 * n * C}
    out = {}
    for point, row in rows.items():
        cut = min(0, LOSS_KEEPS_PER_TOKEN * n + live.get(point, 0) - row["logits_loss"])
        out[point] = {"logits_loss": cut}
        if point == "backward_peak" and cut < 0:
            out[point]["gradients"] = 4 * V * C
    return out


def line_changes(remedy: Remedy, rows: dict[str, dict[str, int]], w, device) -> dict[str, dict[str, int]]:
    """The changes ``remedy`` makes to the measured plain ledger ``rows`` of workload ``w`` on ``device``:
    per point and class, the formula's bytes for the remedy minus its bytes for the plain step
    (``ledger.theoretical``), or, for the chunked loss (``ledger.unmodelled``), its own rule."""
    from bp_mech.instruments.workload import ARCHITECTURES

    arch = ARCHITECTURES[w.arch]
    if ledger.unmodelled(remedy.strategy):
        return chunked_loss_changes(rows, w.batch * w.seq // remedy.strategy.micro_batches, arch["vocab_size"],
                                    arch["hidden_size"], remedy.strategy.chunked_loss)
    plain = ledger_rows(ledger.theoretical(arch, w.batch, w.seq, None, device))
    after = ledger_rows(ledger.theoretical(arch, w.batch, w.seq, remedy.strategy, device))
    return {p: {c: after[p][c] - plain[p][c] for c in CLASSES if after[p][c] != plain[p][c]} for p in POINTS}


@dataclass(frozen=True)
class Attribution:
    """One remedy of the ranked list: the line it removes and what the ledger predicts it saves."""

    remedy: str  # the strategy's name
    line: str  # the ledger class it removes
    line_label: str  # that class in words
    line_at_peak: int  # bytes the line holds at the plain peak
    peak_point: str  # where the plain peak is
    predicted_saving: int  # ``predicted_saving``: the peak free to move to another point
    naive_saving: int  # the changes at the plain peak's point only, as if the peak stayed there
    predicted_peak: int  # the plain peak minus the predicted saving
    predicted_peak_point: str  # where the peak is predicted to be after the remedy
    how: str  # what the remedy does, in words
    changes: dict  # ``line_changes``: {point: {class: bytes}}

    def to_dict(self, changes: bool = True) -> dict:
        d = dataclasses.asdict(self)
        return d if changes else {k: v for k, v in d.items() if k != "changes"}


def attribution(remedy: Remedy, rows: dict, w, device) -> Attribution:
    """The ``Attribution`` of ``remedy`` on the measured plain ledger ``rows``."""
    change = line_changes(remedy, rows, w, device)
    point = peak_point(rows)
    after = {p: {c: rows[p][c] + change.get(p, {}).get(c, 0) for c in CLASSES}
             for p in rows}
    saving = predicted_saving(rows, change)  # the peak taken again, over every stage
    naive = -sum(change.get(point, {}).values())  # as if the peak stayed at `point`
    return Attribution(remedy.name, remedy.line, CLASS_LABELS[remedy.line],
                       rows[point][remedy.line], point, saving, naive,
                       sum(rows[point].values()) - saving, peak_point(after),
                       remedy.how, change)


def rank(rows: dict[str, dict[str, int]], w, device, remedies=REMEDIES) -> list[Attribution]:
    """Every remedy's ``attribution`` (those that can run on ``w``), the largest predicted saving first."""
    return sorted((attribution(r, rows, w, device) for r in remedies if r.unfit(w) is None),
                  key=lambda a: -a.predicted_saving)


def sentence(a: Attribution, fmt_bytes) -> str:
    """"fp32 logits hold X at the peak; a chunked loss removes about Y" for one ``Attribution``."""
    return (f"{a.line_label} hold {fmt_bytes(a.line_at_peak)} at the peak ({POINT_LABELS[a.peak_point]}); "
            f"{a.remedy} removes about {fmt_bytes(a.predicted_saving)}")
