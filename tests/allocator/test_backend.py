"""The backend contract (allocator.backend.Backend), run against every backend through the
`backend` fixture: the host backend always, the CUDA backend where a GPU is present (gpu)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from allocator.backend import check_aligned
from allocator.errors import ClosedError, DriverError


def _read(t: Any) -> torch.Tensor:
    return t.cpu() if t.device.type != "cpu" else t.clone()


def _mapped(backend: Any, pages: int = 2) -> tuple[int, int, list[int]]:
    """A reservation of `pages` granules, each mapped with its own handle and made accessible."""
    g = backend.granularity
    base = backend.reserve(pages * g)
    handles = []
    for i in range(pages):
        h = backend.create(g)
        backend.map(base + i * g, g, h)
        backend.set_access(base + i * g, g)
        handles.append(h)
    return base, pages * g, handles


def _teardown(backend: Any, base: int, size: int, handles: list[int]) -> None:
    g = backend.granularity
    for i in range(size // g):
        backend.unmap(base + i * g, g)
    for h in handles:
        backend.release(h)
    backend.free_reservation(base, size)


def test_granularity_is_a_positive_power_of_two_multiple_of_the_os_page(backend: Any) -> None:
    g = backend.granularity
    assert isinstance(g, int) and g > 0
    assert g & (g - 1) == 0, f"granularity {g} is not a power of two"
    assert g % 4096 == 0


def test_reserve_returns_aligned_distinct_ranges_and_free_gives_them_back(backend: Any) -> None:
    g = backend.granularity
    a = backend.reserve(4 * g)
    b = backend.reserve(g)
    assert a % g == 0 and b % g == 0
    assert a + 4 * g <= b or b + g <= a, "reservations overlap"
    assert backend.stats()["reservations"] == 2
    backend.free_reservation(a, 4 * g)
    backend.free_reservation(b, g)
    assert backend.stats()["reservations"] == 0


def test_free_reservation_of_unknown_range_is_a_driver_error(backend: Any) -> None:
    g = backend.granularity
    a = backend.reserve(2 * g)
    with pytest.raises(DriverError) as info:
        backend.free_reservation(a, g)  # wrong size
    assert info.value.address == a
    backend.free_reservation(a, 2 * g)


def test_create_and_release(backend: Any) -> None:
    """Creating handles commits memory and releasing gives it back, as the kernel (the host
    backend's memfd blocks, found through /proc/self/fd) or the driver (the device's used
    memory) reports it, not only as the backend's own bookkeeping says."""
    import os

    host = backend.__class__.__name__ == "HostBackend"

    def held() -> int:
        if not host:
            free, total = torch.cuda.mem_get_info(backend.device_ordinal)
            return total - free
        backend.wait_released()  # the host backend's reaper punches released blocks
        blocks = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvledger-physical"):
                    blocks += os.fstat(int(fd)).st_blocks
            except OSError:
                continue  # the listing's own fd, or one closed meanwhile
        return blocks * 512

    def near(actual: int, expected: int) -> bool:
        # host: exact; CUDA: a device-wide figure that others may move by less than a granule
        return actual == expected if host else expected <= actual < expected + backend.granularity

    g = backend.granularity
    before = held()
    h1, h2 = backend.create(g), backend.create(2 * g)
    assert h1 != h2
    assert backend.stats()["handles"] == 2
    assert near(held() - before, 3 * g)  # committed at create, before any map
    backend.release(h1)
    assert near(held() - before, 2 * g)
    backend.release(h2)
    assert backend.stats()["handles"] == 0
    assert near(held() - before, 0)


def test_release_of_unknown_handle_is_a_driver_error(backend: Any) -> None:
    h = backend.create(backend.granularity)
    backend.release(h)
    with pytest.raises(DriverError) as info:
        backend.release(h)
    assert "release" in info.value.op.lower()
    assert info.value.error_name


def test_map_set_access_unmap_round_trip(backend: Any) -> None:
    base, size, handles = _mapped(backend, 2)
    assert backend.stats()["mappings"] == 2
    _teardown(backend, base, size, handles)
    stats = backend.stats()
    assert (stats["reservations"], stats["handles"], stats["mappings"]) == (0, 0, 0)


def test_byte_tensor_reads_back_what_was_written(backend: Any) -> None:
    base, size, handles = _mapped(backend, 2)
    t = backend.byte_tensor(base, size)
    assert t.dtype == torch.uint8 and tuple(t.shape) == (size,)
    pattern = (torch.arange(size, dtype=torch.int64) * 7 % 251).to(torch.uint8)
    t.copy_(pattern.to(t.device))
    again = backend.byte_tensor(base, size)  # a second view over the same memory
    assert torch.equal(_read(again), pattern)
    # views of the second page see the same bytes
    g = backend.granularity
    assert torch.equal(_read(backend.byte_tensor(base + g, g)), pattern[g:])
    del t, again
    _teardown(backend, base, size, handles)


