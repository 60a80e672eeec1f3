"""The GPU offload check runs end to end on CPU at tiny size (its timings only mean something on
CUDA; its memory figures, from the memory meter off CUDA, are exact everywhere)."""

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
        model = result["models"][name]
        rows = model["rows"]
        assert set(rows) == set(gpu_offload.configs("0"))
        # Deterministic algorithms on a CPU: the two-run floor is 0, so parity is bit-exact.
        assert model["deterministic"]["on"] and model["noise_floor"] == {"loss": 0.0, "grad": 0.0}
        assert all(row["parity_ok"] and row["bit_exact"] for row in rows.values())
        for label in ("full+offload", "matmuls+offload"):
            assert rows[label]["offloaded_bytes"] > 0
            assert rows[label]["reloaded_bytes"] == rows[label]["offloaded_bytes"]
            # Measured at the end of forward, offload saves exactly what it moved ...
            plain = rows[label.removesuffix("+offload")]
            cut = plain["forward_end_bytes"] - rows[label]["forward_end_bytes"]
            assert cut == rows[label]["offloaded_bytes"], label
        figures = model["layer_input_offload"]
        assert figures["offloaded_bytes"] == rows["full+offload"]["offloaded_bytes"]
        assert figures["forward_end_cut_over_offloaded"] == 1.0
        assert figures["goals"][1]["met"] is True
        # ... while the step's peak, late in backward when full has freed its layer inputs, does not.
        assert figures["step_peak_cut_bytes"] < figures["offloaded_bytes"]
    assert "layer-input offload" in capsys.readouterr().out
