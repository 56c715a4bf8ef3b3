"""The tensor-parallel generator's shards (`tp_region`) against the generic mesh layout the DDMA planner uses, without processes."""

from __future__ import annotations

import pytest

from graphrl.schemas.sharding import Mesh, llama_params, shard_bounds, tp_region
from graphrl.schemas.model import ModelDims

# Vocabulary and SwiGLU width that split unevenly over 4 ranks.
DIMS = ModelDims(vocab_size=30, hidden_size=64, intermediate_size=90, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("dims", [DIMS, DIMS.model_copy(update={"tie_embeddings": True})], ids=["untied", "tied"])
def test_executor_shards_are_the_plans_regions(t: int, dims: ModelDims) -> None:
    """The generator's shards must be the regions the DDMA planner computes from the mesh layout
    (`shard_bounds`), or the weight sync writes into the wrong place."""
    mesh = Mesh.contiguous([("dp", 2), ("tp", t)])
    for rank in range(t):
        for p in llama_params(dims):
            assert tp_region(p.name, p.shape, rank, t) == shard_bounds(p, mesh, rank), (p.name, rank)
