"""Sparse attention with top-k key ids shared across layers: exactness and explicit id dataflow.

A source layer's indexer computes the ids once; consumers receive them as a
keyword input. Under every plan the loss and every gradient are bit-identical
to no checkpointing (``test_parity.py``), the indexer's top-k runs once per source layer (never in a
replay), and a consumer (also when replayed) sees the very tensor its source produced.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from actplan._install.apply import find_layers
from actplan.measure import OpCounter
from actplan.models import sparse
from actplan.models.sparse import SparseDecoderLayer
from helpers import step_and_capture, with_plan

TOPK = torch.ops.aten.topk.default
GATHER = torch.ops.aten.index.Tensor

@pytest.fixture(scope="module")
def tiny():
    return sparse.build("tiny", dropout=0.1)


def test_tiny_has_sources_and_consumers(tiny):
    model, config = tiny
    assert [layer.is_source for layer in model.layers] == [True, False, True, False]
    assert config.index_topk < config.seq_len  # attention is actually sparse
    assert [type(m) for _, m in find_layers(model)] == [SparseDecoderLayer] * config.n_layers


def count_ops(model, config, plan):
    model = with_plan(model, plan)
    with OpCounter() as counter:
        step_and_capture(model, sparse.make_batch(config))
    return counter.counts


@pytest.mark.parametrize("plan", ["full", "matmuls"])
def test_indexer_top_k_runs_once_per_source(plan):
    model, config = sparse.build("tiny")  # no dropout: replays may stop early
    n_sources = sum(layer.is_source for layer in model.layers)
    none = count_ops(model, config, None)
    counts = count_ops(model, config, plan)
    assert none[TOPK] == n_sources == 2
    assert counts[TOPK] == n_sources, f"top-k ran {counts[TOPK]} times for {n_sources} source layers"
    if plan == "full":
        # ...while the layers were replayed: every layer gathers its keys and values again.
        assert counts[GATHER] == 2 * none[GATHER]


class IdRecorder:
    """Records, per layer, the ids each layer returns and every ids its attention sees
    (forward and replays), plus every ids each indexer produces."""

    def __init__(self, model):
        self.returned = {}
        self.seen = {i: [] for i in range(len(model.layers))}
        self.produced = {i: [] for i in range(len(model.layers))}
        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(self._returned(i))
            layer.attn.register_forward_pre_hook(self._seen(i))
            if layer.attn.indexer is not None:
                layer.attn.indexer.register_forward_hook(self._produced(i))

    def _returned(self, i):
        def hook(module, args, output):
            self.returned[i] = output["topk_ids"]

        return hook

    def _seen(self, i):
        def hook(module, args):
            self.seen[i].append(args[2])

        return hook

    def _produced(self, i):
        def hook(module, args, output):
            self.produced[i].append(output[1])

        return hook


@pytest.mark.parametrize("plan", [None, "full", "matmuls", "attn"])
def test_consumers_get_the_source_ids_tensor(tiny, plan):
    model, config = tiny
    model = with_plan(model, plan)
    recorder = IdRecorder(model)
    step_and_capture(model, sparse.make_batch(config))
    for i, layer in enumerate(model.layers):
        source = i - i % config.index_every
        ids = recorder.returned[source]
        assert ids.dtype == torch.int64 and not ids.requires_grad and ids.grad_fn is None
        assert ids.shape == (config.batch_size, config.seq_len, config.index_topk)
        assert recorder.returned[i] is ids
        if layer.is_source:
            assert recorder.seen[i] and all(seen is None for seen in recorder.seen[i])
            # The ids a replay rebuilds are the saved top-k output, not a new top-k.
            first, *replayed = recorder.produced[i]
            assert first is ids
            assert all(r.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr() for r in replayed)
        else:
            assert recorder.seen[i] and all(seen is ids for seen in recorder.seen[i])
        calls = len(recorder.seen[i])
        assert calls == (1 if plan is None else 2), (i, calls)  # forward, plus one replay


def test_ids_are_causal_top_k_of_the_indexer_scores(tiny):
    model, config = tiny
    recorder = IdRecorder(model)
    with torch.no_grad():
        model(**sparse.make_batch(config))
    ids = recorder.returned[0]
    positions = torch.arange(config.seq_len)[:, None]
    # Query i has i + 1 causal keys: min(i + 1, topk) of its picks are causal and distinct.
    causal = ids <= positions
    expected = (torch.arange(config.seq_len) + 1).clamp(max=config.index_topk)
    assert torch.equal(causal.sum(-1), expected.expand(config.batch_size, -1))
    assert all(len(set(row.tolist())) == config.index_topk for row in ids.flatten(0, 1))


def test_sparse_attention_over_every_key_is_causal_attention():
    model, config = sparse.build("tiny", index_topk=16)
    attn = model.layers[1].attn
    gen = torch.Generator().manual_seed(0)
    b, s, hd = config.batch_size, config.seq_len, config.head_dim
    q = torch.randn(b, s, config.n_heads, hd, generator=gen)
    k = torch.randn(b, s, config.n_kv_heads, hd, generator=gen)
    v = torch.randn(b, s, config.n_kv_heads, hd, generator=gen)
    # Every key, in a scrambled order: early queries pick future keys, which must be masked.
    ids = torch.stack([torch.randperm(s, generator=gen) for _ in range(b * s)]).view(b, s, s)
    out = attn.sparse_attention(q, k, v, ids, None)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_layers_check_their_role(tiny):
    model, config = tiny
    h = torch.zeros(1, config.seq_len, config.dim)
    freqs_cis = model.freqs_cis[: config.seq_len]
    ids = torch.zeros(1, config.seq_len, config.index_topk, dtype=torch.int64)
    with pytest.raises(ValueError, match="source layer computes its own topk_ids"):
        model.layers[0](h, freqs_cis=freqs_cis, topk_ids=ids)
    with pytest.raises(ValueError, match="consumer layer needs the topk_ids"):
        model.layers[1](h, freqs_cis=freqs_cis)


def test_config_rejects_bad_index_settings():
    with pytest.raises(ValueError, match="index_topk"):
        sparse.build("tiny", index_topk=17)
    with pytest.raises(ValueError, match="index_every"):
        sparse.build("tiny", index_every=0)
    with pytest.raises(ValueError, match="unknown sparse size"):
        sparse.build("huge")


def test_small_preset_shape():
    config = sparse.PRESETS["small"]
    assert sum(config.is_source(i) for i in range(config.n_layers)) == math.ceil(config.n_layers / 4)
    assert config.index_topk < config.seq_len
