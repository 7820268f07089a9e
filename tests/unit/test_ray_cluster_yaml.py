"""ray_cluster.yaml validates against Ray's own cluster-launcher schema."""

from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import validate_config

CONFIG = Path(__file__).resolve().parents[2] / "ray_cluster.yaml"


def test_cluster_yaml_validates_against_ray_schema():
    cfg = yaml.safe_load(CONFIG.read_text())
    validate_config(cfg)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert any(t["resources"].get("GPU", 0) >= 1 for t in types.values()), "needs a GPU worker type"


def test_schema_check_can_fail():
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["available_node_types"]["gpu_8x"]["not_a_ray_field"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(cfg)
