"""Same-host zero copy from Python: get/peek with ref=True (large items as read-only mappings,
the copying fallback over TCP), and shared-buffer puts (Client.shared, put_shared,
append_shared) with the rules that keep a committed buffer from being written."""
import gc
import os

import pytest

import tensorshare

np = pytest.importorskip("numpy")

BIG = 1 << 20  # float32 elements: 4 MiB, above tensord's default --shm-min of 1 MiB


def server_maps():
    """Mappings of this process whose file is a memfd tensord made."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/memfd:" in line and "tensorshare-shared" not in line)


def in_server_map(addr):
    """True when addr lies in a mapping of a memfd tensord made (the data was not copied)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:" not in line or "tensorshare-shared" in line:
                continue
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def uclient(tensord):
    c = tensorshare.Client(tensord.unix_address, timeout=10, tensor_type="numpy")
    yield c
    c.close()


def test_ref_numpy_large_and_small(uclient):
    big = np.arange(BIG, dtype=np.float32)
    small = np.arange(16, dtype=np.int64)
    uclient.put("r", {"x": big, "step": 1})
    uclient.append("r", {"x": small, "step": 2})
    items = uclient.peek("r", ref=True)
    assert len(items) == 2
    assert np.array_equal(items[0]["x"], big) and items[0]["step"] == 1
    assert np.array_equal(items[1]["x"], small) and items[1]["step"] == 2
    assert not items[0]["x"].flags.writeable
    assert in_server_map(items[0]["x"].__array_interface__["data"][0])  # mapped, not copied
    assert not in_server_map(items[1]["x"].__array_interface__["data"][0])  # small: inline
    with pytest.raises(ValueError):
        items[0]["x"][0] = 1.0
    taken = uclient.get("r", 1, ref=True)
    assert len(taken) == 1 and np.array_equal(taken[0]["x"], big)
    # The arrays stay valid after their items left the bin and after the bin is gone.
    uclient.delete("r")
    assert np.array_equal(items[0]["x"], big)
    assert np.array_equal(taken[0]["x"], big)
    with pytest.raises(tensorshare.BinNotFoundError):
        uclient.get("r", ref=True)


def test_ref_mapping_lifetime(uclient):
    """A mapping lives exactly as long as some array over it (when tensord hands out fds)."""
    gc.collect()
    maps0 = server_maps()
    uclient.put("life", {"x": np.ones(BIG, dtype=np.float32)})
    items = uclient.peek("life", ref=True)
    x = items[0]["x"]
    mapped = server_maps() - maps0
    assert mapped == 1
    del items
    gc.collect()
    assert server_maps() - maps0 == mapped  # x keeps it
    assert float(x.sum()) == BIG
    del x
    gc.collect()
    assert server_maps() == maps0


def test_ref_torch(tensord):
    torch = pytest.importorskip("torch")
    c = tensorshare.Client(tensord.unix_address, timeout=10, tensor_type="torch")
    try:
        t = torch.arange(BIG, dtype=torch.float32)
        c.put("t", {"x": t, "b": torch.tensor([True, False]), "h": torch.ones(3, dtype=torch.bfloat16)})
        (item,) = c.peek("t", ref=True)
        assert torch.equal(item["x"], t)
        assert in_server_map(item["x"].data_ptr())  # the tensor is the mapping, not a copy
        assert item["b"].dtype == torch.bool and item["b"].tolist() == [True, False]
        assert item["h"].dtype == torch.bfloat16 and item["h"].float().sum().item() == 3.0
        (item2,) = c.get("t", ref=True)
        c.delete("t")
        assert torch.equal(item2["x"], t)  # the mapping outlives the item
    finally:
        c.close()


def test_ref_fallback_tcp(client):
    big = np.arange(BIG, dtype=np.float32)
    client.put("tcp", {"x": big})
    (item,) = client.peek("tcp", ref=True, tensor_type="numpy")
    assert np.array_equal(item["x"], big)
    assert not in_server_map(item["x"].__array_interface__["data"][0])  # copied
    (item,) = client.get("tcp", ref=True, tensor_type="numpy")
    assert np.array_equal(item["x"], big)


def test_ref_at_most_64_items(uclient):
    for i in range(70):
        uclient.append("many", i)
    items = uclient.get("many", ref=True)
    assert items == list(range(64))
    assert uclient.get("many", ref=True) == list(range(64, 70))


