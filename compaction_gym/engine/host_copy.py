"""Copies between host and device that do not wait for the device (docs/engine.md, "Batched events").

A plain ``tensor.to("cuda")`` from pageable memory synchronises the stream (PyTorch copies and then
waits), so every index tensor built on the host would stall the host until the device had drained
its queue. :func:`upload` packs several host tensors of one dtype into one pinned buffer and copies
it asynchronously: one copy, no synchronisation (the caching host allocator keeps the pinned block
alive until the copy has run). :class:`HostCopy` is the way back: an event's indices and β in one
asynchronous copy, waited for once.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def upload(tensors: list[torch.Tensor | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host tensors or numpy arrays, one dtype) on ``device`` in one asynchronous copy,
    each reshaped as given (views of one buffer); on a CPU ``device``, the tensors themselves (an
    array as a tensor sharing its memory).

    Arrays are written into the pinned buffer by numpy and the device buffer is cut by one
    ``split``: a call staging many small arrays (one-pass replay's plan: hundreds) costs about one
    torch operation per array instead of four (docs/grpo.md, "Slot tables")."""
    if device.type == "cpu" or not tensors:
        return [_as_tensor(t) for t in tensors]
    shapes = [tuple(t.shape) for t in tensors]
    sizes = [math.prod(shape) for shape in shapes]
    pinned = device.type == "cuda"
    if all(isinstance(t, np.ndarray) for t in tensors):
        dtype = torch.from_numpy(np.empty(0, tensors[0].dtype)).dtype
        flat = torch.empty(sum(sizes), dtype=dtype, pin_memory=pinned)
        np.concatenate([t.reshape(-1) for t in tensors], out=flat.numpy())
    else:
        host = [_as_tensor(t) for t in tensors]
        flat = torch.empty(sum(sizes), dtype=host[0].dtype, pin_memory=pinned)
        torch.cat([t.reshape(-1) for t in host], out=flat)
    flat = flat.to(device, non_blocking=True)
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _as_tensor(t: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t


class HostCopy:
    """Int64 ``indices`` and float32 ``beta`` (same shape) on their way to the host: one
    asynchronous device→host copy into pinned memory, started at construction; :meth:`wait`
    blocks until it has landed (docs/engine.md, "Batched events": a round launches every scoring
    call and write-back before it waits once).

    :attr:`indices` and :attr:`beta` are the host tensors at once (pageable, their pages faulted in
    while the host waits), their values valid after :meth:`wait`: the two travel as the bytes of
    one buffer, the indices' and then β's, so they land bit-exact, and each is filled by one byte
    copy. They are tensors of their own, never views of one buffer under two dtypes: records
    holding them are saved by ``torch.save`` and pickled like any tensor (docs/design-notes.md).
    """

    def __init__(self, indices: torch.Tensor, beta: torch.Tensor | None) -> None:
        self.done: torch.cuda.Event | None = None
        if not indices.is_cuda:
            self.indices = indices.to(torch.int64, copy=True)
            self.beta = None if beta is None else beta.to(torch.float32, copy=True)
            return
        shape = tuple(indices.shape)
        packed = indices.to(torch.int64).reshape(-1).view(torch.uint8)
        if beta is not None:
            packed = torch.cat([packed, beta.to(torch.float32).reshape(-1).view(torch.uint8)])
        self.pinned = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
        self.pinned.copy_(packed, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()
        # pageable: records keep these long, the pinned block goes back to the allocator
        self.indices = torch.empty(shape, dtype=torch.int64)
        self.beta = torch.empty(shape, dtype=torch.float32) if beta is not None else None
        # each host tensor's bytes and where they lie in the pinned buffer, cut now (while the
        # device works) so that after the wait only the copies run. They are numpy arrays: numpy
        # copies on this thread, where torch's CPU copy of a few MB wakes its intra-op threads,
        # which stalled the wait by up to 10 ms on a 16-core GPU host (docs/engine.md, "Batched events")
        dst = [t.view(-1).view(torch.uint8).numpy() for t in (self.indices, self.beta) if t is not None]
        src = self.pinned.numpy()
        self._parts = [(d, src[a : a + d.size]) for d, a in zip(dst, np.cumsum([0, *(d.size for d in dst)]))]

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(indices, beta)`` on the host (``beta`` ``None`` when none was sent), once landed."""
        if self.done is not None:
            if not self.done.query():  # fault the pages in while the device works, not after it
                for dst, _ in self._parts:
                    dst.fill(0)
            self.done.synchronize()
            for dst, src in self._parts:
                np.copyto(dst, src)
            self.done, self._parts = None, []
        return self.indices, self.beta
