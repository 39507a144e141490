"""bp_mech: backpropagation and the training mechanisms of LLMs, measured.

The package follows the book, one concept per module:

* ``bp_mech.<mechanism>``: what a chapter teaches (``local_backward``, ``attention_backward``,
  ``accumulation``, ``scheduler``, ``amp``, ``checkpointing``, ``offload``, ``ledger``,
  ``update_dynamics``), what the exercise answers re-export;
* ``bp_mech.experiments.<mechanism>``: that chapter's experiment (candidates, plan, decision rule,
  records), all on ``bp_mech.experiments.harness``;
* shared tools: ``workload`` (models, text, batches), ``measure`` (the timing protocol, the OOM
  guard), ``tracking`` (the storage tracker, ``PeakMemory``), ``counters`` (forward calls, saved
  tensors), ``results`` (the record), ``provenance`` (code hash, commit), ``registry`` (the IDs and
  ``chapter_map``: chapter -> mechanism -> experiment -> exercise -> tests), ``environment``,
  ``report`` and ``plots`` (what the chapters show), ``cli``.
"""

from pathlib import Path

__version__ = "0.1.0"
ROOT = Path(__file__).resolve().parents[2]  # the repository this source tree sits in (src layout)
RESULTS_DIR = ROOT / "book" / "results"  # the cached run records the book shows
