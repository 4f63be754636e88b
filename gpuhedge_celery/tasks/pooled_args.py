"""``pooled_infer``'s own arguments, checked the same way on both paths a request can take.

The coordination worker's ``pooled_infer`` refuses bad ones with this one-line error; a caller
sending directly to a free GPU (``tasks/pooled_direct.py``) leaves such a request to it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def check_arguments(pool: Any, labels: Any, timeout_s: Any) -> None:
    """``pooled_infer``'s own arguments, or a one-line ConfigError naming the bad one."""
    if not isinstance(pool, str) or not pool or any(c.isspace() for c in pool):
        raise ConfigError(f"expected a pool name without spaces, got {pool!r}", key="pool")
    if labels is not None and (
        not isinstance(labels, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
    ):
        raise ConfigError(f"expected a dict of str to str, got {labels!r}", key="labels")
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ConfigError(f"expected seconds > 0, got {timeout_s!r}", key="timeout_s")
