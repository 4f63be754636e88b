"""The race config the budget tests share (tests/test_budget_races.py, test_budget_concurrency.py).

Two sim providers on compressed time (``time_scale`` 0.01), each test adding its own
``budget:`` block: ``p`` (primary) caps at 100 s at $0.0003/s plus a 60 s idle window, a worst
case of $0.048; ``h`` (hedge, launched at 20 s) at 100 s at $0.0007/s, $0.07. The tests' cap
arithmetic rests on these figures.
"""

HEDGED_SIM_CONFIG = """
time_scale: 0.01
providers:
  p:
    role: primary
    adapter: sim
    billed_rate_per_s: 0.0003
    idle_billed_seconds: 60
    timeout_s: 100
    sim: {seed: 1, slow_probability: 0, fast: {queue_s: 0.5, run_s: 4},
          cancel: {ack_s: 0.2, terminal_s: 0.3}}
  h:
    role: hedge
    adapter: sim
    billed_rate_per_s: 0.0007
    timeout_s: 100
    sim: {seed: 2, slow_probability: 0, fast: {queue_s: 0.2, run_s: 3},
          cancel: {ack_s: 0.2, terminal_s: 0.3}}
policy:
  name: fixed
  params: {hedge_after_ms: 20000}
"""
