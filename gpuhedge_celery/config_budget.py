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
        shared: {max_usd_per_day: 1}
      default_key: shared             # required with keys: a request naming no key is charged to it
      unknown_keys: refuse            # refuse (default) or default: an unlisted key is charged
                                      # to default_key (sharing its caps)

With ``keys`` set every race is charged to one of them, so key caps always apply: a caller
cannot skip them by naming no key, nor open a fresh cap by naming a new one. ``"*"`` is refused
(it gave every unlisted key a cap of its own).

A config naming any provider whose adapter spends money (every adapter but ``sim``) without
``ceiling_usd`` is refused: a one-line error naming the provider.
"""

from __future__ import annotations

from collections.abc import Mapping

from .core.budget import ANY_KEY, KEY_RE, UNKNOWN_KEYS, BudgetCaps, ScopeCap
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
        if name == ANY_KEY:
            raise by_key.error(
                ANY_KEY,
                "not accepted: it gives every unlisted key a fresh cap of its own; list "
                "each key, and set default_key (and unknown_keys: default to charge unlisted "
                "keys to it)",
            )
        if not isinstance(name, str) or not KEY_RE.match(name):
            raise by_key.error(
                str(name), "expected a budget key of 1-100 letters, digits, '_', '-', '.', ':'"
            )
        key_caps[name] = _scope(by_key, name)
    default_key = block.string("default_key", None)
    unknown_keys = block.string("unknown_keys", "refuse", choices=UNKNOWN_KEYS)
    block.finish()
    if key_caps and default_key is None:
        raise block.error(
            "default_key",
            f"required with budget.keys: a request naming no key is charged to "
            f"it, so key caps always apply (one of: {', '.join(key_caps)})",
        )
    if default_key is not None and default_key not in key_caps:
        known = ", ".join(key_caps) or "none"
        raise block.error("default_key", f"no key {default_key!r} in budget.keys (known: {known})")
    if unknown_keys == "default" and default_key is None:
        raise block.error("unknown_keys", "'default' needs budget.default_key")
    if per_request is not None and ceiling is not None and per_request > ceiling:
        raise block.error(
            "max_usd_per_request", f"${per_request:g} is above ceiling_usd ${ceiling:g}"
        )
    caps = BudgetCaps(
        per_request, per_day, ceiling, provider_caps, key_caps, default_key, unknown_keys
    )
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
