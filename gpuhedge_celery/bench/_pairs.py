"""The run order of the benchmarks' "off vs on" rows (``bench races --rows records, metrics``).

Runs go in pairs, the side going first flipping every pair (off/on, on/off, ...), so a machine
whose speed drifts during the benchmark favours neither side.
"""

from __future__ import annotations

from collections.abc import Iterator


def alternating_sides(pairs: int) -> Iterator[tuple[int, bool]]:
    """``(pair index, on)`` for each of the ``2 * pairs`` runs, in the order to run them."""
    for pair in range(pairs):
        for on in (False, True) if pair % 2 == 0 else (True, False):
            yield pair, on
