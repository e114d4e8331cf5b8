"""transports/refit/gather.py without a second rank: the row split every rank computes alone
matches DTensor's own, and the sending rank's mapping refuses a read out of plan order (which
would pair a shard with the wrong tensor) and names it."""

from __future__ import annotations

import pytest
import torch

from transports.errors import TransportError
from transports.refit.gather import _rows


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 64, 97])
def test_the_row_split_is_dtensors_shard_split(n, world):
    from torch.distributed.tensor import Shard

    spans = [_rows(n, world, r) for r in range(world)]
    for r, (start, count) in enumerate(spans):
        size, offset = Shard.local_shard_size_and_offset(n, world, r)
        assert count == size
        if count:
            assert start == offset
    assert sum(count for _, count in spans) == n
    covered = [i for start, count in spans for i in range(start, start + count)]
    assert covered == list(range(n))


@pytest.mark.timeout(60)
def test_the_root_mapping_gathers_in_plan_order_and_refuses_any_other(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from transports.refit.gather import GatheredStateDict
    from transports.refit.plan import RefitPlan

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        state = model.state_dict()
        assert all(type(v).__name__ == "DTensor" for v in state.values())
        plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, wire_dtype=None,
                               bucket_bytes=256)
        gathered = GatheredStateDict(state, plan)
        with pytest.raises(TransportError, match=r"'1.weight' read out of the gather order: expected '0.weight'"):
            gathered["1.weight"]
        gathered = GatheredStateDict(state, plan)
        got = {}
        for bucket in plan.by_bucket:
            for entry in bucket:
                got[entry.source] = gathered[entry.source].clone()
                assert gathered[entry.source].data_ptr() == gathered[entry.source].data_ptr()  # read again: the same
        assert gathered.complete and got.keys() == reference.keys()
        assert all(torch.equal(got[k], v) for k, v in reference.items())
        assert gathered.peak_bytes == max(v.numel() * 4 for v in reference.values())  # one at a time
        with pytest.raises(TransportError, match="nothing"):
            gathered["0.weight"]
        # RefitPlan.pack reads it once, in order (it must not index every entry up front: that
        # would gather them all, then read out of order), and packs the unsharded weights.
        from transports.staging import materialize

        assert plan.bucket_count > 1
        unpacked = materialize(plan, GatheredStateDict(state, plan))
        assert all(torch.equal(unpacked[k], v) for k, v in reference.items())
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_publish_that_does_not_gather_every_shard_is_refused(tmp_path):
    """The other ranks send a shard of every DTensor: a publish on the root that read fewer
    would leave sends pending, to be received as the next publish's (other) tensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orchestrator.config.run import TransportConfig
    from orchestrator.trainer.publish import Publisher

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        # world=2: the root's path (GatheredStateDict), over a group of one.
        publisher = Publisher(model, tmp_path / "run", TransportConfig(), version=0, bucket_bytes=256, rank=0, world=2)
        try:
            publisher.publish(1)
            assert publisher.is_complete(1) and publisher.memory.gathered_peak_bytes > 0

            def partial(version: int) -> None:  # a synchronizer that stops after the first tensor
                gathered = publisher._gathered()
                gathered[publisher.plan.by_bucket[0][0].source]

            publisher._write = partial
            with pytest.raises(RuntimeError, match=r"publish of version 2: .*\[\(1, 4\)\]"):
                publisher.publish(2)
            assert not publisher._gathers  # the partial gather is dropped, not carried into the next publish
        finally:
            publisher.close()
    finally:
        dist.destroy_process_group()
