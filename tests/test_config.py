"""Typed configs: strict keys and types, overrides, errors naming the file and the key."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from asr.config import ConfigError, config_diff, from_dict, load_config, parse_overrides, to_dict


@dataclass(frozen=True)
class Aug:
    masks: int = 2
    ratio: float = 0.05


@dataclass(frozen=True)
class Data:
    max_batch_seconds: float = 100.0
    speeds: list[float] | None = None
    aug: Aug = field(default_factory=Aug)


@dataclass(frozen=True)
class Train:
    lr: float = 1e-3
    epochs: int = 10
    amp: bool = True
    optimizer: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.98)


@dataclass(frozen=True)
class Experiment:
    data: Data = field(default_factory=Data)
    training: Train = field(default_factory=Train)


def write(tmp_path, text):
    path = tmp_path / "conf.yaml"
    path.write_text(text)
    return path


def test_load_yaml_with_types_and_nesting(tmp_path):
    path = write(tmp_path, "data:\n  max_batch_seconds: 50\n  speeds: [0.9, 1.1]\n  aug: {masks: 3}\n"
                           "training:\n  lr: 2.0e-3\n  betas: [0.9, 0.99]\n")
    cfg = load_config(Experiment, path)
    assert cfg.data.max_batch_seconds == 50.0 and isinstance(cfg.data.max_batch_seconds, float)
    assert cfg.data.speeds == [0.9, 1.1]
    assert cfg.data.aug == Aug(masks=3, ratio=0.05)
    assert cfg.training.lr == 2e-3 and cfg.training.betas == (0.9, 0.99)
    assert cfg.training.epochs == 10


def test_overrides_apply_and_parse_values(tmp_path):
    path = write(tmp_path, "training:\n  lr: 1.0e-3\n")
    cfg = load_config(Experiment, path, ["training.lr=5e-4", "data.aug.masks=0", "training.amp=false",
                                         "data.speeds=[1.0]", "training.optimizer=adam"])
    assert cfg.training.lr == 5e-4 and cfg.data.aug.masks == 0 and cfg.training.amp is False
    assert cfg.data.speeds == [1.0] and cfg.training.optimizer == "adam"


@pytest.mark.parametrize("text, key", [
    ("training:\n  lrr: 1\n", "training.lrr"),
    ("data:\n  aug:\n    maskz: 1\n", "data.aug.maskz"),
    ("modle:\n  x: 1\n", "modle"),
])
def test_unknown_key_names_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"{path}.*unknown key '{key}'"):
        load_config(Experiment, path)


@pytest.mark.parametrize("text, key", [
    ("training:\n  epochs: ten\n", "training.epochs"),
    ("training:\n  epochs: 1.5\n", "training.epochs"),
    ("training:\n  lr: fast\n", "training.lr"),
    ("training:\n  amp: 1\n", "training.amp"),
    ("training:\n  optimizer: 3\n", "training.optimizer"),
    ("data:\n  speeds: 0.9\n", "data.speeds"),
    ("data:\n  speeds: [0.9, x]\n", r"data.speeds\[1\]"),
    ("data: 5\n", "data"),
    ("training:\n  betas: [0.9]\n", "training.betas"),
])
def test_wrong_type_names_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"{path}.*'{key}'"):
        load_config(Experiment, path)


def test_override_of_a_string_field_keeps_its_text():
    cfg = load_config(Experiment, None, ["training.optimizer=on", "data.speeds=null"])
    assert cfg.training.optimizer == "on" and cfg.data.speeds is None
    cfg = load_config(Experiment, None, ["training.optimizer=123"])
    assert cfg.training.optimizer == "123"


def test_bad_override_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_overrides(["training.lr"])
    with pytest.raises(ConfigError, match="unknown key 'training.nope'"):
        load_config(Experiment, None, ["training.nope=1"])
    path = write(tmp_path, "training: [\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(Experiment, path)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(Experiment, tmp_path / "missing.yaml")


def test_missing_required_key():
    @dataclass(frozen=True)
    class Needs:
        size: int

    with pytest.raises(ConfigError, match="missing required key 'size'"):
        from_dict(Needs, {}, source="x.yaml")


def test_round_trip_and_diff():
    cfg = Experiment(training=Train(lr=0.5))
    plain = to_dict(cfg)
    assert from_dict(Experiment, plain) == cfg
    other = to_dict(Experiment(training=Train(lr=0.25), data=Data(aug=Aug(masks=1))))
    assert config_diff(plain, other) == ["data.aug.masks: 2 -> 1", "training.lr: 0.5 -> 0.25"]
    assert config_diff(plain, plain) == []
