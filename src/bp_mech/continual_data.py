"""Part 02 · 56 — the texts of continual pretraining and the training batches cut from them.

The general, domain and holdout texts (``load_texts``: the shipped ones — English prose for the general
text and its held-out tail, Python source for the domain — or the reader's own files for the domain and
the holdout text), a text's identity (``text_sha256``: results and saved states record
it), the held-out tail of a text (``split_text``) and the data stream a training loop draws its batches
from (``TextStream``, whose state is part of the training state). The loop is
``bp_mech.continual_pretrain``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from bp_mech.instruments.workload import WorkloadError, tokenize


def text_sha256(ids: torch.Tensor) -> str:
    """Identity of a token sequence (16 hex digits of the sha256 of its int64 ids).

    The ids are cast to int64 first, so the dtype and device of ``ids`` do not change the result.

    Args:
        ids: (N,) token ids.

    Returns:
        The first 16 hex digits of the sha256 of the ids' int64 bytes.

    Example:
        >>> ids = torch.arange(4)
        >>> len(text_sha256(ids)), text_sha256(ids) == text_sha256(ids.to(torch.int32))
        (16, True)
    """
    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


def split_text(ids: torch.Tensor, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a text into (train part, evaluation part): the last ``eval_fraction`` is never trained on.

    The evaluation part is the last ``round(eval_fraction * len(ids))`` tokens, and at least 2.

    Args:
        ids: (N,) token ids of the text.
        eval_fraction: the fraction of the tokens, at the end of the text, kept for evaluation.

    Returns:
        ``(ids[:cut], ids[cut:])``: the training part and the evaluation part, views of ``ids``.

    Raises:
        ValueError: fewer than 2 tokens would be left for training.

    Example:
        >>> train_part, eval_part = split_text(torch.arange(100), 0.1)
        >>> len(train_part), len(eval_part), len(split_text(torch.arange(10), 0.01)[1])
        (90, 10, 2)
    """
    cut = len(ids) - max(2, round(eval_fraction * len(ids)))
    if cut < 2:
        raise ValueError(f"a text of {len(ids)} tokens is too short to split into training and evaluation parts")
    return ids[:cut], ids[cut:]


@dataclass(frozen=True)
class Text:
    """A tokenized text and where it came from.

    Args:
        source: ``"shipped:<name>"`` or the path the reader gave.
        ids: (N,) token ids.

    Example:
        >>> text = Text("shipped:domain", torch.arange(5))
        >>> text.source, len(text.ids)
        ('shipped:domain', 5)
    """

    source: str  # "shipped:<name>" or the path the reader gave
    ids: torch.Tensor  # (N,) token ids


# Part 02 · 56's shipped texts (package data, made once and frozen, so a record's sha256 stays valid):
# "prose" is this book's own English prose (Part 02's pages but 56, code cells, math and markup removed);
# "code" is this package's own Python source (ten modules with docstrings and comments removed, ast.unparse).
SHIPPED = dict(general="prose", domain="code")
HOLDOUT_FRACTION = 0.2  # the prose's tail kept as the holdout, never pretrained on


def load_texts(domain_path=None, holdout_path=None, w=None) -> dict[str, Text]:
    """The general, domain and holdout texts, tokenized for workload ``w``.

    General: the shipped prose's first ``1 - HOLDOUT_FRACTION`` (always; the base pretrains on it).
    Domain: the shipped code, or the reader's own UTF-8 file. Holdout: the prose's last
    ``HOLDOUT_FRACTION`` (``split_text``: the same distribution as the general text, never trained on),
    or the reader's own UTF-8 file.

    Args:
        domain_path: a UTF-8 file with the domain text; None: the shipped code.
        holdout_path: a UTF-8 file with the holdout text; None: the shipped prose's held-out tail.
        w: the ``instruments.workload.Workload`` whose tokenizer to use; None: the byte-level one.

    Returns:
        ``{"general": Text, "domain": Text, "holdout": Text}``, in that order.

    Raises:
        WorkloadError: a file cannot be read or decoded, or has fewer than 16 tokens.

    Example:
        >>> texts = load_texts()
        >>> list(texts), texts["domain"].source, texts["holdout"].source
        (['general', 'domain', 'holdout'], 'shipped:code', 'shipped:prose[-20%:]')
    """
    def shipped(name: str) -> torch.Tensor:  # package data, read here (instruments.workload's TEXTS stay its own)
        return tokenize(resources.files("bp_mech").joinpath(f"data/{name}.txt").read_text(encoding="utf-8"), w)

    general, tail = split_text(shipped(SHIPPED["general"]), HOLDOUT_FRACTION)
    cut = f"{HOLDOUT_FRACTION:.0%}"
    out = dict(general=Text(f"shipped:prose[:-{cut}]", general))
    for name, path in (("domain", domain_path), ("holdout", holdout_path)):
        if path is None:
            out[name] = (Text(f"shipped:prose[-{cut}:]", tail) if name == "holdout" else
                         Text(f"shipped:{SHIPPED[name]}", shipped(SHIPPED[name])))
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise WorkloadError(f"cannot read the {name} text {path}: {e}") from None
        ids = tokenize(text, w)
        if len(ids) < 16:
            raise WorkloadError(f"the {name} text {path} has {len(ids)} tokens; at least 16 are needed")
        out[name] = Text(str(path), ids)
    return out


