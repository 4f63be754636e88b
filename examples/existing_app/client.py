"""Call hedged_infer from outside any worker, three ways, and print what came back as JSON.

    python client.py "hello world"            # needs gpuhedge workers and a tts_app worker

1. by name from the existing app (``tts_app.speak``);
2. by import: ``from gpuhedge_celery import hedged_infer; hedged_infer.delay(...)`` (reads the
   ``GPUHEDGE_*`` environment, like the gpuhedge workers);
3. a chain ending in the existing app's own task (``tts_app.speak_and_save``).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tts_app  # noqa: E402 - this directory, not an installed package


def summary(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "payload"}


def main(text: str) -> None:
    sim = json.loads(os.environ.get("EXAMPLE_SIM", "null"))  # tests force a sim fate
    by_name = tts_app.speak(text, sim=sim).get(timeout=60)

    from gpuhedge_celery import hedged_infer

    request = {"text": text, **({"sim": sim} if sim else {})}
    by_import = hedged_infer.delay(request, policy="fixed").get(timeout=60)

    saved = tts_app.speak_and_save(text, sim=sim).get(timeout=60)
    print(json.dumps({
        "by_name": summary(by_name),
        "by_import": summary(by_import),
        "chained": saved,
    }))  # fmt: skip


if __name__ == "__main__":
    main(" ".join(sys.argv[1:]) or "hello from an existing Celery app")
