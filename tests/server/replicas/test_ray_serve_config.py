"""docs/deploy/ray-serve.yaml is a config Ray's `serve deploy` accepts, and its builder makes the application
(without starting Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("ray.serve")

CONFIG = Path(__file__).resolve().parents[3] / "docs" / "deploy" / "ray-serve.yaml"


def test_the_documented_config_is_one_ray_serve_accepts_and_builds():
    from ray.serve.schema import ServeDeploySchema

    from cacheblend_rag.server.replicas.launch import app_builder

    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (app,) = config.applications
    module, _, name = app.import_path.partition(":")
    assert (module, name) == ("cacheblend_rag.server.replicas.launch", "app_builder")
    application = app_builder(app.args)
    assert type(application).__name__ == "Application"
