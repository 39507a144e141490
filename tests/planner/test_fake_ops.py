"""``planner.fake_ops.plain_key``: the fake dispatch cache's keys with the shortcut are the keys without it, for
every operator of a traced training step (forward, backward, AdamW, under checkpointing and autocast), and
the shortcut is taken; a shortcut that writes anything else, for plain values or for a tensor, is caught."""

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from bp_mech.planner import fake_ops, lifecycle
from bp_mech.bench import strategy as S
from bp_mech.bench.optimizer import StepOptions
from bp_mech.instruments.workload import parse_workload

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread


def _compared(fast, original, seen: dict):
    """A key builder that builds each key both ways and checks they are equal (``seen``: calls, shortcuts)."""
    def prep(mode, result, args, state, id_hashed_objects):
        mine, theirs = [], []
        fast(mode, mine, args, state, [])
        original(mode, theirs, args, state, id_hashed_objects)
        seen["calls"] += 1
        seen["plain"] += fake_ops.all_plain(args)
        assert mine == theirs, (args, mine, theirs)
        result.extend(theirs)
    return prep


def _trace_comparing(fast, monkeypatch) -> dict:
    seen = dict(calls=0, plain=0)
    original = FakeTensorMode._prep_args_for_hash
    session = lifecycle.Session(parse_workload("tiny-b2s32"), fake=True, options=StepOptions().for_device("cuda"))
    # installed after the session's own patch (entered per step) would replace it: put ours underneath
    monkeypatch.setattr(fake_ops, "plain_key", lambda prep: _compared(fast(prep), original, seen))
    for name in ("plain", "checkpoint-all+fp16+chunked-loss"):
        session.ledger(S.parse(name))
    return seen


def test_the_keys_with_the_shortcut_are_the_keys_without_it(monkeypatch):
    seen = _trace_comparing(fake_ops.plain_key, monkeypatch)
    assert seen["calls"] > 1000 and seen["plain"] > seen["calls"] // 4  # (shapes and strides: most calls)


@pytest.mark.parametrize("mistake", ["no length", "no types"])
def test_a_shortcut_that_writes_another_key_is_caught(monkeypatch, mistake):
    def wrong(prep):
        def prep_args_for_hash(mode, result, args, state, ids):
            if fake_ops.all_plain(args):
                result.append(type(args))
                if mistake != "no length":
                    result.append(f"length_{len(args)}")
                for a in args:
                    if mistake != "no types":
                        result.append(type(a))
                    result.append(a)
                return None
            return prep(mode, result, args, state, ids)
        return prep_args_for_hash

    with pytest.raises(AssertionError):
        _trace_comparing(wrong, monkeypatch)


@pytest.mark.parametrize("mistake", ["contiguous always", "no storage bytes", "offset typed"])
def test_a_tensor_written_otherwise_is_caught(monkeypatch, mistake):
    import torch

    write = fake_ops._write_tensor

    def wrong(result, t):  # the tail: device, layout, memory format, offset, storage bytes, then nine flags
        write(result, t)
        if mistake == "contiguous always":
            result[-12] = torch.contiguous_format
        elif mistake == "no storage bytes":
            del result[-10]
        else:
            result.insert(-11, int)
    monkeypatch.setattr(fake_ops, "_write_tensor", wrong)
    with pytest.raises(AssertionError):
        _trace_comparing(fake_ops.plain_key, monkeypatch)


def test_a_pytorch_whose_metadata_has_other_fields_keys_tensors_its_own_way(monkeypatch):
    assert fake_ops._writes_tensors()  # (this PyTorch: the shortcut writes tensors)
    monkeypatch.setattr(fake_ops, "FIELDS", fake_ops.FIELDS[:-1])
    assert not fake_ops._writes_tensors()
    monkeypatch.setattr(fake_ops, "_write_tensor", lambda result, t: result.append("wrong"))
    seen = _trace_comparing(fake_ops.plain_key, monkeypatch)  # (the wrong writer is never called: prep writes them)
    assert seen["calls"] > 1000
