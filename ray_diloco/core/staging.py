"""Where the exchange meets the training device: the copies between a GPU and host memory,
kept off the training stream and the training thread.

Streaming DiLoCo (arXiv 2501.18512, section 2) overlaps the exchange with training; on a GPU
that only holds if the copies to and from host memory overlap too. With a
:class:`DeviceStaging` on a CUDA device, ``core.sync.FragmentSync`` keeps a device copy of every
global fragment (fp32, +4 bytes per parameter of device memory) and:

* at a send, computes the pseudo-gradient ``global - local`` on the device (the training
  stream: one subtraction kernel per parameter) and hands it to the link thread
  (:meth:`DeviceStaging.hand_off`: an event on the training stream); the link thread
  (``runtime/link.py``) makes the side stream wait for that event and there adds the
  error-feedback residual (kept on the device), quantises (``core.quantize.encode_tensor``, the
  same bits as on the host) and copies only the encoded bytes to the host (``none``: the fp32
  values, into a pinned buffer), so the training thread never waits for the host and a
  quantised pseudo-gradient crosses PCIe in 1/4 to 1/8 of its fp32 bytes;
* when a reply arrives, the link thread copies the new global value to the device on the
  side stream and waits for it there (:meth:`DeviceStaging.to_device`); the merge at
  ``send + tau`` is then device-to-device work on the training stream.

On a CPU device there is nothing to stage: the host globals are the device's, ``on_device`` is
False and every method copies at once. ``mirror=True`` keeps separate "device" copies on the CPU
anyway, so the bookkeeping of the device path (which copy is read where, the link's encoding of a
device tensor) runs and is tested without a GPU.

Memory safety: a tensor made on one stream and used on another is marked with
``Tensor.record_stream`` so the caching allocator does not reuse it before that stream's
work on it is done; host buffers are read or reused only after the link thread has waited for
the copy's event.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch


def _done() -> None:
    """A copy that has already finished."""


class DeviceStaging:
    """Copies between the training device and host memory for one worker (see the module).

    Args:
        device: the worker's training device.
        mirror: on a CPU device, keep separate device copies anyway (tests of the device path).
    """

    def __init__(self, device: torch.device | str, mirror: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.on_device = self.cuda or mirror
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    @property
    def pin(self) -> bool:
        """Whether host buffers for this device should be pinned (page-locked): a CUDA device."""
        return self.cuda

    def put(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host`` (fp32 ``[n]``) made now on the calling thread's stream (set-up,
        resume, a fallback); the caller's later work on that stream sees it."""
        return host.to(self.device, torch.float32, copy=True)

    def hand_off(self, src: torch.Tensor) -> Callable[[], None]:
        """Hand ``src`` (on the device, computed on the calling thread's current stream: the
        training stream) to the link thread; returns ``ready``, which the link thread calls before
        its work on ``src`` (under :meth:`side`): the side stream then waits for ``src``'s kernels,
        and the host waits for nothing. ``src`` is not reused by the allocator before the side
        stream's work on it is done. Without CUDA there is nothing to wait for."""
        if not self.cuda:
            return _done
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        stream = self._stream
        assert stream is not None  # made in __init__ on a CUDA device
        src.record_stream(stream)
        return lambda: stream.wait_event(event)

    def side(self) -> Any:
        """The side stream as the current stream, for the link thread's device work (a context
        manager; a no-op without CUDA). A copy to the host made under it waits for that work."""
        return torch.cuda.stream(self._stream) if self.cuda else nullcontext()

    def to_device(self, host: torch.Tensor) -> torch.Tensor | None:
        """A new device tensor (fp32 ``[n]``, the copy finished) of a new global value ``host``,
        copied on the side stream and waited for (called by the link thread, so the training
        thread does not wait); None when there is no device copy to keep (CPU without ``mirror``).
        Hand it to the training thread through :meth:`adopt`."""
        if not self.on_device:
            return None
        if not self.cuda:
            return self.put(host)
        with torch.cuda.stream(self._stream):
            dev = torch.empty(host.shape, dtype=torch.float32, device=self.device)
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        event.synchronize()  # also: ``host`` may be reused from here on
        return dev

    def adopt(self, staged: torch.Tensor) -> torch.Tensor:
        """``staged`` (from :meth:`to_device`, made on the side stream), for use on the calling
        thread's current stream (its memory is not reused before that stream's work on it is done)."""
        if self.cuda:
            main = torch.cuda.current_stream(self.device)
            if main != self._stream:
                staged.record_stream(main)
        return staged
