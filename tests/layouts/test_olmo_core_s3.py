"""OLMo-core's own Trainer saving its checkpoints to s3:// (its remote writer, pointed at a moto server on localhost
by AWS_ENDPOINT_URL), pmakit merging them there into s3://, and OLMo-core's Trainer loading the merge back from
s3:// and training a step from it."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from layouts.conftest import HERE, run_framework
from s3server import download_tree

olmo_ckpt = pytest.importorskip("olmo_core.distributed.checkpoint")


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    metadata = olmo_ckpt.get_checkpoint_metadata(checkpoint / "model_and_optim")
    keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    return {
        k.removeprefix("model."): v
        for k, v in zip(keys, olmo_ckpt.load_keys(checkpoint / "model_and_optim", keys))
    }


def test_olmo_core_saves_to_s3_pmakit_merges_there_and_olmo_core_loads_it(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"olmo-{uuid.uuid4().hex[:8]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    for k, v in {**s3_server.env(), "PMAKIT_STAGING": str(tmp_path / "staging")}.items():
        monkeypatch.setenv(k, v)
    # OLMo-core refuses to clear a folder near the bucket root (save_overwrite): a deeper prefix, as in real use
    run, merged = f"s3://{bucket}/team/olmo/run", f"s3://{bucket}/team/olmo/merged"
    dump = tmp_path / "loaded.pt"
    run_framework(
        HERE / "olmo_core_run.py",
        *("train-to", tmp_path / "work", run, 3, "+"),
        *("cli", "merge", run, "-o", merged, "--last", "2", "-q", "+"),
        *("pma-init", merged, tmp_path / "cont" / "save", dump),
    )
    keys = {
        o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="team/olmo/run/").get("Contents", [])
    }
    assert any(k.startswith("team/olmo/run/step3/model_and_optim/") and k.endswith(".distcp") for k in keys)

    # The merge is the average of the last two checkpoints, read by OLMo-core's own reader ...
    for step in (2, 3):
        download_tree(client, bucket, f"team/olmo/run/step{step}", tmp_path / f"step{step}")
    download_tree(client, bucket, "team/olmo/merged", tmp_path / "merged")
    want = [model_weights(tmp_path / f"step{s}") for s in (2, 3)]
    got = model_weights(tmp_path / "merged")
    assert got.keys() == want[0].keys()
    for name, value in got.items():
        torch.testing.assert_close(
            value.float(), (want[0][name].float() + want[1][name].float()) / 2, msg=name
        )
    # ... and OLMo-core's Trainer loaded exactly it from s3:// (then trained a step)
    loaded = torch.load(dump, weights_only=True)
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
