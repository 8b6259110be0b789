"""Run as a script: warm the kernels for a config, train it, print (JSON) the Numba
dispatchers that compiled a signature during training, and those the warm-up compiled."""

import json
import sys
from pathlib import Path

import numba.core.registry  # noqa: F401
from numba.core.dispatcher import Dispatcher

from neorec.trainer.config import TrainConfig
from neorec.trainer.run.train import train
from neorec.trainer.run.warmup import compile_kernels


def signatures() -> dict[str, int]:
    """Every Numba dispatcher of neorec's modules: its compiled signatures' count."""
    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("neorec.") or module is None:
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, Dispatcher):
                found[f"{value.py_func.__module__}.{value.py_func.__qualname__}"] = len(value.signatures)
    return found


if __name__ == "__main__":
    config = TrainConfig.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    compile_kernels(config)
    warmed = signatures()
    train(config)
    trained = signatures()
    print(json.dumps({"warmed": {k: v for k, v in warmed.items() if v},
                      "compiled_in_training": sorted(k for k, v in trained.items() if v > warmed.get(k, 0))}))
