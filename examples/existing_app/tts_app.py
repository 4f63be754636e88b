"""An existing Celery app (a text-to-speech product) that hedges its GPU calls with gpuhedge.

Nothing here is gpuhedge code: it is an ordinary Celery app with its own broker settings, its
own queue (``tts``) and its own tasks. It reaches ``hedged_infer`` on the same Redis in two ways:

* by name, with no import of gpuhedge at all: ``app.send_task("gpuhedge.hedged_infer", ...)``,
  routed to the ``gpuhedge.coord`` queue by ``task_routes`` below;
* as part of a workflow: ``chain(signature("gpuhedge.hedged_infer", ...), save_audio.s())``, so
  ``save_audio`` runs on this app's own worker with the race's result.

Settings (environment): ``BROKER_URL`` (default ``redis://127.0.0.1:6379/0``),
``RESULT_BACKEND`` (default: the broker URL; set it to the gpuhedge Redis when the broker is
RabbitMQ) and ``BROKER_KEYPREFIX`` (only if the gpuhedge workers run with a
``GPUHEDGE_BROKER_PREFIX``; both sides must use the same).

Run its worker with ``celery -A tts_app worker -Q tts`` from this directory.
"""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

from celery import Celery, chain, signature

BROKER_URL = os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0")
KEYPREFIX = os.environ.get("BROKER_KEYPREFIX", "")

RESULT_BACKEND = os.environ.get("RESULT_BACKEND", BROKER_URL)

app = Celery("tts_app", broker=BROKER_URL, backend=RESULT_BACKEND)
app.conf.update(
    task_serializer="json",  # gpuhedge workers accept JSON only
    result_serializer="json",
    accept_content=["json"],
    task_default_queue="tts",
    task_routes={
        "gpuhedge.pooled_infer": {"queue": "gpuhedge.pool"},
        "gpuhedge.*": {"queue": "gpuhedge.coord"},
    },
)
if KEYPREFIX:
    app.conf.broker_transport_options = {"global_keyprefix": KEYPREFIX}
    if RESULT_BACKEND.startswith("redis"):
        app.conf.result_backend_transport_options = {"global_keyprefix": KEYPREFIX}


def speak(text: str, *, policy: str | None = None, sim: dict[str, Any] | None = None) -> Any:
    """Start a hedged race for ``text`` by task name; returns the AsyncResult (race id = its id)."""
    request: dict[str, Any] = {"text": text}
    if sim:
        request["sim"] = sim  # only for the packaged simulated providers: force a job's fate
    return app.send_task("gpuhedge.hedged_infer", args=(request,), kwargs={"policy": policy})


@app.task(name="tts_app.save_audio")
def save_audio(result: dict[str, Any]) -> dict[str, Any]:
    """Runs on this app's worker after the race: keep a fingerprint of the winning audio."""
    audio = result.get("payload") or ""
    digest = hashlib.sha256(base64.b64decode(audio)).hexdigest() if audio else None
    return {"race_id": result["race_id"], "winner": result["winner"], "sha256": digest}


def speak_and_save(text: str, *, sim: dict[str, Any] | None = None) -> Any:
    """A workflow: the hedged race, then ``save_audio`` with its result (no blocking in tasks)."""
    request: dict[str, Any] = {"text": text, **({"sim": sim} if sim else {})}
    race = signature("gpuhedge.hedged_infer", args=(request,), app=app)
    # The coordinator sends the next step with its own routes: name this app's queue explicitly.
    return chain(race, save_audio.s().set(queue="tts")).apply_async()
