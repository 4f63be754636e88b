"""The ``budget:`` block of the YAML config, and the rule that real money needs a ceiling.

::

    budget:
      max_usd_per_request: 0.10       # one request's attempts together (worst cases reserved)
      max_usd_per_day: 25             # every request of a UTC day
      ceiling_usd: 500                # hard ceiling over the ledger's life
      providers:                      # optional, per provider
        runpod: {max_usd_per_day: 10, max_usd_total: 200}
      keys:                           # optional, per budget key (hedged_infer(..., budget_key=))
        tenant-a: {max_usd_per_day: 5}
        "*": {max_usd_per_day: 1}     # every key not listed, each on its own

A config naming any provider whose adapter spends money (every adapter but ``sim``) without
``ceiling_usd`` is refused: a one-line error naming the provider.
"""

from __future__ import annotations

from collections.abc import Mapping

from .core.budget import ANY_KEY, KEY_RE, BudgetCaps, ScopeCap
from .errors import ConfigError
from .providers.options import Block
from .providers.provider_config import ProviderConfig
from .providers.registry import adapter_class


def _scope(parent: Block, name: str) -> ScopeCap:
    block = parent.mapping(name)
    cap = ScopeCap(
        max_usd_per_day=block.number("max_usd_per_day", None, positive=True),
        max_usd_total=block.number("max_usd_total", None, positive=True),
    )
    block.finish()
    if cap.max_usd_per_day is None and cap.max_usd_total is None:
        raise parent.error(name, "expected max_usd_per_day and/or max_usd_total")
    return cap


def parse_budget(root: Block, providers: Mapping[str, ProviderConfig]) -> BudgetCaps:
    """Validate ``budget:`` (every figure a number > 0 in USD) against the providers."""
    block = root.mapping("budget")
    per_request = block.number("max_usd_per_request", None, positive=True)
    per_day = block.number("max_usd_per_day", None, positive=True)
    ceiling = block.number("ceiling_usd", None, positive=True)
    by_provider = block.mapping("providers")
    provider_caps: dict[str, ScopeCap] = {}
    for name in by_provider.data:
        if name not in providers:
            known = ", ".join(providers) or "none"
            raise by_provider.error(str(name), f"no provider {name!r} (known: {known})")
        provider_caps[str(name)] = _scope(by_provider, str(name))
    by_key = block.mapping("keys")
    key_caps: dict[str, ScopeCap] = {}
    for name in by_key.data:
        if not isinstance(name, str) or not (name == ANY_KEY or KEY_RE.match(name)):
            raise by_key.error(
                str(name), "expected a budget key of 1-100 letters, digits, '_', '-', '.', ':'"
            )
        key_caps[name] = _scope(by_key, name)
    block.finish()
    if per_request is not None and ceiling is not None and per_request > ceiling:
        raise block.error(
            "max_usd_per_request", f"${per_request:g} is above ceiling_usd ${ceiling:g}"
        )
    caps = BudgetCaps(per_request, per_day, ceiling, provider_caps, key_caps)
    paid = [p.name for p in providers.values() if spends_money(p)]
    if paid and ceiling is None:
        raise block.error(
            "ceiling_usd",
            f"required: provider {paid[0]!r} (adapter {providers[paid[0]].adapter}) spends "
            "real money; set a hard ceiling in USD (docs/costs.md)",
        )
    return caps


def spends_money(provider: ProviderConfig) -> bool:
    """Whether the provider's adapter spends real money (every adapter but the simulator)."""
    try:
        cls = adapter_class(provider.adapter)
    except ConfigError:
        return True
    return bool(getattr(cls, "spends_money", True))
