"""``bp-mech plan`` over every causal LM Transformers builds: planned, refused (one line), or crashed.

Each model type of Transformers' causal-LM mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) at its default
config cut to two layers (``two_layers``), planned at batch 1 x seq 64 with one strategy of each mechanism
(``SWEEP``). The outcome of each: ``planned`` (with the strategies left out and why), ``refused`` (the
plan's one-line ``PlanError``: a default config Transformers itself cannot build, an operation fake tensors
cannot run, ...), ``no-config`` (``AutoConfig.for_model`` fails on the defaults) or ``crashed`` (anything
else: a bug). ``python -m bp_mech.planner.sweep`` prints the counts and every line that is not ``planned``;
tests/planner/test_sweep.py asserts that nothing crashed.
"""

from __future__ import annotations

import collections
import functools
import sys
import time

from bp_mech.bench.strategy import PLAIN, parse
from bp_mech.bench.optimizer import StepOptions
from bp_mech.planner.inputs import PlanError
from bp_mech.planner.pool import default_workers, forked_map

# every mechanism in two traces besides plain's (the combination, and the one checkpointing it lacks)
SWEEP = (PLAIN, parse("checkpoint-all+offload+fp16+chunked-loss"), parse("checkpoint-mlp"))
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "decoder_layers")  # what configs call the depth


def model_types() -> list[str]:
    """Every model type of Transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def two_layers(config):
    """``config`` (and its text config) cut to two layers, per-layer lists (``layer_types``) cut with it."""
    for c in {id(x): x for x in (config, config.get_text_config())}.values():
        for field in LAYER_FIELDS:
            if isinstance(getattr(c, field, None), int):
                setattr(c, field, 2)
        kinds = getattr(c, "layer_types", None)
        if isinstance(kinds, list) and len(kinds) > 2:
            c.layer_types = kinds[:2]
    return config


def outcome(model_type: str, candidates=SWEEP, batch: int = 1, seq: int = 64) -> tuple[str, str]:
    """(``planned`` | ``refused`` | ``no-config`` | ``crashed``, detail) of one model type."""
    from transformers import AutoConfig

    from bp_mech.planner.plan import plan
    from bp_mech.planner.trace import one_line

    try:
        config = two_layers(AutoConfig.for_model(model_type))
    except Exception as e:  # noqa: BLE001 (a config class whose defaults do not validate)
        return "no-config", one_line(e)
    try:
        p = plan(config, batch, seq, 2**50, options=StepOptions().for_device("cuda"), candidates=candidates)
    except PlanError as e:
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 (what the sweep is there to find)
        return "crashed", one_line(e)
    left = "; ".join(f"{k}: {v}" for k, v in p.skipped.items())
    return "planned", f"{len(p.rows)} strategies, {p.model['attention']} attention" + (f"; left out {left}" if left else "")


def sweep(types=None, candidates=SWEEP, workers: int = 1) -> dict[str, tuple[str, str]]:
    """``outcome`` of each model type.

    Args:
        types: model types (None: ``model_types()``).
        candidates: the strategies each plan traces.
        workers: forked processes (``planner.pool.forked_map``, each replaced by a fresh fork after 20
            model types); 1: this process.

    Returns:
        {model type: (kind, detail)}, in the order of ``types``.
    """
    todo = list(types or model_types())
    one = functools.partial(outcome, candidates=candidates)
    return dict(zip(todo, forked_map(one, todo, workers, max_tasks_per_child=20)))


def main(argv=None) -> int:
    t0 = time.perf_counter()
    result = sweep(argv or None, workers=default_workers())
    counts = collections.Counter(kind for kind, _ in result.values())
    for t, (kind, detail) in result.items():
        if kind != "planned" or "left out" in detail:
            print(f"{t}: {kind}: {detail}")
    print(f"{len(result)} model types in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{counts[k]} {k}" for k in ("planned", "refused", "no-config", "crashed")))
    return 1 if counts["crashed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
