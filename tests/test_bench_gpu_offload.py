"""The GPU offload check runs end to end on CPU at tiny size (its figures only mean something on CUDA)."""

import json

import pytest

from bench.gpu import offload as gpu_offload


@pytest.mark.slow
def test_gpu_offload_script_smoke_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "gpu_offload.json"
    args = ["--device", "cpu", "--size", "tiny", "--min-bytes", "0", "--repeats", "1", "--warmup", "0"]
    assert gpu_offload.main([*args, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["bandwidth_bytes_per_s"]) == {"device_to_host", "host_to_device"}
    for name in ("dense", "moe"):
        rows = result["models"][name]["rows"]
        assert set(rows) == set(gpu_offload.configs("0"))
        assert all(row["loss_identical"] for row in rows.values())
        assert all(row["grad_norm_rel_diff"] < 1e-6 for row in rows.values())
        for label in ("full+offload", "matmuls+offload"):
            assert rows[label]["offloaded_bytes"] > 0
            assert rows[label]["reloaded_bytes"] == rows[label]["offloaded_bytes"]
        figures = result["models"][name]["layer_input_offload"]
        assert figures["offloaded_bytes"] == rows["full+offload"]["offloaded_bytes"]
    assert "layer-input offload" in capsys.readouterr().out
