"""The README's promises: two set-up commands on the first screen, and an HTTP example that runs."""

from __future__ import annotations

import re
from pathlib import Path

from gpuhedge_celery.config import parse_config_text
from gpuhedge_celery.core.clock import WallClock
from gpuhedge_celery.core.jobs import JobState
from gpuhedge_celery.core.validators import validate
from tests.support.http_provider_server import HttpProviderServer

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_first_screen_has_exactly_the_two_setup_commands():
    first = _blocks("bash")[0].strip().splitlines()
    assert len(first) == 2
    assert first[0].startswith("pip install -e . && gpuhedge-celery demo")
    assert first[1].startswith("bash scripts/test.sh")
    assert README.index("```bash") < 400  # on the first screen
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci


def test_readme_http_example_loads_and_runs(monkeypatch):
    (example,) = _blocks("yaml")
    with HttpProviderServer() as server:
        server.knobs.api_key = "rp-readme-secret"
        monkeypatch.setenv("RUNPOD_API_BASE", server.url)
        monkeypatch.setenv("RUNPOD_ENDPOINT_ID", "ep-readme")
        monkeypatch.setenv("RUNPOD_API_KEY", "rp-readme-secret")
        cfg = parse_config_text(example, source="README.md")
        provider = cfg.build("runpod", clock=WallClock())
        handle = provider.submit({"text": "hello"})
        result = provider.result(handle, cap_s=30)
        assert result.state is JobState.COMPLETED
        assert validate(cfg.validator.name, result.payload, **cfg.validator.options).ok
        assert "rp-readme-secret" not in repr(cfg) + repr(provider) + repr(result.to_dict())
