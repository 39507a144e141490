"""``python -m bp_mech``: the command line (``bp_mech.cli``)."""

import sys

from bp_mech.cli import main

if __name__ == "__main__":
    sys.exit(main())