def test_remapping_a_handle_shows_its_contents_elsewhere(backend: Any) -> None:
    """Physical memory belongs to the handle, not to the address it is mapped at."""
    g = backend.granularity
    base = backend.reserve(2 * g)
    h = backend.create(g)
    backend.map(base, g, h)
    backend.set_access(base, g)
    backend.byte_tensor(base, g).fill_(0xA5)
    backend.unmap(base, g)
    backend.map(base + g, g, h)
    backend.set_access(base + g, g)
    assert bool((_read(backend.byte_tensor(base + g, g)) == 0xA5).all())
    backend.unmap(base + g, g)
    backend.release(h)
    backend.free_reservation(base, 2 * g)


@pytest.mark.parametrize("op", ["reserve", "create", "map", "unmap", "set_access"])
def test_misaligned_input_is_a_value_error_naming_the_value(backend: Any, op: str) -> None:
    g = backend.granularity
    bad = g + 512
    base = backend.reserve(2 * g)
    h = backend.create(g)
    calls = {
        "reserve": lambda: backend.reserve(bad),
        "create": lambda: backend.create(bad),
        "map": lambda: backend.map(base + 512, g, h),
        "unmap": lambda: backend.unmap(base, bad),
        "set_access": lambda: backend.set_access(base + 512, g),
    }
    with pytest.raises(ValueError) as info:
        calls[op]()
    msg = str(info.value)
    assert str(bad) in msg or str(base + 512) in msg, msg
    assert str(g) in msg, f"the message should name the granularity: {msg}"
    backend.release(h)
    backend.free_reservation(base, 2 * g)


def test_check_aligned_refuses_negative_and_non_int() -> None:
    with pytest.raises(ValueError, match="size=-4096"):
        check_aligned("op", 4096, size=-4096)
    with pytest.raises(ValueError, match=r"size=4096\.0"):
        check_aligned("op", 4096, size=4096.0)  # type: ignore[arg-type]


def test_mapping_a_mapped_range_twice_is_a_driver_error(backend: Any) -> None:
    g = backend.granularity
    base = backend.reserve(g)
    h1, h2 = backend.create(g), backend.create(g)
    backend.map(base, g, h1)
    with pytest.raises(DriverError) as info:
        backend.map(base, g, h2)
    err = info.value
    assert "map" in err.op.lower() and "unmap" not in err.op.lower()
    assert err.address == base
    assert err.error_name and err.error_name in str(err)
    assert f"{base:x}" in str(err), "the message should say which address failed"
    backend.unmap(base, g)
    backend.release(h1)
    backend.release(h2)
    backend.free_reservation(base, g)


def test_unmapping_an_unmapped_range_is_a_driver_error(backend: Any) -> None:
    g = backend.granularity
    base = backend.reserve(2 * g)
    with pytest.raises(DriverError) as info:
        backend.unmap(base + g, g)
    err = info.value
    assert "unmap" in err.op.lower()
    assert err.address == base + g
    assert err.error_name and err.error_name in str(err)
    backend.free_reservation(base, 2 * g)


def test_freeing_a_reservation_with_mappings_is_a_driver_error(backend: Any) -> None:
    base, size, handles = _mapped(backend, 2)
    with pytest.raises(DriverError) as info:
        backend.free_reservation(base, size)
    assert "free" in info.value.op.lower()
    assert info.value.address == base
    # nothing was freed: the memory still reads back
    backend.byte_tensor(base, size).fill_(3)
    assert int(_read(backend.byte_tensor(base, size)).sum()) == 3 * size
    _teardown(backend, base, size, handles)


def test_release_of_a_mapped_handle_is_deferred_until_unmap(backend: Any) -> None:
    g = backend.granularity
    base = backend.reserve(g)
    h = backend.create(g)
    backend.map(base, g, h)
    backend.set_access(base, g)
    backend.byte_tensor(base, g).fill_(0x5A)
    backend.release(h)
    # the memory stays behind the mapping until it is unmapped
    assert bool((_read(backend.byte_tensor(base, g)) == 0x5A).all())
    backend.unmap(base, g)
    backend.free_reservation(base, g)
    assert backend.stats()["handles"] == 0
    assert backend.stats()["mappings"] == 0


def test_close_holds_nothing_is_idempotent_and_refuses_further_use(backend: Any) -> None:
    g = backend.granularity
    _mapped(backend, 3)  # left for close() to undo
    backend.create(g)  # an unmapped handle
    backend.reserve(g)  # an empty reservation
    backend.close()
    backend.close()
    stats = backend.stats()
    assert (
        stats["reservations"],
        stats["reserved_bytes"],
        stats["handles"],
        stats["mappings"],
    ) == (
        0,
        0,
        0,
        0,
    )
    assert backend.closed
    for call in (
        lambda: backend.reserve(g),
        lambda: backend.create(g),
        lambda: backend.map(0, g, 1),
        lambda: backend.unmap(0, g),
        lambda: backend.set_access(0, g),
        lambda: backend.release(1),
    ):
        with pytest.raises(ClosedError):
            call()


def test_context_manager_closes(backend: Any) -> None:
    with backend as be:
        be.reserve(be.granularity)
    assert backend.closed
    assert backend.stats()["reservations"] == 0
