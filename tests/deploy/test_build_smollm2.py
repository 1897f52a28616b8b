"""The AR's checkpoint `make checkpoints` builds comes in shards: vLLM keeps a safetensors file mapped until
its last tensor is loaded, so one shard at a time is resident beside the weights, not the whole checkpoint."""

from __future__ import annotations

import json

from safetensors import safe_open

from deploy.checkpoints.build_smollm2 import SHARD_BYTES
from services.checkpoints import AR_MODEL, default_model_dir


def test_the_ar_checkpoint_is_in_shards_each_within_the_shard_size_or_one_tensor():
    directory = default_model_dir(AR_MODEL)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert not (directory / "model.safetensors").exists()
    for shard in shards:
        with safe_open(str(directory / shard), "pt") as f:
            tensors = len(list(f.keys()))
        assert (directory / shard).stat().st_size <= SHARD_BYTES or tensors == 1, (shard, tensors)
