"""The measuring bench: the one training step and what runs it.

Read in this order: ``strategy`` (a memory strategy by name, applied to a model), ``optimizer`` (which
optimizer a step runs, ``StepOptions``), ``step`` (the one training step, its phases and observers,
``probe``), ``timing`` (step times after warm-up, interleaved, the noise rule), ``compare`` (relative
errors, tolerances), ``oom`` (an allocation failure as a ``Failed`` arm), ``rates`` (the assumed rates dry
runs estimate from).

The bench imports the mechanisms (``bp_mech.<mechanism>``) and the instruments, nothing above them.
"""
