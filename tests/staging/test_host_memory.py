"""Registered host memory and its accounting, with a fake CUDA host API (no GPU on CI)."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from sglang_ssd_stream.staging import host_memory
from sglang_ssd_stream.staging.host_memory import HostMemoryError

GIB = 1 << 30


class FakeCuda(host_memory.CudaHost):
    def __init__(self, register_code=0, pinned=True):
        self.registered, self.unregistered = [], []
        self.register_code, self.pinned = register_code, pinned

    def register(self, pointer, nbytes):
        self.registered.append((pointer, nbytes))
        return self.register_code

    def unregister(self, pointer):
        self.unregistered.append(pointer)
        return 0

    def is_pinned(self, tensor):
        return self.pinned


def test_registers_page_rounded_exact_table():
    cuda = FakeCuda()
    nbytes = 3 * mmap.PAGESIZE + 17
    t = host_memory.allocate_registered(nbytes, label="L3", cuda=cuda)
    assert t.dtype == torch.uint8 and t.numel() == nbytes
    [(ptr, size)] = cuda.registered
    assert ptr == t.data_ptr() and ptr % mmap.PAGESIZE == 0 and size == 4 * mmap.PAGESIZE
    t[:] = 7  # writable host memory
    view = t[8:16].view(torch.int32)
    del t
    gc.collect()
    assert cuda.unregistered == []  # a view still holds the mapping
    del view
    gc.collect()
    assert cuda.unregistered == [ptr]


def test_register_failure_names_memlock():
    cuda = FakeCuda(register_code=2)
    with pytest.raises(HostMemoryError, match=r"cudaHostRegister of .* failed with CUDA error 2.*--ulimit memlock=-1"):
        host_memory.allocate_registered(1 << 20, label="L3", cuda=cuda)


def test_unpinned_registration_is_refused():
    with pytest.raises(HostMemoryError, match="does not report it as pinned"):
        host_memory.allocate_registered(1 << 20, label="L3", cuda=FakeCuda(pinned=False))


def test_caching_allocator_rounds_to_a_power_of_two():
    assert host_memory.caching_allocator_bytes(int(47.69 * GIB)) == 64 * GIB
    assert host_memory.caching_allocator_bytes(32 * GIB) == 32 * GIB
    assert host_memory.caching_allocator_bytes(0) == 0


def test_startup_line_accounts_and_costs_kv_on_unified_memory():
    snap = host_memory.HostAccount(tables=2, table_bytes=int(47.69 * GIB), staging_bytes=40 << 20,
                                   rounding_would_add=int(16.31 * GIB))
    line = host_memory.startup_line("model.layers.3", int(23.8 * GIB), "registered page-aligned host memory", snap,
                                    integrated=True)
    assert "23.80 GiB" in line and "2 table(s) 47.69 GiB" in line and "staging 40.0 MiB" in line
    assert "would have added 16.31 GiB" in line
    assert "costs 47.73 GiB of KV-cache budget" in line
    assert "KV-cache" not in host_memory.startup_line("x", 1, "k", snap, integrated=False)


def test_account_accumulates():
    before = host_memory.account()
    after = host_memory.account(table_bytes=3 * GIB, staging_bytes=1 << 20)
    assert after.tables == before.tables + 1 and after.table_bytes == before.table_bytes + 3 * GIB
    assert after.rounding_would_add - before.rounding_would_add == GIB  # 3 GiB would pin 4 GiB
    assert after.total == before.total + 3 * GIB + (1 << 20)


def test_the_row_cache_is_in_the_account_and_the_startup_line():
    """Issue 19: cache bytes + staging bytes, both in the total (and in the KV cost on unified memory)."""
    before = host_memory.account()
    after = host_memory.account(cache_bytes=512 << 20, staging_bytes=2 << 20)
    assert after.cache_bytes - before.cache_bytes == 512 << 20
    assert after.total == before.total + (512 << 20) + (2 << 20) and after.tables == before.tables
    snap = host_memory.HostAccount(staging_bytes=40 << 20, cache_bytes=1 << 30)
    line = host_memory.startup_line("layer 3 row cache", 1 << 30, "row cache", snap, integrated=True)
    assert "this process now pins 1.04 GiB for PLE" in line and "staging 40.0 MiB, row cache 1.00 GiB)" in line
    assert "costs 1.04 GiB of KV-cache budget" in line
    assert "row cache" not in host_memory.startup_line("x", 1, "k", host_memory.HostAccount(staging_bytes=1),
                                                      integrated=False)
