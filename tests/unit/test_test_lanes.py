"""The xdist Ray lane of tests/conftest.py: every module that starts Ray is in it, and it names real files."""

import re
from pathlib import Path

from eagleray.tests.conftest import RAY_LANE

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# what starts a Ray instance in a test module: ray.init, the Serve helpers, `ray start` / `serve run`, the two-node cluster
STARTS_RAY = re.compile(
    r"ray\.init\(|start_local\(|init_ray_with_metrics\(|head_command\(|\bSERVE\b|two_nodes|eagleray\"\),\s*\"quickstart\""
)


def test_every_lane_file_exists_once():
    assert len(RAY_LANE) == len(set(RAY_LANE)), RAY_LANE
    missing = [p for p in RAY_LANE if not (REPO / p).is_file()]
    assert not missing, missing


def test_every_module_that_starts_ray_is_in_a_lane():
    laned = set(RAY_LANE)
    starts = {
        str(p.relative_to(REPO))
        for p in TESTS.rglob("test_*.py")
        if "gpu" not in p.parts and STARTS_RAY.search(p.read_text()) and p.name != Path(__file__).name
    }
    assert starts - laned == set(), f"modules that start Ray outside RAY_LANE: {sorted(starts - laned)}"
