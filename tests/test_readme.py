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
    (example,) = [b for b in _blocks("yaml") if "adapter: http" in b]
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


def test_run_it_links_the_operators_guide_and_the_dashboard():
    root = Path(__file__).resolve().parents[1]
    section = README[README.index("## Run it") :]
    section = section[: section.index("\n## ", 1)]
    links = re.findall(r"\]\(([^)]+)\)", section)
    for wanted in ("docs/operations.md", "deploy/grafana/gpuhedge-dashboard.json"):
        assert wanted in links, f"README's Run it section does not link {wanted}"
        assert (root / wanted).is_file(), wanted


def test_readme_runpod_cerebrium_hedge_loads_and_builds():
    (example,) = [b for b in _blocks("yaml") if "adapter: cerebrium" in b]
    cfg = parse_config_text(example, source="README.md")
    assert cfg.policy.name == "fixed" and cfg.by_role("hedge")[0].adapter == "cerebrium"
    env = {"RUNPOD_ENDPOINT_ID": "ep", "RUNPOD_API_KEY": "k1", "CEREBRIUM_PROJECT_ID": "p-1",
           "CEREBRIUM_API_KEY": "k2"}  # fmt: skip
    assert cfg.build("runpod", env=env).adapter == "runpod"
    assert cfg.build("cerebrium", env=env).app_id == "p-1-tts"
