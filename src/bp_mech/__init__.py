"""bp_mech: backpropagation and the training mechanisms of LLMs, measured.

The package follows the book. Read it in this order:

1. **The mechanisms** (``bp_mech.<mechanism>``): what a chapter teaches, and what the exercise
   answers re-export. Part 02 · 09 ``local_backward`` (with ``local_backward_gelu``); 10
   ``attention_backward`` (with ``attention_rope``, ``attention_config``,
   ``attention_strategies``, ``attention_framework``); 11 ``accumulation`` and ``chunked_loss``;
   12 ``scheduler``; AMP ``amp`` and ``loss_scaling``; 19 ``checkpointing`` (with
   ``checkpointing_native``); 42 ``offload`` and ``host_memory``; 43 ``ledger`` (with
   ``ledger_table``) and ``state_bytes``; 55 ``update_dynamics``; 56 ``continual_pretrain``
   (with ``continual_data``, ``continual_eval``) and ``training_state`` (with ``state_format``,
   ``rng_state``). Each backward sits beside its forward; each memory strategy is a context
   manager with an off switch.
2. **The bench** (``bp_mech.bench``): the workload, the one training step (``bench.step.train_step``)
   with its phase observers, strategies by name (``bench.strategy``), timing, memory tracking,
   counters, comparisons.
3. **The experiments** (``bp_mech.experiments``): one per chapter, all on ``experiments.harness``
   (same-weights and own-weights arms), ``decision`` (the strategies' rule) and ``dry_run``.
4. **The projects** (``bp_mech.projects``): 73 baseline, 74 profiling and diagnosis, 76 memory strategy.
5. **The planner** (``bp_mech.planner``): ``bp-mech plan``.
6. **The records** (``bp_mech.records``): the record, its provenance, the registry of experiments.
7. **The book's helpers** (``bp_mech.book``) and the **exercise checks** (``bp_mech.checks``,
   ``bp-mech check``); ``cli`` ties them together.

Imports run down these layers, never up, and form no cycle (tests/test_layers.py): the instruments
the mechanisms measure with (``bench.workload``, ``bench.tracking``, ``bench.counters``), the
mechanisms, the rest of the bench, records, experiments, planner, projects, book, checks, cli.
"""

import logging
from pathlib import Path

__version__ = "0.1.0"
# bitsandbytes (bp-mech plan's 8-bit AdamW; Transformers imports it wherever it is installed) warns on import
# on any machine without its optional CPU kernels package, which nothing here uses: drop that one line
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "kernels-community" not in record.getMessage())
ROOT = Path(__file__).resolve().parents[2]  # the repository this source tree sits in (src layout)
RESULTS_DIR = ROOT / "book" / "results"  # the cached run records the book shows
