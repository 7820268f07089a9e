"""`eagleray bench gpu --quick` runs on CPU (tiny random model) and writes its JSON."""

import json

from eagleray.jobs.bench import gpu as bench_gpu


def test_bench_gpu_quick_writes_json(tmp_path):
    out = tmp_path / "gpu.json"
    result = bench_gpu.run(["--quick", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["decode"] == result["decode"]
    variants = {(r["batch"], r["variant"]) for r in data["decode"]}
    assert variants == {(1, "eager"), (1, "engine_eager"), (3, "eager"), (3, "engine_eager")}
    # the no-sync fused step and the engine's paged path pick the same greedy tokens
    assert all(r["token_agreement_vs_graph"] == 1.0 for r in data["decode"] if r["variant"] == "engine_eager")
    assert data["extraction"][0]["aux_layers"] == [1, 2]