def test_shared_torch_put_and_append(tensord):
    torch = pytest.importorskip("torch")
    c = tensorshare.Client(tensord.unix_address, timeout=10)
    try:
        buf = c.shared({"x": (torch.float32, (256, 1024)), "step": 7, "tag": "a"})
        assert isinstance(buf, tensorshare.SharedBuffer)
        assert buf.nbytes > 256 * 1024 * 4
        assert sorted(buf.keys()) == ["step", "tag", "x"]
        x = buf["x"]
        assert isinstance(x, torch.Tensor) and x.shape == (256, 1024)
        assert x.dtype == torch.float32 and float(x.abs().sum()) == 0.0
        x.copy_(torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
        assert buf["step"] == 7 and buf["tag"] == "a"
        # A tensor over the buffer is alive: committing would pull its memory away.
        with pytest.raises(BufferError):
            c.put_shared("sh", buf)
        del x
        v1 = c.put_shared("sh", buf)
        assert buf.committed
        with pytest.raises(ValueError):
            buf["x"]
        with pytest.raises(tensorshare.InvalidArgumentError):
            c.put_shared("sh", buf)
        buf.close()

        buf2 = c.shared({"x": (torch.bfloat16, [3]), "m": (torch.bool, (2,)), "e": (torch.int64, (0,))})
        buf2["x"].fill_(2.0)
        buf2["m"][1] = True
        assert buf2["e"].shape == (0,)
        v2 = c.append_shared("sh", buf2)
        assert v2 > v1
        items = c.get("sh")
        assert len(items) == 2
        assert torch.equal(items[0]["x"], torch.arange(256 * 1024, dtype=torch.float32).view(256, 1024))
        assert items[0]["step"] == 7
        assert items[1]["x"].dtype == torch.bfloat16 and items[1]["x"].float().tolist() == [2.0] * 3
        assert items[1]["m"].tolist() == [False, True]
    finally:
        c.close()


def test_shared_numpy(uclient):
    buf = uclient.shared({"a": ("float64", (4,)), "b": [(np.int32, (2, 2)), 5]})
    a = buf["a"]
    assert a.flags.writeable and a.dtype == np.float64
    a[:] = [1, 2, 3, 4]
    buf["b", 0][1, 1] = 9
    del a
    gc.collect()
    uclient.put_shared("np", buf)
    (item,) = uclient.get("np")
    assert item["a"].tolist() == [1, 2, 3, 4]
    assert item["b"][0].tolist() == [[0, 0], [0, 9]] and item["b"][1] == 5


def test_shared_over_tcp_is_a_put(client):
    buf = client.shared({"x": ("int16", (8,))}, tensor_type="numpy")
    buf["x"][:] = 3
    client.put_shared("tcpsh", buf)
    assert buf.committed
    (item,) = client.get("tcpsh", tensor_type="numpy")
    assert item["x"].tolist() == [3] * 8


def test_shared_layout_errors(uclient):
    with pytest.raises(tensorshare.RecordError):
        uclient.shared({"x": ("float32", (-1,))})
    with pytest.raises(tensorshare.RecordError):
        uclient.shared({"x": ("float32", (1,) * 9)})
    with pytest.raises(TypeError):
        uclient.shared()
    with pytest.raises(TypeError):
        uclient.put_shared("b", {"x": 1})
    buf = uclient.shared({"x": ("uint8", (4,))})
    x = buf["x"]
    with pytest.raises(BufferError):
        buf.close()
    del x
    buf.close()
    with pytest.raises(ValueError):
        buf["x"]


def test_shared_cuda_refused(uclient):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(tensorshare.RecordError):
        uclient.shared({"x": torch.zeros(2, device="cuda")})


def test_no_fd_leak(tensord):
    gc.collect()
    fds0 = open_fds()
    c = tensorshare.Client(tensord.unix_address, timeout=10, tensor_type="numpy")
    c.put("leak", {"x": np.ones(BIG, dtype=np.float32)})
    for _ in range(3):
        items = c.peek("leak", ref=True)
        del items
    buf = c.shared({"x": ("float32", (16,))})
    c.append_shared("leak", buf)
    buf.close()
    c.get("leak", ref=True)
    c.close()
    gc.collect()
    assert open_fds() == fds0


@pytest.mark.parametrize("layout,what", [
    ({"x": ("float23", (2,))}, "'float23'"),
    ({"x": ("uint16", (2,))}, "'uint16'"),
    ({"x": (np.uint16, (2,))}, "uint16"),
    ({"x": (np.dtype("uint32"), (2,))}, "uint32"),
    ({"x": (dict, (2,))}, "dict"),
    ({"x": ("float32", 2)}, "shape"),
    ({"x": ("float32", (2.0,))}, "shape"),
    (5, "root"),
    ("float32", "root"),
])
def test_shared_layout_pairs_are_checked(uclient, layout, what):
    with pytest.raises(tensorshare.RecordError, match=what):
        uclient.shared(layout)


@pytest.mark.parametrize("dim", [2**63, 2**64, -2**64])
def test_shared_dimensions_past_64_bits_are_record_errors(uclient, dim):
    """The shape of a pair is ints from 0 to 2**63-1: past that a RecordError, as for -1, not
    OverflowError."""
    with pytest.raises(tensorshare.RecordError, match=r"dimensions are ints from 0 to 2\*\*63-1"):
        uclient.shared({"x": ("float32", (dim,))})


def test_shared_list_index_past_64_bits_is_index_error(uclient):
    buf = uclient.shared([("float32", (2,)), 5])
    for i in (2**64, -2**64, 2):
        with pytest.raises(IndexError, match="out of range"):
            buf[i]
    assert buf[-1] == 5
    buf.close()


def test_shared_layout_pairs_and_plain_lists(uclient):
    buf = uclient.shared({"a": ("float32", (2,)), "b": (np.float64, [1]), "c": (float, ()),
                          "d": ["float32", (2,)], "e": (1, 2)}, tensor_type="numpy")
    value = buf.value
    assert value["a"].dtype == np.float32 and value["a"].shape == (2,)
    assert value["b"].dtype == np.float64 and value["c"].shape == ()
    assert value["d"] == ["float32", [2]] and value["e"] == [1, 2]
    del value
    buf.close()
    root = uclient.shared(("int32", (3,)), tensor_type="numpy")
    assert root.value.shape == (3,)
    root.close()


def test_shared_with_block_keeps_live_tensors_valid(uclient):
    with uclient.shared({"x": ("float32", (4,))}, tensor_type="numpy") as buf:
        x = buf["x"]
        x[:] = 3.0
    assert x.tolist() == [3.0] * 4  # still mapped after the block
    with pytest.raises(ValueError, match="closed"):
        buf["x"]
    with pytest.raises(ValueError, match="closed"):
        uclient.put_shared("b", buf)
    buf.close()  # closed already: nothing to do, whatever tensors are alive
    buf.close()
    assert x.tolist() == [3.0] * 4
    x[0] = 1.0
    del x
    gc.collect()
    with pytest.raises(RuntimeError, match="boom"):
        with uclient.shared({"y": ("uint8", (2,))}) as b2:
            y = b2["y"]  # noqa: F841 - alive when the exception leaves the block
            raise RuntimeError("boom")


def proc_kib(path, name):
    with open(path) as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return None


def test_shared_larger_than_memory_takes_only_what_is_used(uclient):
    n = 1 << 38  # float32: 1 TiB, never allocated up front
    avail = proc_kib("/proc/meminfo", "MemAvailable")
    if avail is None or avail * 1024 // 2 >= n * 4:
        pytest.skip("a machine this large prefaults the buffer")
    rss0 = proc_kib("/proc/self/status", "VmRSS")
    buf = uclient.shared({"x": ("float32", (n,))}, tensor_type="numpy")
    assert buf.nbytes > n * 4
    x = buf["x"]
    x[0] = 1.0
    x[n - 1] = 2.0
    assert x[0] == 1.0 and x[n - 1] == 2.0
    assert proc_kib("/proc/self/status", "VmRSS") - rss0 < 16 * 1024
    assert proc_kib("/proc/self/status", "RssShmem") < 16 * 1024
    del x
    buf.close()


def test_shared_nul_in_a_key_or_dtype_is_refused(uclient):
    with pytest.raises(tensorshare.RecordError, match="NUL"):
        uclient.shared({"a\0b": ("int8", (2,)), "a": 5})
    with pytest.raises(tensorshare.RecordError):
        uclient.shared({"a": ("int8\0x", (2,))})
    with pytest.raises(TypeError):
        uclient.shared({"a": ("int8", (2,))}, **{"tensor_type\0x": "numpy"})
    buf = uclient.shared({"a": ("int8", (2,))}, tensor_type="numpy")
    with pytest.raises(KeyError):
        buf["a\0b"]
    assert buf["a"].shape == (2,)
    buf.close()
