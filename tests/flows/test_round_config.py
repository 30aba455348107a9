"""Rounds as data: the shipped profiles load, a knob keeps its name from the YAML to the run
config, layers merge in order, and every problem is reported with the field to set."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from flywheel.environments.custom import file_stats_env
from flywheel.flows import work
from flywheel.flows.round_config import (
    PROFILES_DIR,
    RoundConfig,
    config_yaml,
    load_round_config,
    overridden,
    profile,
    profile_names,
)
from flywheel.training.config import ConfigError

# Section -> the run config it becomes.
SECTION_TARGETS = {
    "sft": lambda c: c.sft_run_config(policy_model="m", dataset="d", output_name="o"),
    "rl": lambda c: c.rl_run_config(policy_model="m", output_name="o"),
    "eval": lambda c: c.eval_config(base_url="http://127.0.0.1:1/v1", model_name="m", tokenizer="t", name="n"),
    "lm_eval": lambda c: c.lm_eval_config(backend="hf", name="n"),
}


def test_the_shipped_profiles_are_yaml_that_say_how_to_run_them() -> None:
    assert profile_names() == ["default", "h100", "quick", "tiny"]
    for name in profile_names():
        text = (PROFILES_DIR / f"{name}.yaml").read_text()
        assert text.startswith("# ") and f"flywheel round --profile {name}" in text.splitlines()[1], name
        assert "one override" in text, name
        assert isinstance(profile(name), RoundConfig)
    assert profile("default").model == "smollm2" and profile("h100").gpus == 8


@pytest.mark.parametrize("name", ["default", "h100"])
def test_a_section_field_reaches_its_run_config_unchanged(name: str) -> None:
    """One name per knob: each section field is a field of the config it becomes, with the same value
    (sharding aside, which a one-GPU round leaves off)."""
    config = profile(name)
    for section, build in SECTION_TARGETS.items():
        built = build(config)
        for field, value in getattr(config, section).model_dump().items():
            assert field in type(built).model_fields, f"{section}.{field} is no field of {type(built).__name__}"
            if field not in ("deepspeed", "fsdp") or config.gpus > 1:
                assert getattr(built, field) == value, f"{section}.{field}"
    rl = config.rl_run_config(policy_model="m", output_name="o")
    assert (rl.max_agent_turns, rl.max_token_length) == (config.max_agent_turns, config.max_token_length)
    assert config.eval_config(base_url="u", model_name="m", tokenizer="t", name="n").max_agent_turns == (
        config.max_agent_turns
    )


def test_a_changed_knob_changes_what_the_stage_runs() -> None:
    config = load_round_config("quick", overrides=["sft.learning_rate=3e-4", "rl.kl_beta=0.2", "max_agent_turns=4"])
    sft = work.sft_config(work.SFTParams(config=config, base="b", dataset="d"))
    rl = work.rl_config(work.RLParams(config=config, policy="p"))
    assert (sft.learning_rate, rl.kl_beta, rl.max_agent_turns) == (3e-4, 0.2, 4)
    assert sft.output_name == "sft-r1" and rl.output_name == "rl-r1"
    atropos = load_round_config("default", overrides=["rl.rl_mode=atropos", "rl.env_workers=3"])
    fed = work.rl_config(work.RLParams(config=atropos, policy="p"))  # Workers drop flat groups: no screening.
    assert (fed.rl_mode, fed.env_workers, fed.screen_tasks, profile("default").rl.screen_tasks) == ("atropos", 3, 0, 8)


def test_layers_merge_profile_then_file_then_overrides(tmp_path: Path) -> None:
    mine = tmp_path / "my_round.yaml"
    mine.write_text("model: tiny\nsft:\n  total_steps: 3\n  learning_rate: 1.0e-3\ngenerate: {groups: 5}\n")
    on_quick = load_round_config("quick", mine, ["sft.total_steps=7"])
    assert (on_quick.sft.total_steps, on_quick.sft.learning_rate, on_quick.generate.groups) == (7, 1e-3, 5)
    assert on_quick.sft.gradient_accumulation_steps == profile("quick").sft.gradient_accumulation_steps  # Kept.
    alone = load_round_config(None, mine)  # A file alone stands on the field defaults, not on `default`.
    assert alone.sft.gradient_accumulation_steps == 1 and alone.model == "tiny"
    assert alone.eval.eval_size != profile("default").eval.eval_size
    assert load_round_config().model_dump() == profile("default").model_dump()


def test_show_config_reads_back_as_the_same_config(tmp_path: Path) -> None:
    config = load_round_config("h100", overrides=["model=/models/qwen", "curriculum.focus=2"])
    text = config_yaml(config)
    assert "  total_steps: 500  # Optimizer steps." in text  # Every field with its description.
    assert all("#" in line for line in text.splitlines() if line.strip())
    written = tmp_path / "shown.yaml"
    written.write_text(text)
    assert load_round_config(None, written) == config
    assert yaml.safe_load(text)["curriculum"]["focus"] == 2


def test_every_problem_is_named_with_its_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_round_config("quick", overrides=["sft.bogus=1", "eval.eval_size=0", "teacher=oracle"])
    assert "unknown field(s) ['teacher']" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_round_config("quick", overrides=["sft.bogus=1", "eval.eval_size=0"])
    assert "sft.bogus: Extra inputs are not permitted" in str(caught.value)
    assert "eval.eval_size: Input should be greater than or equal to 1" in str(caught.value)
    with pytest.raises(ConfigError, match=r"rl: kl_beta=0.001 is below 0.01; raise it or set allow_low_kl=true"):
        load_round_config("quick", overrides=["rl.kl_beta=0.001"])
    assert load_round_config("quick", overrides=["rl.kl_beta=0.001", "rl.allow_low_kl=true"]).rl.kl_beta == 0.001
    with pytest.raises(ConfigError, match="must be a multiple of num_rollouts_per_task"):
        load_round_config("quick", overrides=["rl.batch_size=3"])
    with pytest.raises(ConfigError, match="'sft' is a value, not a section"):
        load_round_config("quick", overrides=["sft=1", "sft.total_steps=2"])
    with pytest.raises(ConfigError, match="unknown profile 'laptop': choose default, h100, quick, tiny"):
        load_round_config("laptop")
    with pytest.raises(ConfigError, match="teacher: endpoint needs endpoint.base_url"):
        load_round_config("quick", overrides=["generate.teacher=endpoint"])


def test_relative_paths_are_made_absolute_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(Path(file_stats_env.__file__), tmp_path / "my_env.py")  # A user's env file.
    config = load_round_config("tiny", overrides=["envs=[my_env.py, tool_use_chain]", "lm_eval.include_path=tasks"])
    assert config.envs == [str(tmp_path / "my_env.py"), "tool_use_chain"]
    assert config.lm_eval.include_path == str(tmp_path / "tasks")


def test_overridden_validates_again() -> None:
    quick = profile("quick")
    assert overridden(quick, {"sft.total_steps": 9}).sft.total_steps == 9 and quick.sft.total_steps == 4
    with pytest.raises(ConfigError, match="sft.total_steps"):
        overridden(quick, {"sft.total_steps": 0})
