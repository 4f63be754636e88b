"""gpuhedge-celery: Celery-native GPU inference scheduling on Redis.

Importing the package is cheap and imports neither Celery nor Redis; ``app`` (the Celery app,
for ``celery -A gpuhedge_celery``) and the public tasks load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    # the app with every task module loaded (its control commands included, for `celery -A
    # gpuhedge_celery control ...`)
    "app": ("gpuhedge_celery.tasks.app", "load_tasks"),
    "celery": ("gpuhedge_celery.tasks.app", "load_tasks"),
    "pooled_infer": ("gpuhedge_celery.tasks.pool", "pooled_infer"),
    "hedged_infer": ("gpuhedge_celery.tasks.races", "hedged_infer"),
    "RaceResult": ("gpuhedge_celery.tasks.result", "RaceResult"),
    "PooledResult": ("gpuhedge_celery.tasks.pooled_result", "PooledResult"),
    "send_pooled": ("gpuhedge_celery.tasks.pooled_result", "send_pooled"),
    "receipt": ("gpuhedge_celery.race", "receipt"),
    "cancel_race": ("gpuhedge_celery.tasks.stop", "cancel_race"),
    "load_payload": ("gpuhedge_celery.race", "load_payload"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'gpuhedge_celery' has no attribute {name!r}")
    module = importlib.import_module(target[0])
    found = getattr(module, target[1])
    return found() if target[1] == "load_tasks" else found
