"""Race configs for the tests, written in one place: providers, policy, caps, budget, validator.

Each ``*_provider`` returns one provider's mapping and :func:`race_config` dumps them, with the
rest of the config, as YAML text. The paid adapters read their API keys from
``${RUNPOD_TEST_KEY}`` and ``${CEREBRIUM_TEST_KEY}`` (``tests.support.fleet.FAKE_KEYS``), their
URLs are the loopback fakes'.
"""

from __future__ import annotations

from typing import Any

import yaml

FAKE_TIMEOUTS = {"connect_s": 2, "read_s": 5}
FAST_POLL = {"min_s": 0.05, "max_s": 0.5, "fraction": 0.25}
PAID_CEILING = {"ceiling_usd": 1000}  # paid adapters need a ceiling (docs/costs.md)


def sim_provider(
    role: str,
    rate: float,
    seed: int,
    fast: tuple[float, float],
    cancel: tuple[float, float] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A sim provider whose every job takes ``fast`` (queue_s, run_s) unless a request says
    otherwise; ``cancel``: (ack_s, terminal_s) of its cancels; ``extra``: more provider keys."""
    sim: dict[str, Any] = {
        "seed": seed,
        "slow_probability": 0,
        "fast": {"queue_s": fast[0], "run_s": fast[1]},
    }
    if cancel is not None:
        sim["cancel"] = {"ack_s": cancel[0], "terminal_s": cancel[1]}
    return {"role": role, "adapter": "sim", "billed_rate_per_s": rate, **extra, "sim": sim}


def sim_pair(
    p_fast: tuple[float, float],
    h_fast: tuple[float, float],
    cancel: tuple[float, float],
    **extra: Any,
) -> dict[str, dict[str, Any]]:
    """The sim fleet the race tests hedge on: ``p`` (primary, $0.0003/s and a 60 s idle window)
    and ``h`` (hedge, $0.0007/s), both cancelled in ``cancel``; ``extra`` goes to both."""
    return {
        "p": sim_provider("primary", 0.0003, 1, p_fast, cancel, idle_billed_seconds=60, **extra),
        "h": sim_provider("hedge", 0.0007, 2, h_fast, cancel, **extra),
    }


def runpod_provider(
    role: str,
    rate: float,
    *,
    endpoint_id: str,
    base_url: str,
    poll: dict[str, float] | None = FAST_POLL,
    cancel_poll_s: float = 0.05,
    payload: str = "output.audio_base64",
    **extra: Any,
) -> dict[str, Any]:
    """A ``runpod`` provider on an endpoint of the RunPod fake at ``base_url`` (``poll`` None:
    the adapter's own pacing)."""
    runpod: dict[str, Any] = {
        "endpoint_id": endpoint_id,
        "api_key": "${RUNPOD_TEST_KEY}",
        "base_url": base_url,
        "payload": payload,
        "timeouts": FAKE_TIMEOUTS,
    }
    if poll is not None:
        runpod["poll"] = poll
    runpod.update(cancel_confirm_s=5, cancel_poll_s=cancel_poll_s)
    return {"role": role, "adapter": "runpod", "billed_rate_per_s": rate, **extra, "runpod": runpod}


def cerebrium_provider(
    role: str,
    rate: float,
    *,
    url: str,
    project_id: str,
    payload: str = "result.audio_base64",
    **extra: Any,
) -> dict[str, Any]:
    """A ``cerebrium`` provider (function ``tts/predict``) on the Cerebrium fake at ``url``."""
    cerebrium = {
        "project_id": project_id,
        "app": "tts",
        "function": "predict",
        "api_key": "${CEREBRIUM_TEST_KEY}",
        "api_url": url,
        "rest_url": url,
        "payload": payload,
        "timeouts": FAKE_TIMEOUTS,
    }
    head = {"role": role, "adapter": "cerebrium", "billed_rate_per_s": rate}
    return {**head, **extra, "cerebrium": cerebrium}


def modal_provider(role: str, rate: float, *, url: str, **extra: Any) -> dict[str, Any]:
    """A ``modal`` provider (function ``tts/synthesize``) whose SDK talks to the Modal fake at
    ``url``."""
    modal = {
        "app": "tts",
        "function": "synthesize",
        "payload": "audio_base64",
        "poll_interval_s": 0.05,
        "cancel_confirm_s": 3,
        "timeouts": {"spawn_s": 1.5, "poll_s": 1, "cancel_s": 2},
        "sdk": "tests.support.modal_fake_sdk:FakeModalClient",
        "sdk_options": {"url": url},
    }
    return {"role": role, "adapter": "modal", "billed_rate_per_s": rate, **extra, "modal": modal}


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # a shared mapping is written out each time
        return True


def race_config(
    providers: dict[str, dict[str, Any]],
    policy: str,
    params: dict[str, Any] | None = None,
    *,
    time_scale: float | None = None,
    validator: Any = "wav",
    **sections: Any,
) -> str:
    """The YAML text of a config: ``time_scale`` (when given), ``providers`` by name, the policy
    ``policy`` with ``params``, then ``sections`` (``timeouts``, ``budget``, ...) in their
    order, then ``validator`` (None: left out)."""
    data: dict[str, Any] = {} if time_scale is None else {"time_scale": time_scale}
    data["providers"] = providers
    data["policy"] = {"name": policy} if params is None else {"name": policy, "params": params}
    data.update(sections)
    if validator is not None:
        data["validator"] = validator
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)
