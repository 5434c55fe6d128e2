"""CUDA-graph memory pools outlive the graphs that drop out between captures.

torch refuses a capture into a shared pool that no live graph uses (``use_count > 0`` assert in
the caching allocator). Both graph drivers keep the last graph they drop alive until the next
capture holds the pool: ``GraphDecoder`` across flush periods (a padded batch's rows flush at
different steps, so a period can end before it captured anything: the H100 run of
tests/kernels/test_graph_padding.py hit the assert), ``LayerGraphs`` per device. CPU: the
bookkeeping, with stand-in graph objects (the captures themselves run on the GPU grid)."""

from __future__ import annotations

import torch

from kvcalib.runtime.graphs import GraphDecoder
from kvcalib.runtime.layer_graphs import LayerGraphs, _Captured, _Device


class _Layer:
    """What LayerGraphs reads of a layer when dropping its graph."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graph_entry = None
        self.graph_owned = False


def _entry(graph) -> _Captured:
    return _Captured(graph, (), torch.zeros(1), ())


def test_graph_decoder_keeps_the_last_graph_across_periods_that_capture_nothing():
    decoder = object.__new__(GraphDecoder)  # the period bookkeeping only (no model)
    first = object()
    decoder._graph, decoder._retired = first, None
    decoder._retire()  # a flush ends the period whose graph was `first`
    assert decoder._graph is None and decoder._retired is first
    decoder._retire()  # another row flushes after the next period's eager step: nothing captured
    assert decoder._retired is first, "the pool's last graph was dropped before the next capture"
    second = object()
    decoder._graph = second
    decoder._retire()
    assert decoder._retired is second


def test_layer_graphs_keep_a_dropped_graph_until_the_next_capture_or_the_last_release():
    dev = torch.device("cpu")
    graphs = LayerGraphs()
    graphs.devices[dev] = _Device(torch.zeros(1, dtype=torch.long), pool=("pool",))
    a, b = _Layer(dev), _Layer(dev)
    ga, gb = object(), object()
    a.graph_entry, b.graph_entry = _entry(ga), _entry(gb)
    graphs._drop(a)  # a new period of layer a
    assert a.graph_entry is None and graphs.devices[dev].retired is ga
    graphs._drop(b)  # then b's: b's graph now keeps the pool (a's may go)
    assert graphs.devices[dev].retired is gb and graphs.devices[dev].pool == ("pool",)
    graphs._drop(a)  # nothing to drop: the retired graph stays
    assert graphs.devices[dev].retired is gb
    graphs.release(b)  # no layer owned any more: a fresh pool next time, nothing kept
    assert graphs.devices[dev].pool is None and graphs.devices[dev].retired is None
