"""A small real network for the GPU worker tests and the pool bench: a PyTorch MLP, kept warm.

As a warm runner (``GPUHEDGE_RUNNER=python:tests.support.tiny_model:TinyModel``): ``load()``
imports torch and builds the network with fixed weights (seeded) on CUDA when the child has a
GPU, else on the CPU; ``run(request, ctx)`` runs ``steps`` forward passes through it, checking
``ctx`` between steps (``step_s`` seconds of sleep per step stands in for a longer model), and
returns the output with the process id, which load of the model served it and ``compute_s``
(the forward passes' own time, for the bench). As a command (``cmd:python
tests/support/tiny_model.py``) it does the same for one request per process: a cold start.

Test hooks (environment): ``TINY_MODEL_LOG=FILE`` appends one JSON line per load and per step;
``TINY_MODEL_FAIL=FILE``: while that file exists, ``load()`` raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

WIDTH = 64
SEED = 1234


def _log(event: str, **fields: Any) -> None:
    path = os.environ.get("TINY_MODEL_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            entry = {"event": event, "pid": os.getpid(), "t": time.time(), **fields}
            f.write(json.dumps(entry) + "\n")


class TinyModel:
    """A 3-layer MLP: ``x`` (up to WIDTH floats) -> WIDTH hidden -> WIDTH hidden -> 4 outputs."""

    loads = 0  # per process: how many times a model was loaded here

    def __init__(self) -> None:
        self.net = None
        self.device = "cpu"

    def load(self) -> None:
        fail = os.environ.get("TINY_MODEL_FAIL")
        if fail and os.path.exists(fail):
            raise RuntimeError(f"weights unreadable ({fail} exists)")
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(SEED)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.net = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.ReLU(),
            torch.nn.Linear(WIDTH, WIDTH),
            torch.nn.ReLU(),
            torch.nn.Linear(WIDTH, 4),
        ).to(self.device)
        self.net.eval()
        TinyModel.loads += 1
        self.load_id = f"{os.getpid()}-{TinyModel.loads}"
        _log("load", load=self.load_id, device=self.device)

    def run(self, request: dict[str, Any], ctx: Any = None) -> dict[str, Any]:
        import torch

        x = [float(v) for v in (request.get("x") or [1.0])][:WIDTH]
        steps = int(request.get("steps", 1))
        step_s = float(request.get("step_s", 0.0))
        vector = torch.zeros(1, WIDTH, device=self.device)
        vector[0, : len(x)] = torch.tensor(x, device=self.device)
        compute_s = 0.0
        out = None
        for step in range(steps):
            if ctx is not None:
                ctx.check()  # stop between steps once the lease is lost
            started = time.perf_counter()
            with torch.no_grad():
                out = self.net(vector)
            if self.device == "cuda":
                torch.cuda.synchronize()
            compute_s += time.perf_counter() - started
            if request.get("log_steps"):
                _log("step", step=step + 1, of=steps, id=request.get("id"))
            if step_s:
                time.sleep(step_s)
        return {
            "y": [round(v, 6) for v in out[0].tolist()],
            "id": request.get("id"),
            "pid": os.getpid(),
            "load": self.load_id,
            "device": self.device,
            "steps": steps,
            "compute_s": compute_s,
        }

    def close(self) -> None:
        _log("close", load=getattr(self, "load_id", None))
        self.net = None


def main() -> int:
    """The ``cmd:`` runner protocol: one request (JSON on stdin), a cold start per request."""
    request = json.load(sys.stdin)
    model = TinyModel()
    model.load()
    json.dump(model.run(request), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
