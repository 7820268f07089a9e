"""Config schemas: strict, described, loadable from YAML, errors naming the dotted field."""

import pytest

from eagleray.platform.config import promotion, schemas
from eagleray.platform.config.load import StrictModel, load_yaml_config, parse_config
from eagleray.platform.errors import ConfigError
from eagleray.serve import serving_config
from eagleray.serve.engine import config as engine_config
from eagleray.serve.serving_config import ServingConfig

MODELS = sorted(
    {
        c
        for m in (schemas, promotion, engine_config, serving_config)
        for c in vars(m).values()
        if isinstance(c, type) and issubclass(c, StrictModel) and c is not StrictModel
    },
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_every_field_is_described_and_extra_forbidden(cls):
    assert cls.model_config.get("extra") == "forbid"
    for name, field in cls.model_fields.items():
        assert field.description, f"{cls.__name__}.{name} has no description"


def test_unknown_nested_field_named_with_dotted_path(tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("target:\n  model: smollm2\n  tensor_paralel_size: 2\ndraft:\n  source: x\n  num_speculative_tokens: 0\n")
    with pytest.raises(ConfigError) as err:
        load_yaml_config(ServingConfig, f)
    text = str(err.value)
    assert "target.tensor_paralel_size" in text and "correct its spelling" in text
    assert "draft.num_speculative_tokens" in text and "2 problem(s)" in text


def test_wrong_type_and_missing_field():
    with pytest.raises(ConfigError) as err:
        parse_config(schemas.DatagenConfig, {"prompts": "sharegpt", "generation": {"temperature": -1}})
    text = str(err.value)
    assert "prompts" in text and "output_dir" in text and "generation.temperature" in text


def test_tree_needs_enough_nodes():
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        parse_config(schemas.TreeConfig, {"depth": 6, "num_draft_tokens": 3})


def test_yaml_syntax_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml_config(ServingConfig, bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml_config(ServingConfig, tmp_path / "nope.yaml")


def test_defaults_load_from_empty_yaml(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    cfg = load_yaml_config(ServingConfig, f)
    assert cfg.target.model == "smollm2" and cfg.draft is None


def test_set_overrides_apply_before_validation(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("prompts: [sharegpt]\noutput_dir: out\n")
    cfg = load_yaml_config(schemas.DatagenConfig, f, ["generation.max_tokens=7", "limit=3"])
    assert cfg.generation.max_tokens == 7 and cfg.limit == 3
    with pytest.raises(ConfigError, match="generation.max_tokenz"):
        load_yaml_config(schemas.DatagenConfig, f, ["generation.max_tokenz=7"])
    with pytest.raises(ConfigError, match="not FIELD=VALUE"):
        load_yaml_config(schemas.DatagenConfig, f, ["limit"])


@pytest.mark.parametrize(
    "path",
    sorted((__import__("pathlib").Path(__file__).resolve().parents[2] / "jobs" / "configs").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_example_configs_validate(path):
    import yaml

    kind = path.name.split("-")[0]
    cls = {
        "datagen": schemas.DatagenConfig,
        "train": schemas.TrainingConfig,
        "serve": ServingConfig,
        "promote": promotion.PromotionConfig,
        "adapt": promotion.AdaptConfig,
    }.get(kind)
    data = yaml.safe_load(path.read_text())
    if kind == "serve" and "applications" in data:  # a Ray Serve config with eagleray's ServingConfig inside
        from ray.serve.schema import ServeDeploySchema

        ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(
            data
        )
        for app in data["applications"]:
            parse_config(ServingConfig, app["args"]["serving"], source=str(path))
        return
    assert cls is not None, f"{path.name}: unknown config kind {kind!r}"
    load_yaml_config(cls, path)


@pytest.mark.parametrize(
    "train, says",
    [
        ({"max_stepz": 3}, "train.max_stepz"),
        ({"data_dir": "/x"}, "train.data_dir is set by the loop"),
        ({"max_steps": 0}, "train.max_steps"),
    ],
)
def test_adapt_train_fields_are_checked_when_the_config_loads(train, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        parse_config(promotion.AdaptConfig, {"capture_path": "c", "work_dir": "w", "train": train}, prefix="adapt")
