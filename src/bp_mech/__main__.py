"""``python -m bp_mech``: the command line (``bp_mech.cli``)."""

from bp_mech.cli import entry

if __name__ == "__main__":
    entry()
