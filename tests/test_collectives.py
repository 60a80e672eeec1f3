"""Collectives on the roofline clock: the cost of each kind on a link, the streams that decide
what the compute waits for, which link a group runs on, and the bytes the clock counts for
the collectives a rank's step on the fake process group runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from actplan.measure import accelerator
from actplan.measure._collectives import Collective, Streams, collective_seconds, spans_nodes
from actplan.models import build_for_shape
from actplan.models.shape import Shape
from actplan.planning._rank_step import rank_step

GB = 1e9


@pytest.mark.parametrize(
    "kind,factor",
    [
        (Collective.ALL_GATHER, 7 / 8),
        (Collective.REDUCE_SCATTER, 7 / 8),
        (Collective.ALL_REDUCE, 2 * 7 / 8),
        (Collective.ALL_TO_ALL, 7 / 8),
    ],
)
def test_each_collective_costs_its_algorithms_share_of_the_bytes(kind, factor):
    # 8 ranks, 1 GB counted, a 100 GB/s link: ring and pairwise algorithms move (n-1)/n of it.
    assert collective_seconds(kind, int(GB), 8, 100 * GB) == pytest.approx(factor / 100)
    assert collective_seconds(kind, int(GB), 1, 100 * GB) == 0.0
    with pytest.raises(ValueError, match="positive link"):
        collective_seconds(kind, 1, 2, 0.0)


def test_a_group_spans_nodes_when_its_ranks_sit_in_more_than_one():
    assert not spans_nodes([0, 1, 2, 7], 8)
    assert spans_nodes([0, 8], 8)
    assert spans_nodes([3, 4], 4)


def test_an_all_gather_hides_behind_the_unit_before_it():
    streams = Streams()
    streams.gather(1.0)  # the first unit's: nothing ran before it
    streams.compute(5.0)
    streams.gather(4.0)  # issued when the first unit started computing: done by 1 + 4 < 6
    streams.compute(5.0)
    assert streams.end == 11.0 and streams.exposed == 1.0
    streams.gather(7.0)  # starts at 6 (the unit before started), done at 13: waits 2
    assert streams.end == 13.0 and streams.waits == [1.0, 2.0]


def test_reduce_scatters_run_beside_the_compute_until_the_step_ends():
    streams = Streams()
    streams.compute(2.0)
    streams.reduce(1.0)  # 2..3, hidden by the next compute
    streams.compute(2.0)
    streams.reduce(3.0)  # 4..7: the step ends when it does
    assert streams.end == 7.0 and streams.exposed == 3.0
    streams.blocking(0.5)  # tensor parallelism's: in the compute's path
    assert streams.compute_seconds == 4.0 and streams.blocking_seconds == 0.5
    assert streams.end == 7.0


def test_a_reload_hides_behind_the_compute_between_its_request_and_its_use():
    streams = Streams()
    streams.compute(1.0)
    out = streams.copy_out(3.0)  # issued at 1 (its tensor exists), beside the compute: ends at 4
    streams.compute(5.0)  # forward goes on to 6
    back = streams.copy_in(2.0, out)  # asked for at 6: ends at 8
    streams.compute(1.0)  # the backward of the layer after it: to 7
    streams.use(back)  # the compute reads it at 7, waits 1
    assert streams.end == 8.0 and streams.exposed == streams.exposed_copies == 1.0
    late = streams.copy_in(2.0, streams.copy_out(10.0))  # out 8..18, in 18..20: nothing hides it
    streams.use(late)
    assert streams.end == 20.0 and streams.exposed_copies == 13.0


SHAPE = Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128, seq=32, batch=2, dtype="fp32")


def test_the_clock_counts_the_bytes_fsdps_collectives_move():
    # FSDP 2, layers resharded after forward (the root not): forward gathers every group, backward
    # the layers again; every group's gradients are reduce-scattered once. Counted from the model
    # alone: fp32 parameters and gradients, every dimension here divides by 2 (no padding).
    with torch.device("meta"):
        model = build_for_shape(SHAPE).model
    layer_bytes = [sum(p.numel() for p in layer.parameters()) * 4 for layer in model.layers]
    root_bytes = sum(p.numel() for p in model.parameters()) * 4 - sum(layer_bytes)
    ran = rank_step(SHAPE, "full", 2, "h100")
    assert ran.collective_bytes == {
        "all-gather": root_bytes + 2 * sum(layer_bytes),
        "reduce-scatter": root_bytes + sum(layer_bytes),
    }
    assert 0 < ran.exposed_comm_seconds < ran.seconds


def test_tensor_parallel_collectives_are_in_the_compute_path():
    # Without FSDP, every collective is tensor parallelism's and the compute waits for all of
    # it: what it waits for is each kind's bytes at the ring cost on the node's link (2 ranks).
    tp = rank_step(SHAPE, "full", 1, "h100", tp=2)
    assert set(tp.collective_bytes) >= {"all-gather", "reduce-scatter"}
    link = accelerator("h100").intra_node_bytes_per_s
    waited = sum(collective_seconds(Collective(kind), n, 2, link) for kind, n in tp.collective_bytes.items())
    assert tp.exposed_comm_seconds == pytest.approx(waited, rel=1e-9)


def test_groups_across_nodes_run_on_the_network():
    # dp 2 x tp 2 on nodes of 2 GPUs: TP's groups ([0, 1]) stay in a node, FSDP's ([0, 2]) span
    # two, so only FSDP's collectives slow down, by the links' ratio.
    h100 = accelerator("h100")
    one_node = rank_step(SHAPE, "full", 2, h100, tp=2)
    two_nodes = rank_step(SHAPE, "full", 2, replace(h100, gpus_per_node=2), tp=2)
    assert two_nodes.collective_bytes == one_node.collective_bytes
    assert two_nodes.seconds > one_node.seconds
    tp_only = rank_step(SHAPE, "full", 1, replace(h100, gpus_per_node=1), tp=2)
    assert tp_only.exposed_comm_seconds == pytest.approx(
        rank_step(SHAPE, "full", 1, h100, tp=2).exposed_comm_seconds * h100.intra_node_bytes_per_s
        / h100.inter_node_bytes_per_s
    )
