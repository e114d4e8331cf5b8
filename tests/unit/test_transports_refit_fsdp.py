"""Refit of a torch FSDP2 (DTensor) model sharded over 2 gloo ranks: gathered, equal to HF."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.light_lane]


_free_port = free_port


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from transports.refit.maps import IdentityMap
    from transports.refit.plan import RefitPlan
    from transports.staging import materialize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    try:
        model = _tiny_model()
        reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        sharded = sum(type(v).__name__ == "DTensor" for v in state.values())
        meta = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}  # DTensor: global shape
        plan = RefitPlan.build(meta, IdentityMap(), wire_dtype=None, bucket_bytes=32 << 10)
        # Every rank iterates the plan (full_tensor() is a collective); rank 0 is the sender.
        got = materialize(plan, state)
        if rank == 0:
            torch.save({"got": got, "reference": reference, "sharded": sharded}, os.path.join(out_dir, "result.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_model_is_gathered_equal_to_the_unsharded_weights(tmp_path):
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "result.pt")
    assert result["sharded"] > 10  # the state dict really held DTensors
    got, reference = result["got"], result["reference"]
    assert set(got) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(got[name], tensor), name
