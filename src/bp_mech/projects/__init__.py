"""Project pages of Part 02: they combine the mechanisms (73 baseline, 74 profiling, 76 memory strategy)."""
