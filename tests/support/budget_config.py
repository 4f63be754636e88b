"""The race config the budget tests share (tests/test_budget_races.py, test_budget_concurrency.py).

Two sim providers on compressed time (``time_scale`` 0.01), each test adding its own
``budget:`` block: ``p`` (primary) caps at 100 s at $0.0003/s plus a 60 s idle window, a worst
case of $0.048; ``h`` (hedge, launched at 20 s) at 100 s at $0.0007/s, $0.07. The tests' cap
arithmetic rests on these figures.
"""

from tests.support.race_configs import race_config, sim_pair

HEDGED_SIM_CONFIG = race_config(
    sim_pair(p_fast=(0.5, 4), h_fast=(0.2, 3), cancel=(0.2, 0.3), timeout_s=100),
    "fixed",
    {"hedge_after_ms": 20000},
    time_scale=0.01,
    validator=None,
)
