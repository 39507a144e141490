"""``planner.shard_tracking``: on one process, FSDP's storage resizes (freed, born again with its class and
kind) and the collectives' buffers named by kind, with a one-rank gloo group; bytes by hand. Every rank of a
real sharded step against the fake plan: ``tests/planner/test_shard.py``."""

import pytest
import torch
import torch.distributed as dist

from bp_mech.planner.shard_tracking import ShardTracker


@pytest.fixture(scope="module")
def one_rank():
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


def test_a_resized_storage_dies_and_is_born_again_with_its_class():
    resize = torch.UntypedStorage.resize_
    tr = ShardTracker()
    with tr:
        t = torch.empty(256)  # 1024 B
        tr.relabel(t, "parameters")
        sizes = [tr.current]
        t.untyped_storage().resize_(512)
        sizes.append(tr.current)
        label = tr.label[tr.serial.get(t.untyped_storage())]
        t.untyped_storage().resize_(0)  # what FSDP does to free an unsharded parameter
        sizes.append(tr.current)
        t.untyped_storage().resize_(2048)  # and to gather it again (split_with_sizes_copy then names it)
        sizes.append(tr.current)
    assert sizes == [1024, 512, 0, 2048] and tr.peak == 2048
    assert label == "parameters"
    assert torch.UntypedStorage.resize_ is resize  # unpatched after the block


def test_the_collectives_buffers_and_the_sharded_gradients_are_named(one_rank):
    tr = ShardTracker()
    with tr:
        shard = torch.ones(64)  # 256 B
        gathered = torch.empty(64)
        dist.all_gather_into_tensor(gathered, shard)
        grads = torch.empty(64)
        dist.reduce_scatter_tensor(grads, gathered)
        kinds = tr.kinds(list(tr.live))
        labels = {n: tr.label[tr.serial.get(x.untyped_storage())] for n, x in (("gathered", gathered), ("grads", grads))}
    assert kinds == {"gathered": 0, "collective": 256}  # the all-gather's output (and reduce-scatter's input)
    assert labels == {"gathered": "other", "grads": "gradients"}
    assert tr.most["collective"] == 256 and torch.equal(grads, torch.ones(64))
