"""The device-side state a static (CUDA-graph) decode step reads instead of host integers.

A captured CUDA graph replays fixed kernels with fixed arguments: any host integer that changes
from step to step (the new token's position, the pending window's length) must live in device
memory instead. :class:`StaticState` holds those tensors for every layer of a
:class:`~kvcalib.runtime.cache.CompressedCache` in static mode; the driver
(:mod:`kvcalib.runtime.graphs`) refreshes them inside the captured step.

Padded batches: a ragged layer (:attr:`~kvcalib.runtime.cache.CompressedLayer.rows`) keeps one
unpadded layer per row, whose positions count from the row's first real token. Each such row
reads a *child* state (:meth:`StaticState.child`): the same step, its position shifted by the
row's offset, refreshed with its parent inside the captured step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StaticState:
    """Device tensors of one static decode step.

    ``position`` (1,) int64: position of the token the step decodes (the layers' ``n_seen`` before
    it); the layers write its K/V at ``position - pend_start`` of their pending buffers.
    ``visible`` (1, L) bool over positions ``0..L-1``: what the step's query may attend (positions
    after ``position`` are empty buffer slots). A static layer holds no padding (a padded row is a
    layer of its own, reading a :meth:`child` state), so nothing else is hidden. ``windows``: a
    sliding-window layer's ``visible``, one per window size (:meth:`window_visible`), the
    positions before ``position - window + 1`` hidden too.
    """

    position: torch.Tensor  # (1,) int64
    visible: torch.Tensor  # (1, L) bool
    positions: torch.Tensor | None = None  # (1, L) int64: 0..L-1, to refresh ``visible`` in the graph
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> (1, L) bool
    children: dict[int, "StaticState"] = field(default_factory=dict)  # row offset -> the row's state

    @classmethod
    def create(cls, position: torch.Tensor, length: int) -> "StaticState":
        """State over ``length`` positions, the step's token at ``position`` ((1,) int64, device)."""
        dev = position.device
        state = cls(position=position, visible=torch.zeros((1, length), dtype=torch.bool, device=dev),
                    positions=torch.arange(length, device=dev)[None])
        state.refresh()
        return state

    def child(self, offset: int) -> "StaticState":
        """The state of a row whose first real token sits at ``offset``: position ``position -
        offset``, the same length. Made on first use (a layer asks when it enters static mode,
        before any capture) and refreshed with this state from then on; rows of every layer with
        the same offset share it."""
        state = self.children.get(offset)
        if state is None:
            state = StaticState(position=self.position - offset, visible=torch.empty_like(self.visible),
                                positions=self.positions)
            state.refresh()
            self.children[offset] = state
        return state

    def window_visible(self, window: int) -> torch.Tensor:
        """(1, L) bool: what a query at ``position`` sees through a sliding window of ``window``
        tokens (``visible`` and ``position - window < j``). Made on first use -- a layer asks when
        it enters static mode, before any capture -- and refreshed with ``visible`` from then on."""
        vis = self.windows.get(window)
        if vis is None:
            vis = torch.empty_like(self.visible)  # (1, L)
            self.windows[window] = vis
            self._refresh_window(window, vis)
        return vis

    def _refresh_window(self, window: int, vis: torch.Tensor) -> None:
        torch.logical_and(self.visible, self.positions > self.position - window, out=vis)

    def refresh(self) -> None:
        """Recompute ``visible`` (and each window's, and each child's) from ``position`` on the
        device (captured with the step)."""
        torch.le(self.positions, self.position, out=self.visible)
        for window, vis in self.windows.items():
            self._refresh_window(window, vis)
        for offset, state in self.children.items():
            torch.sub(self.position, offset, out=state.position)
            state.refresh()
