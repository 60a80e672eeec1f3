"""One rank of ``tests/test_torchtitan_tp.py``: torchtitan 0.3's own tensor parallelism with
``ActplanAC``; launched by torchrun on gloo/CPU.

    torchrun --standalone --nproc-per-node 2 tests/dist/titan_tp_worker.py MODELS MESH PLANS.json OUT.json

MODELS is a comma-separated list of ``llama3`` and ``deepseek_v3`` (``test_torchtitan``'s tiny
models, SDPA standing in for FlexAttention); MESH is ``tp2`` (2 ranks: one tensor-parallel pair)
or ``dp2tp2`` (4 ranks: FSDP2 over two pairs; deepseek_v3's routed experts also split over 2
ranks, EP=2). PLANS.json maps a model to more configs by name (``planner``: what
``helpers.titan.planner_config`` made), or is ``-``.

Each config builds the model afresh with torchtitan's sharding config (sequence parallel on) and
runs it through torchtitan's own ``parallelize_llama`` / ``parallelize_deepseekv3``: tensor (and
expert) parallelism, then ``ActplanAC`` as the activation checkpointing (none for ``none``), then
FSDP2. The backend is torchtitan's ``partial_dtensor`` (DTensor on the model-parallel axes). Its
default, ``spmd_types``, keeps plain tensors, and torch 2.13's ``fully_shard`` refuses those on a
mesh of more than one rank (with ``dp_mesh_dims`` it wants DTensor parameters). The loss is
torchtitan's ``cross_entropy_loss``, vocabulary-parallel over the pair.

One step per config on this rank's data. The rank compares its loss and every local gradient
shard with the ``none`` run's, bit for bit, counts the collectives at the dispatcher in forward
and in backward, and measures activation bytes with ``MemoryMeter``. ``none`` runs twice (the
noise floor). A config that raises is recorded with its error, and the next one runs. Rank 0
writes every rank's findings to OUT.json.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE, HERE.parent):  # tp_worker's checks; the tiny models in tests/helpers
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from tp_worker import bit_compare, collectives  # noqa: E402

import actplan  # noqa: E402
from actplan.measure import MemoryMeter, OpCounter  # noqa: E402
from helpers.titan import MIXED, TitanLoss, build_decoder, decoder_config  # noqa: E402
from helpers.titan import tp_batch as make_batch  # noqa: E402

PRESETS = {
    "full": "full",
    "full+save_collectives": {"preset": "full", "save_collectives": True},
    "attn": "attn",
    "matmuls": "matmuls",
    "megatron-selective": "megatron-selective",
    "mixed": MIXED,  # test_torchtitan's planner-shaped mix: a full layer, kept units, offload
}


def titan_parallelize(kind: str, dims, parallelism, ac_config) -> nn.Module:
    """The tiny model as torchtitan's trainer parallelizes it: sharding config set, then its
    ``parallelize_*`` (TP/EP, the AC, FSDP2)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig

    config = decoder_config(kind)
    if kind == "llama3":
        from torchtitan.models.llama3.parallelize import parallelize_llama as parallelize_fn
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=True)
    else:
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3 as parallelize_fn
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        set_deepseek_v3_sharding_config(config, enable_sp=True, enable_ep=dims.ep > 1)
    decoder = parallelize_fn(
        build_decoder(kind, config),
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=ac_config,
        dump_folder="",
    )
    # torchtitan turns FSDP's gradient division off (it scales by the global token count),
    # which makes FSDP reduce with PREMUL_SUM(1.0): gloo has no PREMUL_SUM, so plain SUM.
    for module in decoder.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return TitanLoss(decoder)


def one_step(model: nn.Module, batch: dict) -> dict:
    forward_ops, backward_ops = OpCounter(), OpCounter()
    with warnings.catch_warnings():
        # torchtitan's router asks for fp32 CPU autocast, which torch declines with a warning.
        warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported")
        with MemoryMeter(model) as meter:
            with forward_ops:
                loss = model(**batch)
            at_forward_end = meter.mark("forward_end")
            with backward_ops:
                loss.backward()
    return {
        "loss": loss.detach().clone(),
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "forward_collectives": collectives(forward_ops),
        "backward_collectives": collectives(backward_ops),
        "activation_bytes_at_forward_end": at_forward_end.activation_bytes,
        "peak_live_bytes": meter.report().peak_live_bytes,
    }


def scenario(kind: str, mesh: str, extra: dict) -> dict:
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import utils as dist_utils

    from actplan.torchtitan import ActplanAC

    world = dist.get_world_size()
    parallel_dims.device_type = "cpu"  # its meshes default to the accelerator
    dist_utils.set_spmd_backend("partial_dtensor")
    parallelism = ParallelismConfig(
        spmd_backend="partial_dtensor",
        tensor_parallel_degree=2,
        data_parallel_shard_degree=world // 2,
        expert_parallel_degree=2 if kind == "deepseek_v3" and mesh == "dp2tp2" else 1,
    )
    dims = parallel_dims.ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    batch = make_batch(dp_rank)
    configs = {"none": None, "none-again": None, **PRESETS, **extra}
    results, none_run = {}, None
    for name, config in configs.items():
        started = time.perf_counter()
        entry: dict = {}
        model = run = None
        try:
            if config is None:
                ac = None
            elif isinstance(config, str):
                ac = ActplanAC.Config(plan=config)
            else:
                ac = ActplanAC.Config(recompute_config=config)
            model = titan_parallelize(kind, dims, parallelism, ac)
            entry["dtensor_params"] = sum(isinstance(p, DTensor) for p in model.parameters())
            entry["expert_meshes"] = sorted(
                {
                    "x".join(p.device_mesh.mesh_dim_names or ())
                    for n, p in model.named_parameters()
                    if "routed_experts" in n and isinstance(p, DTensor)
                }
            )
            plan = actplan.lowlevel.installed_plan(model.decoder) if ac is not None else None
            entry["modes"] = [layer.mode for layer in plan.layers] if plan is not None else []
            run = one_step(model, batch)
            entry.update({key: value for key, value in run.items() if key not in ("loss", "grads")})
            entry["loss"] = run["loss"].item()
            if none_run is None:
                none_run = run
            else:
                entry["vs_none"] = bit_compare(none_run, run)
            engine = actplan.lowlevel.installed_plan(model.decoder).offload_engine if ac is not None else None
            if engine is not None:
                entry["offloaded_bytes"] = engine.stats.bytes_offloaded
                entry["reloaded_bytes"] = engine.stats.bytes_reloaded
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"
            entry["traceback"] = traceback.format_exc()[-4000:]
        entry["seconds"] = time.perf_counter() - started
        results[name] = entry
    return results


def main() -> None:
    faulthandler.enable()
    models, mesh, plans_path, out_path = sys.argv[1:5]
    plans = json.loads(Path(plans_path).read_text()) if plans_path != "-" else {}
    dist.init_process_group("gloo")
    started = time.perf_counter()
    findings: dict = {"rank": dist.get_rank(), "results": {}}
    for kind in models.split(","):
        findings["results"][kind] = scenario(kind, mesh, plans.get(kind, {}))
    findings["seconds"] = time.perf_counter() - started
    from ranks import write_gathered  # (here: the pytest process imports this file too)

    write_gathered(findings, out_path)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    from ranks import leave

    leave()
