"""Transparent huge pages behind the replay's large CPU tensors.

A replay step reads a few hundred random rows of a multi-gigabyte store and random leaves
of an 8 MB tree: with 4 KiB pages nearly every row costs a TLB miss and a page walk. On a
kernel whose transparent huge pages are set to `madvise` (the default of many
distributions, and of the machine the README's figures come from) a region gets 2 MiB
pages only when asked with `madvise(MADV_HUGEPAGE)` before its pages are first touched.
Measured here: a 512-row gather from a 1.7 GB store, 186 -> 147 us (`launch.bench replay`
reports the huge-page memory the replay obtained). Where the kernel says `always` this is a
no-op; where it says `never`, or on another OS, the request is refused and nothing changes.
Set APEX_BDQ_NO_HUGEPAGES=1 to skip the request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Optional

import torch

MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
HUGE = 2 << 20  # 2 MiB, x86-64 and arm64 with 4 KiB base pages
MIN_BYTES = 4 * HUGE  # smaller tensors gain nothing worth a system call

_libc: Optional[ctypes.CDLL] = None


def _madvise():
    global _libc
    if not sys.platform.startswith("linux"):
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            return None
    return _libc.madvise


def advise_hugepages(t: torch.Tensor) -> bool:
    """Ask for huge pages behind the whole 2 MiB pages inside `t`'s memory (CPU, >= 8 MiB).
    Call before the memory is first written. Returns whether the kernel accepted."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or os.environ.get("APEX_BDQ_NO_HUGEPAGES") == "1":
        return False
    fn = _madvise()
    if fn is None:
        return False
    start = (t.data_ptr() + HUGE - 1) & ~(HUGE - 1)
    end = (t.data_ptr() + nbytes) & ~(HUGE - 1)
    if end <= start:
        return False
    return fn(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


def zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, with huge pages requested for large CPU tensors before they are touched."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise_hugepages(t)
    return t.zero_()


def anon_hugepages_mb() -> Optional[float]:
    """This process's anonymous memory backed by transparent huge pages (Linux), in MB."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
