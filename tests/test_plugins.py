"""Names in a config or a message import only what a trusted source lists.

A task message's ``policy="module:kind"`` resolves only to a module a trusted source (the
config file, ``GPUHEDGE_PLUGINS``) had imported: it imports nothing itself. ``config check``
and ``config show`` run none of the code a file names. Each check runs in a new interpreter,
so "was it imported?" is a fact of that process alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGIN = """
from pathlib import Path
from gpuhedge_celery.core.policies import register_policy
from gpuhedge_celery.core.policy_base import Policy

Path("IMPORTED").write_text("the plugin ran")
"""
CONFIG = """
plugins: [{plugins}]
providers:
  p: {{adapter: sim, role: primary}}
policy: {{name: {policy}}}
"""


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(cwd)])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def test_a_policy_named_in_a_message_imports_nothing(tmp_path):
    done = run_python(
        """
        import sys
        from gpuhedge_celery.config import parse_config_text
        from gpuhedge_celery.errors import ConfigError
        cfg = parse_config_text("providers:\\n  p: {adapter: sim, role: primary}\\n")
        for spec in ("this:kind", "antigravity:x", "os.path:kind"):
            try:
                cfg.make_policy(spec)
            except ConfigError as e:
                assert "not a plugin of this deployment" in str(e), e
            else:
                raise AssertionError(spec)
        assert "this" not in sys.modules and "antigravity" not in sys.modules
        print("refused")
        """,
        tmp_path,
    )
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr
    assert "Beautiful is better than ugly" not in done.stdout + done.stderr


@pytest.mark.parametrize("command", ["check", "show"])
def test_config_check_and_show_run_no_code_the_file_names(tmp_path, command):
    (tmp_path / "evil_plugin.py").write_text(PLUGIN)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(plugins="evil_plugin", policy="'evil_plugin:mine'"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "gpuhedge_celery", "config", command, str(cfg)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "IMPORTED").exists(), "config check ran the plugin"
    if command == "check":
        assert "note: not imported here" in done.stdout and "evil_plugin" in done.stdout


def test_a_worker_imports_the_plugins_its_config_lists_and_a_message_may_name_them(tmp_path):
    (tmp_path / "my_plugin.py").write_text(PLUGIN + textwrap.dedent("""
        @register_policy
        class Mine(Policy):
            kind = "mine"
            def __init__(self, primary: str):
                self.primary = primary
            def providers(self):
                return (self.primary,)
            @property
            def name(self):
                return f"mine:{self.primary}"
            def params(self):
                return {"primary": self.primary}
            @classmethod
            def parse(cls, body):
                return cls(body)
        """))  # fmt: skip
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(plugins="my_plugin", policy="single"))
    done = run_python(
        """
        from gpuhedge_celery.config import load_config
        cfg = load_config("cfg.yaml")
        print(cfg.plugins, cfg.make_policy("my_plugin:mine").name)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "IMPORTED").exists()
    assert done.stdout.strip() == "('my_plugin',) mine:p"


@pytest.mark.parametrize(
    "plugins, fragment",
    [("'x'", "expected a list of module paths"), ("['a b']", "expected a module path")],
)
def test_a_plugin_list_that_is_not_module_paths_is_one_line_naming_the_key(plugins, fragment):
    from gpuhedge_celery.config import parse_config_text
    from gpuhedge_celery.errors import ConfigError

    text = CONFIG.format(plugins="", policy="single").replace("plugins: []", f"plugins: {plugins}")
    with pytest.raises(ConfigError) as e:
        parse_config_text(text, source="t.yaml")
    assert "t.yaml: plugins" in str(e.value) and fragment in str(e.value)


def test_config_check_leaves_a_plugins_own_kind_and_validator_to_the_workers(tmp_path):
    (tmp_path / "acme_plugin.py").write_text(PLUGIN)  # would register "acme" and "acme_wav"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG.format(plugins="acme_plugin", policy="acme") + "validator: acme_wav\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "gpuhedge_celery", "config", "check", str(cfg)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "note: not imported here" in done.stdout and not (tmp_path / "IMPORTED").exists()
    # without plugins listed, an unknown kind is still the one-line error it always was
    cfg.write_text(CONFIG.format(plugins="", policy="acme"))
    done = subprocess.run([sys.executable, "-m", "gpuhedge_celery", "config", "check", str(cfg)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 2 and "policy.name" in done.stderr
