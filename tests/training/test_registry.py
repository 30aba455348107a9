"""The algorithm registry is the one record of an algorithm: a row gives it a config, a runner and its
`flywheel train` command (docs/guide/extending.md, "A training algorithm")."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import typer
from pydantic import Field
from typer.testing import CliRunner

from flywheel.data import ArtifactStore, Manifest
from flywheel.flows import cli
from flywheel.training import registry
from flywheel.training.config import TrainConfig
from flywheel.training.launch import launch_command


class ToyConfig(TrainConfig):
    """A toy algorithm's config: the shared fields and one of its own."""

    algorithm: Literal["toy"] = Field(default="toy", description="Always toy.")
    scale: float = Field(default=1.0, gt=0, description="What the toy trainer multiplies.")


def run_toy(cfg: ToyConfig, store: ArtifactStore, **_: Any) -> Manifest:
    """Store a 'checkpoint' holding the config, as a real runner stores its model."""
    return store.put(
        "checkpoint", cfg.output_name, {"config.json": cfg.model_dump_json()}, metrics={"scale": cfg.scale}
    )


def test_a_registered_algorithm_gets_a_train_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toy = registry.Algorithm(f"{__name__}:ToyConfig", f"{__name__}:run_toy", "A toy trainer.")
    monkeypatch.setitem(registry.ALGORITHMS, "toy", toy)
    group = typer.Typer()
    cli.add_train_commands(group)
    config = tmp_path / "toy.yaml"
    config.write_text("output_name: toy-run\nscale: 2.0\n")
    monkeypatch.setattr(cli.state, "store_url", str(tmp_path / "store"))
    result = CliRunner().invoke(group, ["toy", "--config", str(config), "scale=3.5"])
    assert result.exit_code == 0, result.output
    stored = ArtifactStore(tmp_path / "store").manifest("checkpoint/toy-run")
    assert stored.metrics == {"scale": 3.5} and "checkpoint/toy-run" in result.output
    assert "A toy trainer." in CliRunner().invoke(group, ["--help"]).output
    cfg = registry.load_run_config(config, ["algorithm=toy"])
    assert launch_command(cfg, "toy.yaml", 2)[-4:] == ["train", "toy", "--config", "toy.yaml"]


def test_every_shipped_algorithm_has_its_command() -> None:
    commands = {c.name for c in cli.train_app.registered_commands}
    assert commands == {*registry.ALGORITHMS, "rl"}
