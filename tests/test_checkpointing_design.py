"""Part 02 · 19: the checkpointing the package measures is ``torch.utils.checkpoint``'s
non-reentrant design (saved-tensor hooks, recompute on unpack), as the chapter says, on the
real call: every checkpointed region of a step goes through the non-reentrant generator and no
reentrant ``CheckpointFunctionBackward`` node enters the graph. The from-scratch block is the
reentrant design (its own ``autograd.Function``)."""

import pytest
import torch
import torch.utils.checkpoint as tuc

from bp_mech import checkpointing


def _graph_names(t):
    seen, stack, names = set(), [t.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("candidate", ["checkpoint-all", "checkpoint-every2", "checkpoint-mlp"])
def test_the_measured_checkpointing_is_non_reentrant(tiny, candidate, monkeypatch):
    model, batches = tiny
    real, calls = tuc._checkpoint_without_reentrant_generator, []

    def spy(*a, **k):  # torch.utils.checkpoint calls it only for use_reentrant=False
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(tuc, "_checkpoint_without_reentrant_generator", spy)
    monkeypatch.setattr(tuc.CheckpointFunction, "apply", None)  # reentrant: would fail
    L = len(model.model.layers)
    expected = {"checkpoint-all": L, "checkpoint-every2": (L + 1) // 2, "checkpoint-mlp": L}
    model.train()
    with checkpointing.configure(model, candidate) as m:
        if candidate != "checkpoint-mlp":  # Transformers' partial carries our keyword
            fns = [layer._gradient_checkpointing_func for layer in m.model.layers]
            assert all(f.keywords["use_reentrant"] is False for f in fns)
        loss = m(**batches[0]).loss
        names = _graph_names(loss)
        loss.backward()
    assert len(calls) == expected[candidate]
    assert not any(n.startswith("CheckpointFunction") for n in names)
    model.zero_grad(set_to_none=True)


def test_the_from_scratch_block_is_the_reentrant_design():
    block = checkpointing.CheckpointedBlock(torch.nn.Linear(4, 4))
    y = block(torch.randn(2, 4, requires_grad=True))
    assert y.grad_fn.name() == "CheckpointFunctionBackward"
