"""The device-side state a static (CUDA-graph) decode step reads instead of host integers.

A captured CUDA graph replays fixed kernels with fixed arguments: any host integer that changes
from step to step (the new token's position, the pending window's length) must live in device
memory instead. :class:`StaticState` holds those tensors for every layer of a
:class:`~kvcalib.runtime.cache.CompressedCache` in static mode; the driver
(:mod:`kvcalib.runtime.graphs`) refreshes them inside the captured step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StaticState:
    """Device tensors of one static decode step.

    ``position`` (1,) int64: absolute position of the token the step decodes (the layers' ``n_seen``
    before it); the layers write its K/V at ``position - pend_start`` of their pending buffers.
    ``visible`` (B|1, L) bool over absolute positions ``0..L-1``: what the step's query may attend
    (positions after ``position`` are empty buffer slots; padding is False). ``mask_packed``: whether
    the packed tokens need the mask too (only with padding; otherwise they are all visible and the
    kernel skips reading it for them). ``windows``: a sliding-window layer's ``visible``, one per
    window size (:meth:`window_visible`), the positions before ``position - window + 1`` hidden too.
    """

    position: torch.Tensor  # (1,) int64
    visible: torch.Tensor  # (B|1, L) bool
    mask_packed: bool = False
    positions: torch.Tensor | None = None  # (1, L) int64: 0..L-1, to refresh ``visible`` in the graph
    valid: torch.Tensor | None = None  # (B, L) bool padding mask extended with True, or None
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> (B|1, L) bool

    @classmethod
    def create(cls, position: torch.Tensor, length: int, valid: torch.Tensor | None = None) -> "StaticState":
        """State over ``length`` absolute positions; ``valid`` (B, n) bool padding of the first n."""
        dev = position.device
        ext = None
        if valid is not None:
            ext = torch.ones((valid.shape[0], length), dtype=torch.bool, device=dev)  # (B, L)
            ext[:, :valid.shape[1]] = valid
        rows = 1 if ext is None else ext.shape[0]
        state = cls(position=position, visible=torch.zeros((rows, length), dtype=torch.bool, device=dev),
                    mask_packed=ext is not None, positions=torch.arange(length, device=dev)[None], valid=ext)
        state.refresh()
        return state

    def window_visible(self, window: int) -> torch.Tensor:
        """(B|1, L) bool: what a query at ``position`` sees through a sliding window of ``window``
        tokens (``visible`` and ``position - window < j``). Made on first use -- a layer asks when
        it enters static mode, before any capture -- and refreshed with ``visible`` from then on."""
        vis = self.windows.get(window)
        if vis is None:
            vis = torch.empty_like(self.visible)  # (B|1, L)
            self.windows[window] = vis
            self._refresh_window(window, vis)
        return vis

    def _refresh_window(self, window: int, vis: torch.Tensor) -> None:
        torch.logical_and(self.visible, self.positions > self.position - window, out=vis)

    def refresh(self) -> None:
        """Recompute ``visible`` (and each window's) from ``position`` on the device (captured
        with the step)."""
        if self.valid is None:
            torch.le(self.positions, self.position, out=self.visible)
        else:
            torch.logical_and(self.positions <= self.position, self.valid, out=self.visible)
        for window, vis in self.windows.items():
            self._refresh_window(window, vis)
