"""One module per experiment of the book (its candidates, dry run, decision rule and records), all on
``harness``; the mechanisms they measure live one level up, in ``bp_mech.<mechanism>``."""
