"""A reader service confined to ``--data-root`` never reads a file outside it: a
``dataset.json`` inside the root that names a file outside (an absolute path, ``../``
components, a symlink inside the root pointing out) is refused with PERMISSION_DENIED
naming the file, on a real server."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest

from neorec.ingest.client import RemoteReader
from neorec.ingest.decoder import DecodeOptions
from neorec.ingest.reader import ReaderConfig
from neorec.ingest.schema import Dataset
from neorec.ingest.service import ReaderServer
from neorec.protos import ingest_pb2_grpc


def _crafted(criteo_dataset: Dataset, tmp_path, how: str) -> tuple[Dataset, str]:
    """A dataset inside ``tmp_path/root`` whose first train file lies outside the root,
    named as ``how`` says; returns it and the name it gives that file."""
    outside = tmp_path / "outside"
    outside.mkdir()
    first = criteo_dataset.splits["train"][0]
    secret = outside / first
    shutil.copyfile(criteo_dataset.root / first, secret)
    crafted = tmp_path / "root" / "crafted"
    crafted.mkdir(parents=True)
    for name in criteo_dataset.splits["train"][1:]:
        shutil.copyfile(criteo_dataset.root / name, crafted / name)
    if how == "absolute":
        named = str(secret)
    elif how == "dotdot":
        named = f"../../outside/{first}"
    else:
        named = "link.parquet"
        (crafted / named).symlink_to(secret)
    description = json.loads((criteo_dataset.root / "dataset.json").read_text())
    description["splits"] = {"train": [named, *criteo_dataset.splits["train"][1:]]}
    (crafted / "dataset.json").write_text(json.dumps(description))
    return Dataset.load(crafted), named


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_dataset_naming_files_outside_the_root_is_refused(criteo_dataset, tmp_path, how):
    dataset, named = _crafted(criteo_dataset, tmp_path, how)
    server = ReaderServer(threads=2, data_roots=[tmp_path / "root"])
    server.start()
    try:
        options = DecodeOptions.for_schema(dataset.schema)
        reader = RemoteReader(dataset, "train", options, ReaderConfig(batch_size=100), ["127.0.0.1:1"])
        request = reader.request_for(reader.plan(0).tasks(3)[0])[0]
        reader.close()
        with grpc.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                list(ingest_pb2_grpc.ReaderStub(channel).Read(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
        assert repr(named) in info.value.details() and "outside this service's data roots" in info.value.details()
    finally:
        server.stop(grace_s=0.5)
