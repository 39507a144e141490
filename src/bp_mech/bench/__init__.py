"""The measuring bench: what every experiment, the planner and the projects measure with.

Read in this order: ``workload`` (the model, the text, the batches), ``strategy`` (a memory strategy
by name, applied to a model), ``step`` (the one training step, its phases and observers, ``probe``),
``timing`` (step times after warm-up, interleaved, the noise rule), ``tracking`` (peak memory:
the CUDA allocator or tracked CPU storages), ``counters`` (forward calls, saved tensors), ``compare``
(relative errors, tolerances), ``oom`` (an allocation failure as a ``Failed`` arm), ``lifecycle``
(Part 02 · 43's ledger of one step), ``rates`` (the assumed rates dry runs estimate from).

The bench imports the mechanisms (``bp_mech.<mechanism>``) and nothing above it.
"""