class TextStream:
    """Full-sequence training batches cut from one token sequence at random offsets.

    Its state is ``generator`` (which draws the offsets) and ``position`` (batches drawn so far).
    Labels equal the inputs: every next token is a target.

    Args:
        ids: (N,) token ids, N >= 2; kept on the CPU.
        batch: sequences per batch (B).
        seq: tokens per sequence (T); a text shorter than T wraps around.
        seed: seed of the generator that draws the offsets.
        device: where the batches are put.

    Raises:
        ValueError: ``ids`` has fewer than 2 tokens.

    Example:
        >>> stream = TextStream(torch.arange(100), batch=2, seq=8, seed=0)
        >>> b = stream.next()
        >>> tuple(b["input_ids"].shape), torch.equal(b["labels"], b["input_ids"]), stream.position
        ((2, 8), True, 1)
    """

    def __init__(self, ids: torch.Tensor, batch: int, seq: int, seed: int, device="cpu") -> None:
        if len(ids) < 2:
            raise ValueError("a training text needs at least 2 tokens")
        self.ids = ids.cpu()  # (N,)
        self.batch, self.seq, self.device = batch, seq, device
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    @property
    def tokens(self) -> int:
        """Tokens of the batches drawn so far.

        Returns:
            ``position * batch * seq``.

        Example:
            >>> stream = TextStream(torch.arange(100), batch=2, seq=8, seed=0)
            >>> _ = stream.next(), stream.next()
            >>> stream.tokens
            32
        """
        return self.position * self.batch * self.seq

    def next(self) -> dict[str, torch.Tensor]:
        """The next batch: ``batch`` windows of ``seq`` tokens at offsets the generator draws.

        Offsets are uniform over the windows that fit in the text; a text shorter than ``seq`` is
        repeated (it wraps around). Advances ``position`` by one.

        Returns:
            ``{"input_ids": x, "labels": x.clone()}``, x a (batch, seq) int64 tensor on ``device``.

        Example:
            >>> x = TextStream(torch.arange(5), batch=2, seq=8, seed=0).next()["input_ids"]
            >>> tuple(x.shape), set(x.reshape(-1).tolist()) <= {0, 1, 2, 3, 4}
            ((2, 8), True)
        """
        n, T = len(self.ids), self.seq
        text = self.ids if n >= T else self.ids.repeat(T // n + 2)  # a short text wraps around
        starts = torch.randint(0, max(1, n - T + 1) if n >= T else n, (self.batch,), generator=self.generator)
        x = torch.stack([text[s:s + T] for s in starts.tolist()]).to(self.device)  # (B, T)
        self.position += 1
        return {"input_ids": x, "labels": x.clone()}

    def state_dict(self) -> dict:
        """The stream's state: batches drawn so far and the generator's state.

        Returns:
            ``{"position": int, "generator": the generator's state (a uint8 tensor, a copy)}``.

        Example:
            >>> stream = TextStream(torch.arange(100), batch=2, seq=8, seed=0)
            >>> _ = stream.next()
            >>> sorted(stream.state_dict()), stream.state_dict()["position"]
            (['generator', 'position'], 1)
        """
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict``: the next batch is the one the saved stream would draw.

        Args:
            state: a ``state_dict()``; its generator state is copied, not kept.

        Returns:
            None.

        Example:
            >>> a, b = TextStream(torch.arange(100), 2, 8, seed=0), TextStream(torch.arange(100), 2, 8, seed=5)
            >>> _ = a.next()
            >>> b.load_state_dict(a.state_dict())
            >>> b.position, torch.equal(a.next()["input_ids"], b.next()["input_ids"])
            (1, True)
        """
        self.position = int(state["position"])
        self.generator.set_state(state["generator"].clone())
