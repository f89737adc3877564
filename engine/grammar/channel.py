"""The shared-memory channel between the device and the grammar process (grammar/process.py).

One `multiprocessing.shared_memory` block, sized at engine start (`ChannelLayout.of`): a header
of two sequence flags, two input slots and one mask buffer.

* The device **publishes** a phase (`DeviceChannel.signal`): it writes the phase's tokens (the
  step's accepted tokens, a draft level, a verify tree; or nothing) into input slot seq % 2,
  then the device flag = seq. seq is a counter kept on the device, so a captured CUDA graph
  publishes seq, seq + 1, ... at every replay.
* The grammar process answers phases in order: for a mask phase it writes the masks, then its
  own flag = seq (x86 keeps store order, so the masks are there before the flag).
* The device **waits** (`DeviceChannel.masks`) until the host flag reaches its counter (a
  spin kernel that reads the flag and the target from memory, so it works inside a graph),
  then copies the masks in (a kernel of its own, after the spin).

Sequence numbers only grow (no reset while anything runs). Two input slots suffice: every step
waits for at least one of its phases, and a step's last phase (its accepted tokens) is
followed by the next step's first, so when phase k is written phase k - 2 is answered. One mask
buffer suffices: the grammar process writes phase k's masks only after the device published
phase k, which comes after the device copied phase k - 1's masks (stream order).

If the grammar process dies, the engine (process.py `GrammarService`) fills the masks with
all-allowed and writes the host flag RELEASED: every wait passes from then on (the constrained
requests fail). The CUDA spin kernel also gives up after `MAX_SPINS` reads (~tens of seconds).

`DeviceChannel.for_device` picks the primitives: on CUDA the memory is page-locked and mapped
(cudaHostRegister) and read by kernels; on the CPU the forward thread is the device and copies
with tensor ops, waiting in a short spin / sleep loop.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np
import torch

from specserve.engine.grammar.bitmask import bitmask_width

DEVICE_FLAG = 0      # int64 index in the header: the last phase the device published
HOST_FLAG = 8        # the last phase the grammar process answered (a cache line apart)
TIMED_OUT = 4        # set by a device wait that gave up: the grammar process is alive but silent
HEADER_WORDS = 16
RELEASED = 1 << 62   # the host flag once the grammar process is gone: every wait passes
MAX_SPINS = 1 << 25  # CUDA wait kernel: flag reads before it gives up (~1 us each)
CPU_WAIT_LIMIT_SECONDS = 120.0


class ChannelLayout(NamedTuple):
    rows: int    # mask rows
    width: int   # int32 words per mask row
    slot: int    # int64 values per input slot

    @staticmethod
    def of(max_batch_size: int, vocab_size: int, tree=None) -> "ChannelLayout":
        """Sized for a batch of up to max_batch_size requests; `tree` (spec.tree.TreeShape) the
        draft shape, None for plain decoding."""
        if tree is None:
            return ChannelLayout(max_batch_size, bitmask_width(vocab_size), max_batch_size)
        k, n, D = tree.topk, tree.num_steps, tree.num_draft_tokens
        # The widest input per request: a draft level's candidates (tokens, parents, frontier),
        # a verify tree (tokens and parents of its D nodes), accepted tokens (D and a length).
        candidates = max(n - 1, 1) if k == 1 else k + max(n - 2, 0) * k * k
        per_row = max(2 * candidates + k, 2 * D, D + 1)
        return ChannelLayout(max_batch_size * max(D, k), bitmask_width(vocab_size), max_batch_size * per_row)

    @property
    def nbytes(self) -> int:
        return 8 * HEADER_WORDS + 8 * 2 * self.slot + 4 * self.rows * self.width


class HostViews:
    """The block seen from the host: `header` (numpy int64, the flags), `inputs` [2, slot]
    int64 and `masks` [rows, width] int32 (torch, over the shared memory)."""

    def __init__(self, buf, layout: ChannelLayout):
        self.layout = layout
        self.header = np.frombuffer(buf, dtype=np.int64, count=HEADER_WORDS)
        base = torch.frombuffer(buf, dtype=torch.uint8)
        start = 8 * HEADER_WORDS
        self.inputs = base[start:start + 16 * layout.slot].view(torch.int64).view(2, layout.slot)
        start += 16 * layout.slot
        self.masks = base[start:start + 4 * layout.rows * layout.width].view(torch.int32).view(
            layout.rows, layout.width)
        self.base = base

    @property
    def timed_out(self) -> bool:
        return bool(self.header[TIMED_OUT])

    def release(self) -> None:
        """Every wait passes from now on, applying all-allowed masks (the grammar process is gone)."""
        self.masks.fill_(-1)
        self.header[HOST_FLAG] = RELEASED


class DeviceChannel:
    """The device's side: `signal(*tensors)` publishes a phase, `masks(n)` waits for the answer
    to the last one and returns its first n mask rows on the device."""

    def __init__(self, views: HostViews, device: torch.device):
        self.views = views
        self.layout = views.layout
        self.device = device

    @staticmethod
    def for_device(views: HostViews, device: torch.device) -> "DeviceChannel":
        return CudaDeviceChannel(views, device) if device.type == "cuda" else CpuDeviceChannel(views, device)

    @staticmethod
    def _flat(tensors) -> Optional[torch.Tensor]:
        if not tensors:
            return None
        return torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])

    def signal(self, *tensors: torch.Tensor) -> None:
        raise NotImplementedError

    def masks(self, n: int) -> torch.Tensor:
        """The answer's first n mask rows. After a wait that gave up (the grammar process alive
        but silent: TIMED_OUT in the header) the shared rows are stale, another phase's rows or
        half written, so every row comes back all allowed, as a released channel's: the
        constrained rows of such a step are failed (GrammarService.dead) and the unconstrained
        ones, whose rows may hold another request's old mask, decode as they would alone."""
        raise NotImplementedError

    def captured(self):
        """Context for capturing CUDA graphs: the warm-up runs pass every wait, and afterwards
        the counters start again from 0 (nothing else runs then)."""
        return _Bypass(self)

    def _reset(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Bypass:
    def __init__(self, channel: DeviceChannel):
        self.channel = channel

    def __enter__(self):
        self.channel.views.header[HOST_FLAG] = RELEASED

    def __exit__(self, *exc):
        if self.channel.device.type == "cuda":
            torch.cuda.synchronize(self.channel.device)
        self.channel._reset()
        self.channel.views.header[DEVICE_FLAG] = 0
        self.channel.views.header[HOST_FLAG] = 0
        self.channel.views.masks.fill_(-1)


class CpuDeviceChannel(DeviceChannel):
    """The CPU engine: the forward thread plays the device."""

    def __init__(self, views: HostViews, device: torch.device):
        super().__init__(views, device)
        self._seq = 0
        self._masks = torch.full((self.layout.rows, self.layout.width), -1, dtype=torch.int32)

    def signal(self, *tensors: torch.Tensor) -> None:
        self._seq += 1
        flat = self._flat(tensors)
        if flat is not None:
            self.views.inputs[self._seq % 2, :flat.shape[0]].copy_(flat)
        self.views.header[DEVICE_FLAG] = self._seq   # after the data

    def masks(self, n: int) -> torch.Tensor:
        header, target = self.views.header, self._seq
        if header[HOST_FLAG] < target and not header[TIMED_OUT]:
            deadline = time.monotonic() + CPU_WAIT_LIMIT_SECONDS
            spins = 0
            while header[HOST_FLAG] < target:
                spins += 1
                if spins > 200:
                    time.sleep(5e-5)
                    if time.monotonic() > deadline:  # as the CUDA wait: say so, go on
                        header[TIMED_OUT] = 1
                        break
        if header[TIMED_OUT]:  # no answer: all allowed, as a released channel's (see masks())
            self._masks[:n].fill_(-1)
        else:
            self._masks[:n].copy_(self.views.masks[:n])
        return self._masks[:n]

    def _reset(self) -> None:
        self._seq = 0


class _MappedArray:
    """A device pointer into mapped host memory, as torch.as_tensor takes it."""

    def __init__(self, ptr: int, shape: tuple, typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None}


class CudaDeviceChannel(DeviceChannel):
    """The block page-locked and mapped for the device; signal and wait are Triton kernels that
    read the sequence counter from device memory (the same code replays in a graph)."""

    def __init__(self, views: HostViews, device: torch.device):
        super().__init__(views, device)
        layout = self.layout
        host_ptr = views.base.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(host_ptr, layout.nbytes, 3)  # portable | mapped
        if int(err) != 0:
            raise RuntimeError(f"structured output: cudaHostRegister failed ({err})")
        self._host_ptr = host_ptr
        # Under UVA (64-bit Linux; every GPU that can use the host pointer for registered
        # memory, Hopper included) the device addresses registered memory by its host address.
        ptr = host_ptr
        with torch.cuda.device(device):
            self.header_d = torch.as_tensor(_MappedArray(ptr, (HEADER_WORDS,), "<i8"), device=device)
            self.inputs_d = torch.as_tensor(_MappedArray(ptr + 8 * HEADER_WORDS, (2 * layout.slot,), "<i8"),
                                            device=device)
            self.masks_d = torch.as_tensor(_MappedArray(ptr + 8 * HEADER_WORDS + 16 * layout.slot,
                                                        (layout.rows, layout.width), "<i4"), device=device)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)      # the last published phase
        self._masks = torch.full((layout.rows, layout.width), -1, dtype=torch.int32, device=device)
        self._nothing = torch.zeros(1, dtype=torch.int64, device=device)

    def signal(self, *tensors: torch.Tensor) -> None:
        from specserve.engine.grammar import channel_kernels

        flat = self._flat(tensors)
        n = 0 if flat is None else flat.shape[0]
        channel_kernels.signal(self._nothing if flat is None else flat, n, self.seq, self.inputs_d,
                               self.header_d, self.layout.slot, DEVICE_FLAG)

    def masks(self, n: int) -> torch.Tensor:
        from specserve.engine.grammar import channel_kernels

        channel_kernels.wait(self.header_d, self.seq, MAX_SPINS, HOST_FLAG, TIMED_OUT)
        self._masks[:n].copy_(self.masks_d[:n])
        # After a wait that gave up, all allowed (see DeviceChannel.masks), decided on the device
        # from the flag the wait wrote: no host sync, the same in a graph.
        self._masks[:n].masked_fill_(self.header_d[TIMED_OUT] != 0, -1)
        return self._masks[:n]

    def _reset(self) -> None:
        self.seq.zero_()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._host_ptr:
            torch.cuda.synchronize(self.device)
            del self.header_d, self.inputs_d, self.masks_d
            torch.cuda.cudart().cudaHostUnregister(self._host_ptr)
            self._host_ptr = 0
