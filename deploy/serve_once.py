#!/usr/bin/env python3
"""The model command the GPU workers in deploy/ run, one process per request.

    GPUHEDGE_RUNNER='cmd:python3 /opt/gpuhedge/serve_once.py'   (deploy/Dockerfile installs it)

It speaks the ``cmd:`` runner protocol of gpuhedge_celery/runners.py: the request as JSON on
stdin, the result as JSON on stdout, a non-zero exit with one line on stderr for a failure, and
SIGTERM when the worker loses the GPU's lease. This one answers with the request, the GPU the
worker pinned it to (``CUDA_VISIBLE_DEVICES``) and the host, so a fresh deployment serves real
jobs end to end. Put your model's entry point in its place (same protocol), or point
``GPUHEDGE_RUNNER`` at ``python:your.module:infer`` to run a function inside the worker.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def main() -> int:
    started = time.monotonic()
    try:
        request = json.load(sys.stdin)
    except ValueError as e:
        print(f"serve_once: the request on stdin is not JSON: {e}", file=sys.stderr)
        return 2
    # Here a model would run `request` on the GPU (CUDA_VISIBLE_DEVICES is its one GPU).
    result = {
        "echo": request,
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "host": socket.gethostname(),
        "run_s": round(time.monotonic() - started, 6),
    }
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
