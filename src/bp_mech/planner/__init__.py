"""``bp-mech plan``: which memory strategies fit a budget, for any Transformers config.

``inputs`` (sizes, configs and shapes read and checked; ``PlanError``), ``costs`` (FLOPs and the time
factors measured in cached records), ``plan`` (one fake-tensor step per strategy: ``Plan`` and its
``PlanRow``s, the fit rule ``needs``/``headroom``), ``report`` (the table, in the unit the model needs).
"""
