"""The instruments: what every layer measures with, below the mechanisms they observe.

``workload`` (the model, the text, the batches, the one AdamW factory), ``anatomy`` (a model's decoder
blocks, attention, MLP and output head, found from the model itself), ``counters`` (forward calls, saved
tensors) and ``tracking`` (the storage tracker and ``PeakMemory``: live bytes by class, the peak).

An instrument imports no other layer of the package: a mechanism may be measured with it, and the
instrument observes the mechanism (hooks, dispatch modes), never the other way round.
"""
