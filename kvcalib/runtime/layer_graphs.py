"""Eager decode steps with each layer's compressed attention replayed from its own CUDA graph.

Plain ``model.generate(past_key_values=CompressedCache)`` on a small model is bound by host work:
a compressed attention call (argument preparation, two Triton launches, partial buffers, the
window write) costs ~390 us of host time per layer and step against ~90 us for bf16 SDPA over a
DynamicCache (``artifacts/bench/profile_eager_h100.md``). :class:`LayerGraphs` keeps the model
eager and makes each layer's attention one graph replay instead: the step's token written into
the pending buffer and the fused attention over the layer, captured once per flush period.

How it rides on static mode (:mod:`kvcalib.runtime.static`): on a decode step (one token per row)
a layer that can enter static mode does, under one :class:`~kvcalib.runtime.static.StaticState`
shared by the layers that do (one per device, for a model split over GPUs). The step's position
is set on the device once per step (by the first such layer) and the layer then runs a static step: the token written at its device slot,
the kernel over the whole pending buffer under the device visibility mask -- the computation a
dynamic step makes (``cache.py``'s docstring; the CPU tests check the logits bit for bit). Right
after, still in the layer's turn, the host bookkeeping a dynamic step does: the token counted
(:meth:`~kvcalib.runtime.cache.CompressedLayer.advance_static`) and the layer flushed when due,
so the cache is consistent after every step, whoever looks at it.

Per layer and flush period one capture, on a side stream: a layer's very first static step runs
eagerly (it compiles what is new) and is captured after it; from then on each period's first
step is captured before it runs (capture records, it runs nothing) and replayed like the rest:
the step's query, key and value copied into the graph's input buffers, one replay. A capture
that fails (a kernel variant not compiled yet) runs that step eagerly and captures after it; a
second failure turns capture off for the cache, with a warning. A flush changes the packed store
and the pending buffer's contents' positions: a *stable-launch* layer (most layers of a dense
model: :attr:`~kvcalib.runtime.cache.CompressedLayer.stable_launch`) reads both from the device,
is flushed in place and keeps its graph until its packed store is reallocated (every ~1/8 of the
context: one capture per layer for a 6k prompt and 128 new tokens, where it was one per flush:
SmolLM2-135M kivi-2 150 -> 30 captures, 0.10 -> 0.02 s of host time a call, H100); any other
layer leaves static mode at a flush and its graph is dropped; the next step captures anew. All graphs share one memory pool: they are replayed one
after the other on one stream, and a graph's output is read (by the layer's output projection)
before any other graph runs again.

Layers that cannot run static stay dynamic, layer by layer: a 16-bit layer, sinks still filling,
a layer the kernel does not cover, a prompt (many tokens per row). ``mode``: ``"auto"`` (the
default: on for CUDA tensors on the Triton backend, ``KVCALIB_LAYER_GRAPHS=0`` turns it off),
``"off"``, or ``"eager"`` (the same static steps without capture: the CPU tests, under Triton's
interpreter, and the check that a graph changes nothing).
"""

from __future__ import annotations

import gc
import os
import time
import weakref
import warnings
from dataclasses import dataclass

import torch

from kvcalib.errors import KvcalibError
from kvcalib.runtime.static import StaticState

MODES = ("auto", "off", "eager")
STATE_SLACK = 2048  # positions a new shared state spans beyond what the layers need now (fewer rebuilds)


@dataclass
class _Device:
    """What the static layers of one device share: the step's state, its position, the graphs'
    memory pool and the capture stream (a model split over GPUs has one of each per GPU)."""

    position: torch.Tensor  # (1,) int64: the step's token position
    state: StaticState | None = None
    step_position: int = -1  # host copy of ``position`` (-1: not set for this state)
    pool: tuple | None = None  # the graphs' shared memory pool
    # the last graph dropped since the last capture: torch refuses a capture into a pool no live
    # graph uses (assert use_count > 0), so the pool's last graph lives until the next capture
    retired: torch.cuda.CUDAGraph | None = None
    stream: torch.cuda.Stream | None = None  # capture stream


