"""The dynamic tables' counters in the trainer's Status, as ``neorec status`` reads them."""

from __future__ import annotations

from neorec.common.transport import ClientSecurity
from neorec.orchestration.status import SERVING, probe
from neorec.orchestration.trainer_status import TrainerStatusServer
from neorec.trainer.run.step import StepReport


def test_status_shows_each_dynamic_tables_counters() -> None:
    server = TrainerStatusServer("127.0.0.1", 0, world_size=1)
    server.start()
    try:
        counts = {"t_C1": {"admitted": 7, "rejected": 3, "evicted": 2, "live": 5},
                  "t_C2": {"admitted": 1, "rejected": 0, "evicted": 0, "live": 1}}
        server.update(StepReport(global_step=4, epoch=0, loss=0.5, qps=10.0, total_steps=8, dynamic=counts))
        result = probe(server.address, ClientSecurity(), timeout=10.0, with_status=True)
    finally:
        server.stop()
    assert result.code == SERVING and result.role == "trainer"
    assert result.status["step"] == "4"
    assert {table: {k: int(v) for k, v in c.items()} for table, c in result.status["dynamic"].items()} == counts
