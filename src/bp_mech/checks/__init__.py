"""Exercise checks, one module per chapter. ``CHAPTERS`` maps each to its marker and file."""

import importlib

# (pytest marker, checks module under bp_mech.checks, exercise file name without .py); a module is imported when
# its chapter is checked (``module``): a page that checks one chapter does not import the other twelve's references
CHAPTERS = [
    ("ch09", "ex09", "ex09_local_backward"),
    ("ch10", "ex10", "ex10_attention_backward"),
    ("ch11", "ex11", "ex11_gradient_accumulation"),
    ("ch12", "ex12", "ex12_scheduler_clock"),
    ("amp", "ex_amp", "ex_amp_backward"),
    ("ch19", "ex19", "ex19_checkpointing"),
    ("ch42", "ex42", "ex42_offload"),
    ("ch43", "ex43", "ex43_state_ledger"),
    ("ch55", "ex55", "ex55_update_dynamics"),
    ("ch56", "ex56", "ex56_continual_pretrain"),
    ("ch73", "ex73", "ex73_baseline"),
    ("ch74", "ex74", "ex74_profiling"),
    ("ch76", "ex76", "ex76_memory_strategy"),
]


def module(name: str):
    """The checks module ``bp_mech.checks.<name>`` (``CHAPTERS``' second column), imported on first use."""
    return importlib.import_module(f"bp_mech.checks.{name}")


def cases():
    """One pytest param per (exercise file, check), marked with its chapter."""
    import pytest

    for marker, mod, name in CHAPTERS:
        for check in module(mod).CHECKS:
            yield pytest.param(name, check, marks=getattr(pytest.mark, marker), id=f"{name}::{check.__name__}")
