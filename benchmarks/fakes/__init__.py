"""Loopback fakes of the providers' APIs, each a real HTTP server in a process of its own.

They come with a source checkout only: the tests and ``gpuhedge-celery bench races --provider
runpod-fake`` (and its ``truth`` row) run them; the installed package never imports them.
"""

import os

# The checkout's root: a fake's process runs ``python -m benchmarks.fakes.<name>`` from here.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env() -> dict[str, str]:
    """This process's environment with the checkout's root first on ``PYTHONPATH``."""
    path = [ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
