"""bp_mech: backpropagation and the training mechanisms of LLMs, measured.

The package follows the book. Its folders are its layers, lowest first; a module imports its own layer
and the ones below it, never one above, and the imports form no cycle (tests/test_layers.py):

1. **The instruments** (``bp_mech.instruments``): what everything measures with. ``workload`` (the model,
   the text, the batches, the one AdamW factory), ``anatomy`` (a model's blocks and head, found from the
   model itself), ``counters`` (forward calls, saved tensors), ``tracking`` (the storage tracker,
   ``PeakMemory``). An instrument observes a mechanism; a mechanism never reports to it.
2. **The mechanisms** (``bp_mech.<mechanism>``, the modules at the top): what a chapter teaches, and what
   the exercise answers import. Part 02 · 09 ``local_backward`` (with ``local_backward_gelu``); 10
   ``attention_backward`` (with ``attention_rope``, ``attention_config``, ``attention_strategies``,
   ``attention_framework``); 11 ``accumulation`` (with ``accumulation_framework``) and ``chunked_loss``
   (with ``chunked_head``); 12 ``scheduler``; AMP ``amp`` and ``loss_scaling``; 19 ``checkpointing`` (with
   ``checkpointing_native``); 42 ``offload`` and ``host_memory``; 43 ``ledger`` (with ``ledger_table``) and
   ``state_bytes``; 55 ``update_dynamics``; 56 ``continual_pretrain`` (with ``continual_data``,
   ``continual_eval``) and ``training_state`` (with ``state_format``, ``state_identity``, ``rng_state``).
   Each backward sits beside its forward; each memory strategy is a context manager with an off switch.
   Each name has one import path: the module that defines it (``tests/test_import_paths.py``).
3. **The bench** (``bp_mech.bench``): the one training step (``bench.step.train_step``) with its phase
   observers, strategies by name (``bench.strategy``), the optimizer (``bench.optimizer``), timing,
   comparisons, allocation failures.
4. **The records** (``bp_mech.records``): the record, its provenance, the registry of experiments.
5. **The planner** (``bp_mech.planner``): Part 02 · 43's ledger of one step, real or under fake tensors
   (``planner.lifecycle``), with everything the fake trace needs (fake ops, fine-tune modes, shard
   tracking, CUDA's autocast lists, step definitions), and ``bp-mech plan`` on top of it.
6. **The experiments** (``bp_mech.experiments``): one per chapter, all on ``experiments.harness``
   (same-weights and own-weights arms), ``decision`` (the strategies' rule) and ``dry_run``.
7. **The projects** (``bp_mech.projects``): 73 baseline, 74 profiling and diagnosis, 76 memory strategy.
8. **The book's helpers** (``bp_mech.book``) and the **exercise checks** (``bp_mech.checks``,
   ``bp-mech check``); ``cli`` ties them together.
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
