import filecmp
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    protos = sorted((ROOT / "protos").glob("*.proto"))
    assert protos
    # Generated as neorec/protos/*.proto, so that the stubs import each other as neorec.protos.
    generated = tmp_path / "neorec" / "protos"
    generated.mkdir(parents=True)
    for proto in protos:
        shutil.copy(proto, generated / proto.name)
    args = ["protoc", "-I", str(tmp_path), f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    assert protoc.main(args + [f"neorec/protos/{p.name}" for p in protos]) == 0
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            name = proto.stem + suffix
            assert filecmp.cmp(generated / name, ROOT / "protos" / name, shallow=False), (
                f"protos/{name} is stale: regenerate with  mkdir -p /tmp/g/neorec/protos && "
                f"cp protos/*.proto /tmp/g/neorec/protos && {sys.executable} -m grpc_tools.protoc -I /tmp/g "
                f"--python_out=/tmp/g --grpc_python_out=/tmp/g /tmp/g/neorec/protos/*.proto && "
                f"cp /tmp/g/neorec/protos/*_pb2*.py protos/"
            )
