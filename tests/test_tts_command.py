"""Real text-to-speech behind ``cmd:``: espeak-ng (a Debian package; scripts/test.sh installs it).

deploy/espeak_tts.py speaks the request's text and prints the WAV as base64, which the ``wav``
validator accepts: a pooled GPU running it is a hedge target that produces real audio.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from gpuhedge_celery.core.validators import validate
from gpuhedge_celery.runners import CommandRunner, RunContext, RunnerFailed
from gpuhedge_celery.tasks.app import TASK_POOLED_INFER

REPO = Path(__file__).resolve().parents[1]
TTS = [sys.executable, str(REPO / "deploy" / "espeak_tts.py")]


@pytest.fixture(autouse=True)
def espeak_installed():
    if shutil.which("espeak-ng") is None:
        pytest.fail("espeak-ng is not installed: run the README's test command (scripts/test.sh)")


def test_speech_passes_the_wav_validator():
    audio = CommandRunner(TTS).run({"text": "The GPU pool speaks."}, RunContext())
    assert isinstance(audio, str)
    result = validate("wav", audio)
    assert result.ok, result.reasons
    assert result.details["duration_s"] > 0.8 and result.details["rms"] > 0.01
    longer = validate("wav", CommandRunner(TTS).run({"text": "one two three " * 8}, RunContext()))
    assert longer.details["duration_s"] > result.details["duration_s"] * 2, (
        "longer text, longer speech"
    )


def test_bad_requests_fail_in_one_line():
    with pytest.raises(RunnerFailed, match=r'exited with 2: espeak_tts: expected \{"text"'):
        CommandRunner(TTS).run({"text": ""}, RunContext())


@pytest.mark.redis
@pytest.mark.celery
def test_a_pooled_gpu_produces_valid_audio(celery_cluster):
    c = celery_cluster
    gpu = c.start_gpu(0, runner="cmd:" + " ".join(TTS), wait=False)
    c.wait_ready(gpu, c.start_coordinator(wait=False))
    out = c.app.send_task(TASK_POOLED_INFER, ({"text": "hedged and pooled"},)).get(timeout=60)
    assert validate("wav", out["output"]).ok
