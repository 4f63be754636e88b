"""Call hedged_infer from outside any worker, three ways, and print what came back as JSON.

    python client.py "hello world"            # needs gpuhedge workers and a tts_app worker

1. by name from the existing app (``tts_app.speak``);
2. by import: ``from gpuhedge_celery import hedged_infer; hedged_infer.delay(...)`` (reads the
   ``GPUHEDGE_*`` environment, like the gpuhedge workers);
3. a chain ending in the existing app's own task (``tts_app.speak_and_save``).

A race that ends without a valid result raises ``RaceFailed``: the client prints its one-line
message (every attempt and why it did not win) and how to read the receipt, and exits with 1.
Each ``.get()`` waits as long as the slowest race the config allows (computed from it), not a
guessed minute: the packaged default's slow primary alone can take two minutes.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tts_app  # noqa: E402 - this directory, not an installed package
from celery.exceptions import TimeoutError as ResultTimeout  # noqa: E402

from gpuhedge_celery.config import load_config  # noqa: E402
from gpuhedge_celery.errors import RaceFailed  # noqa: E402
from gpuhedge_celery.race.spec import longest_race_s  # noqa: E402


def summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "payload"}


def race_timeout_s() -> float:
    """The longest a race may take under the config the workers use (``GPUHEDGE_CONFIG``, else
    ./config/gpuhedge.yaml, else the packaged default), for the policies called below."""
    cfg = load_config(os.environ.get("GPUHEDGE_CONFIG") or None)
    return max(longest_race_s(cfg, policy) for policy in (None, "fixed"))


def main(text: str) -> None:
    timeout = race_timeout_s()
    sim = json.loads(os.environ.get("EXAMPLE_SIM", "null"))  # tests force a sim fate
    by_name = tts_app.speak(text, sim=sim).get(timeout=timeout)

    from gpuhedge_celery import hedged_infer

    request = {"text": text, **({"sim": sim} if sim else {})}
    by_import = hedged_infer.delay(request, policy="fixed").get(timeout=timeout)

    saved = tts_app.speak_and_save(text, sim=sim).get(timeout=timeout)
    print(json.dumps({
        "by_name": summary(by_name),
        "by_import": summary(by_import),
        "chained": saved,
    }))  # fmt: skip


if __name__ == "__main__":
    try:
        main(" ".join(sys.argv[1:]) or "hello from an existing Celery app")
    except RaceFailed as e:
        race_id = e.receipt.get("race_id") or "RACE_ID"
        print(f"client.py: {e}", file=sys.stderr)
        print(f"client.py: the full receipt: gpuhedge-celery receipt {race_id}", file=sys.stderr)
        sys.exit(1)
    except ResultTimeout as e:
        print(f"client.py: no result in time ({e}): are the workers running?", file=sys.stderr)
        sys.exit(1)
