import filecmp
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    protos = sorted((ROOT / "protos").glob("*.proto"))
    assert protos
    (tmp_path / "protos").mkdir()
    for proto in protos:
        shutil.copy(proto, tmp_path / "protos" / proto.name)
    args = ["protoc", "-I", str(tmp_path), f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    assert protoc.main(args + [f"protos/{p.name}" for p in protos]) == 0
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            name = proto.stem + suffix
            assert filecmp.cmp(tmp_path / "protos" / name, ROOT / "protos" / name, shallow=False), (
                f"protos/{name} is stale: regenerate with "
                f"{sys.executable} -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. protos/*.proto"
            )