@dataclass
class _Captured:
    """One layer's graph for its current flush period, with its fixed inputs and output."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple  # the graph's query (B, Hq, 1, D), key (B, H, 1, D) and value (B, H, 1, D)
    out: torch.Tensor  # (B, 1, Hq, D)
    period: tuple  # what the graph baked in (see LayerGraphs._period)


class LayerGraphs:
    """Per-layer static steps (and graphs) for the eager decode steps over one CompressedCache."""

    def __init__(self, mode: str = "auto") -> None:
        if mode not in MODES:
            raise KvcalibError(f"layer_graphs={mode!r} is not known: use one of {', '.join(MODES)}.")
        self.mode = mode
        self.devices: dict[torch.device, _Device] = {}  # per device: shared state, pool, stream
        self.captures = 0  # graphs captured (tests, benchmarks)
        self.replays = 0  # layer steps replayed from a graph
        self.eager_steps = 0  # layer steps run static without a graph (a layer's first, or mode "eager")
        # host seconds outside replays: eager static steps, captures, flushes (benchmarks)
        self.seconds = {"eager": 0.0, "capture": 0.0, "flush": 0.0}
        self._enabled: bool | None = None  # decided on the first decode step
        # the layers in static mode through this object; weak, so that a dropped cache's layers
        # (and their graphs) go with its last reference, not with a later garbage collection
        self._owned = weakref.WeakSet()

    # ------------------------------------------------------------------ policy
    def enabled(self, key_states: torch.Tensor) -> bool:
        """Whether decode steps on ``key_states``' device run static (decided once per cache)."""
        if self._enabled is None:
            from kvcalib.accel import interpreting, triton_chosen

            if self.mode == "off" or os.environ.get("KVCALIB_LAYER_GRAPHS", "1").strip() == "0":
                self._enabled = False
            elif self.mode == "eager":
                self._enabled = triton_chosen(key_states) and (key_states.is_cuda or interpreting())
            else:
                self._enabled = key_states.is_cuda and triton_chosen(key_states)
        return self._enabled

    @property
    def capturing(self) -> bool:
        return self.mode == "auto"

    # ------------------------------------------------------------------ update side
    def take(self, layer, key_states: torch.Tensor) -> bool:
        """At ``layer.update``: whether this step of ``layer`` runs static (then nothing is stored
        yet: :meth:`attend` writes the token). Enters static mode when the layer can; leaves it on
        a prompt."""
        owned = layer.graph_owned
        if key_states.shape[-2] != 1:
            if owned:
                self.release(layer)
            return False
        if not owned:
            if layer.graph_refused or not self.enabled(key_states):
                return False
            why = layer.static_blocker()
            if why is not None:
                if layer.rows is None and not layer.cfg.compressed:
                    layer.graph_refused = why  # never changes: do not ask again
                return False
            self._enter(layer)
        dev = self.devices[layer.device]
        if layer.n_seen != dev.step_position:  # the first static layer of this step (on this device)
            dev.position.fill_(layer.n_seen)
            dev.state.refresh()
            dev.step_position = layer.n_seen
        return True

    def _enter(self, layer) -> None:
        """Static mode for ``layer`` under the shared state (a longer state when it needs one)."""
        need = layer.static_length()
        dev = self.devices.get(layer.device)
        if dev is None:
            dev = self.devices[layer.device] = _Device(torch.zeros((1,), dtype=torch.long, device=layer.device))
        if dev.state is None or dev.state.visible.shape[1] < need:
            dev.state = StaticState.create(dev.position, need + STATE_SLACK)
            dev.step_position = -1
            for other in list(self._owned):  # they read the old state's masks: move them over
                if other.device == layer.device:
                    self._drop(other)
                    other.make_static(dev.state)
        layer.make_static(dev.state)
        layer.graph_owned = True
        self._owned.add(layer)

    def release(self, layer) -> None:
        """``layer`` back to dynamic mode (its graph dropped); its held tokens stay as they are."""
        self._drop(layer)
        if layer.graph_owned:
            layer.graph_owned = False
            self._owned.discard(layer)
            layer.make_dynamic()
        if not self._owned:
            for dev in self.devices.values():
                dev.pool = dev.retired = None  # no layer captures into it any more: a fresh pool next time

    def _drop(self, layer) -> None:
        """Drop ``layer``'s graph, kept as the device's retired graph until the next capture."""
        entry = layer.graph_entry
        if entry is not None and layer.device in self.devices:
            self.devices[layer.device].retired = entry.graph
        layer.graph_entry = None

    def release_all(self) -> None:
        for layer in list(self._owned):
            self.release(layer)

    # ------------------------------------------------------------------ attention side
    def attend(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               softcap: float | None) -> torch.Tensor | None:
        """The static step of ``layer``: write ``key``/``value`` (B, H, 1, D), attend with ``query``
        (B, Hq, 1, D); (B, 1, Hq, D) in the query's dtype, then the step's bookkeeping and flush.
        None when the kernel does not cover the layer: it then leaves static mode, has taken the
        token in as a dynamic update would, and the caller attends dynamically."""
        entry = layer.graph_entry
        stable = layer.static_mask is not None  # its graph outlives flushes (cache.py: stable_launch)
        if entry is not None and entry.period != self._period(layer, query):
            self._drop(layer)  # a new period (or the store was reallocated)
            entry = None
        inputs_set = False  # whether the graph's input buffers hold this step's q/k/v already
        if entry is None and layer.graph_warm and self.capturing:
            # a layer that ran a static step before has its kernels compiled: capture this
            # period's graph straight away and replay it (capture records, it runs nothing; its
            # inputs are this step's q/k/v, copied in by the capture); not on a period's last
            # step unless the graph outlives the flush after it
            if (stable or not layer.flush_due(ahead=1)) and _unsupported(layer, query) is None:
                entry = self._capture(layer, query, key, value, scaling, softcap)
                inputs_set = entry is not None
        if entry is not None:
            if not inputs_set:  # one launch for the three copies (host time is what a step is short of)
                torch._foreach_copy_(entry.inputs, (query, key, value))
            entry.graph.replay()
            self.replays += 1
            out = entry.out
        else:
            why = _unsupported(layer, query)
            if why is not None:
                layer.graph_refused = why
                self.release(layer)
                layer.update(key, value)  # dynamic: counted and held for commit, as update does
                return None
            from kvcalib.runtime.backend import decode_attention

            t0 = time.perf_counter()
            self._drop(layer)
            self.eager_steps += 1
            layer._update_static(key, value)
            out = decode_attention(query, layer, None, scaling, softcap, path="static")
            layer.graph_warm = True
            self.seconds["eager"] += time.perf_counter() - t0
            if self.capturing and (stable or not layer.flush_due(ahead=1)):
                self._capture(layer, query, key, value, scaling, softcap)
        layer.advance_static()
        if layer.flush_due():
            t0 = time.perf_counter()
            if stable:  # flushed in place, in static mode: the graph reads the new counts from the device
                layer.flush()
                if not layer.stable_launch:  # grown past STABLE_LAUNCH_MAX_WORK: a graph per period from here
                    self.release(layer)
            else:
                self.release(layer)
                layer.flush()
            self.seconds["flush"] += time.perf_counter() - t0
        return out

    def _period(self, layer, query: torch.Tensor) -> tuple:
        """What a graph of ``layer`` baked in that a step can change: the flush count (through
        ``pend_start``), the shared state, the batch's shape. A stable-launch layer's graph reads
        the counts from the device: only its packed store's allocation counts (a reallocation,
        about every 1/8 of the context, or the first tokens packed)."""
        if layer.joint_static:  # a padded batch's rows joined (joint.py): until they are joined anew
            return ("joint", layer.joint.build_id, id(layer.static), query.shape, query.dtype)
        if layer.static_mask is not None:
            store = layer.packed.stores[0]
            # read whole: the same launch until a reallocation; else (a store allocated before the
            # capacity rule, restored) exact views, a new launch per flush
            where = store.generation if store.capacity_view() is not None else (None, layer.pend_start)
            return ("stable", where, id(layer.static), query.shape, query.dtype)
        return (layer.pend_start, id(layer.static), query.shape, query.dtype)

    def _capture(self, layer, query, key, value, scaling, softcap) -> _Captured | None:
        """Capture ``layer``'s static step on a side stream (inputs copied from this step's);
        None when the capture fails (then this step runs eagerly; a layer that fails after its
        kernels ran once turns capture off for the cache, with a warning)."""
        from kvcalib.runtime.backend import decode_attention

        t0 = time.perf_counter()
        dev = self.devices[layer.device]
        q_in, k_in, v_in = query.clone(), key.clone(), value.clone()  # the graph's inputs, outside its pool
        graph = torch.cuda.CUDAGraph()
        if dev.stream is None:
            dev.stream = torch.cuda.Stream(query.device)
        main = torch.cuda.current_stream(query.device)
        stream = dev.stream
        stream.wait_stream(main)
        # no garbage collection while capturing: a collected CUDAGraph (an old cache's, freed
        # through a reference cycle) is destroyed on the spot, which a capture in progress does not
        # permit (it invalidated captures in the passkey evaluation, H100)
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(stream):
                # the low-level calls, not torch.cuda.graph(): that one synchronises the device and
                # empties the allocator's cache on entry, a stall per layer and period
                graph.capture_begin(pool=dev.pool)
                try:
                    layer._update_static(k_in, v_in)
                    out = decode_attention(q_in, layer, None, scaling, softcap, path="static")
                finally:
                    graph.capture_end()
        except Exception as err:  # noqa: BLE001 -- any capture failure: decode on without graphs
            main.wait_stream(stream)
            # a failed capture can leave the allocator recording into its pool on its stream
            # ("already recording to mempool_id" at the next capture): the next capture takes a
            # new pool and a new stream
            dev.pool, dev.stream, dev.retired = None, None, None
            if layer.graph_retried:  # failed again after an eager step compiled everything: give up
                self.mode = "eager"
                warnings.warn(f"kvcalib: capturing layer {layer.layer_idx}'s attention in a CUDA graph failed "
                              f"({type(err).__name__}: {err}); eager decode steps go on without layer graphs",
                              stacklevel=4)
            layer.graph_retried = True
            layer.graph_warm = False  # e.g. a kernel variant not compiled yet: the next try runs it first
            return None
        finally:
            if collecting:
                gc.enable()
        main.wait_stream(stream)
        dev.pool = graph.pool()
        dev.retired = None  # the new graph holds the pool now
        self.captures += 1
        layer.graph_entry = _Captured(graph, (q_in, k_in, v_in), out, self._period(layer, query))
        self.seconds["capture"] += time.perf_counter() - t0
        return layer.graph_entry


def _unsupported(layer, query: torch.Tensor) -> str | None:
    """Why the kernel cannot run ``layer``'s static step (None: it can); a ragged layer asks its
    first row with one row of the query."""
    from kvcalib.runtime.triton_path import _reason_unsupported

    if layer.rows is not None:
        return _reason_unsupported(query[:1], layer.rows[0])
    return _reason_unsupported(query, layer)
