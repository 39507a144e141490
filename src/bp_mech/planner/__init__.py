"""Part 02 · 43's ledger of one step, real or under fake tensors, and ``bp-mech plan`` on top of it.

The traced step, read in this order: ``build`` (a workload's or any config's model, real or fake, in its
fine-tuning mode: ``finetune``), ``definitions`` (what "a step" means: steady, first, forward-backward,
outputs kept, weights' dtype), ``fake_ops`` (what a fake step needs that PyTorch's fake tensors lack),
``cuda_autocast`` (CUDA's autocast op lists, so a fake CPU step follows a GPU run), ``lifecycle`` (the
``Session``: one model and its optimizer, and the ledger of any strategy's step), ``shard_tracking`` and
``shard`` (one rank under FSDP2 or DDP), ``trace`` (the strategies traced in forked workers: ``pool``,
the planner's one pool of forked processes that inherit the fake session).

``bp-mech plan``: ``inputs`` (sizes, configs and shapes read and checked; ``PlanError``), ``request`` (the
command's flags as one checked ``PlanRequest``), ``costs`` (FLOPs and the time factors measured in cached
records), ``plan`` (one traced step per strategy: ``Plan`` and its ``PlanRow``s, the fit rule
``needs``/``headroom``), ``fit`` (the largest batch or sequence that fits),
``estimators`` (other estimators, beside it), ``report`` (the table, in the unit the model needs), ``ask``
(``--ask``: the next questions answered in the same process), ``sweep`` (every model type Transformers
builds). ``reference_gap``: the course's reference figures traced under each step definition.

The planner sits above the records (its time factors are read from them) and below the experiments.
"""
