import sys

from bp_mech.cli import main

sys.exit(main())
