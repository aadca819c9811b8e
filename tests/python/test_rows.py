"""Tensor bins and rows from Python: create_tensor_bin, read_rows, gather_rows (NumPy, torch and
list indexes), write_rows, over TCP and the unix socket; bad inputs raise the documented
exceptions; a listener sees one "rows" event per write; the by-reference peek of a tensor bin
follows the writes (unix sockets)."""
import re
import threading
import time

import pytest

import tensorshare

np = pytest.importorskip("numpy")

ROWS, COLS = 50, 6


@pytest.fixture(params=["tcp", "unix"])
def rclient(request, tensord):
    addr = tensord.address if request.param == "tcp" else tensord.unix_address
    c = tensorshare.Client(addr, timeout=10, tensor_type="numpy")
    yield c
    c.close()


def rows(k, base):
    return (np.arange(k, dtype=np.float32)[:, None] + base) * np.ones((1, COLS), np.float32)


def test_write_read_gather(rclient):
    v0 = rclient.create_tensor_bin("emb", "float32", (ROWS, COLS))
    assert v0 > 0
    z = rclient.read_rows("emb", 0, ROWS)
    assert z.shape == (ROWS, COLS) and z.dtype == np.float32 and not z.any()
    v1 = rclient.write_rows("emb", 10, rows(5, 100.0))
    assert v1 > v0
    got = rclient.read_rows("emb", 9, 16)
    assert got.shape == (7, COLS)
    np.testing.assert_array_equal(got[1:6], rows(5, 100.0))
    assert not got[0].any() and not got[6].any()
    ix = np.array([14, 10, 10, 49], dtype=np.int64)
    g = rclient.gather_rows("emb", ix)
    np.testing.assert_array_equal(g[:, 0], [104.0, 100.0, 100.0, 0.0])
    np.testing.assert_array_equal(rclient.gather_rows("emb", [11, 12])[:, 3], [101.0, 102.0])
    assert rclient.gather_rows("emb", np.zeros(0, np.int64)).shape == (0, COLS)
    # The whole tensor is the root of the bin's one item.
    (whole,) = rclient.peek("emb")
    np.testing.assert_array_equal(whole[10:15], rows(5, 100.0))


def test_torch_index_and_rows(client):
    torch = pytest.importorskip("torch")
    client.create_tensor_bin("t", torch.float32, [8, 2])
    client.write_rows("t", 2, torch.ones(3, 2))
    g = client.gather_rows("t", torch.tensor([4, 0, 2]), tensor_type="torch")
    assert isinstance(g, torch.Tensor)
    assert g[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_plain_item_key(client):
    w = np.arange(12, dtype=np.float64).reshape(4, 3)
    client.append("p", {"w": w, "step": 1})
    client.append("p", {"w": w + 100, "step": 2})
    r = client.read_rows("p", 1, 3, item=-1, key="w", tensor_type="numpy")
    np.testing.assert_array_equal(r, w[1:3] + 100)
    g = client.gather_rows("p", [3, 0], key="w", tensor_type="numpy")
    np.testing.assert_array_equal(g, w[[3, 0]])


def test_bad_inputs(client):
    client.create_tensor_bin("t", np.float32, (ROWS, COLS))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.create_tensor_bin("t", "float32", (ROWS, COLS))  # exists
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.create_tensor_bin("u", "float32", ())
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.create_tensor_bin("u", "float32", [1] * 9)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.create_tensor_bin("u", "no-such-dtype", (3,))
    with pytest.raises(tensorshare.ServerError):
        client.create_tensor_bin("u", "uint8", (1 << 52,))  # over --max-memory
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.read_rows("t", 0, ROWS + 1)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.read_rows("t", 0, 1, item=1)
    with pytest.raises(tensorshare.BinNotFoundError):
        client.read_rows("nope", 0, 1)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.gather_rows("t", np.array([0, ROWS], np.int64))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.gather_rows("t", np.array([0, 1], np.int32))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.gather_rows("t", np.zeros((2, 2), np.int64))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.write_rows("t", ROWS - 1, rows(2, 0.0))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.write_rows("t", 0, rows(2, 0.0).astype(np.float64))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.write_rows("t", 0, np.zeros((1, COLS + 1), np.float32))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.write_rows("t", 0, {"not": "a tensor"})
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.put("t", 1)  # a tensor bin refuses put
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.get("t")
    client.put("plain", 1)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.write_rows("plain", 0, rows(1, 0.0))
    client.ping()


I64 = "from -2**63 to 2**63-1"


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda c: c.read_rows("t", 2**63, 1), ValueError,
                 "start must be an int %s, not 9223372036854775808" % I64, id="read_start"),
    pytest.param(lambda c: c.read_rows("t", 0, -2**64), ValueError, "end must be an int " + I64,
                 id="read_end"),
    pytest.param(lambda c: c.read_rows("t", 0, 1, item=2**32), ValueError,
                 "item must be an int from -2147483648 to 2147483647, not 4294967296",
                 id="read_item"),
    pytest.param(lambda c: c.read_rows("t", 0.0, 1), TypeError, "start must be an int, not float",
                 id="read_start_float"),
    pytest.param(lambda c: c.gather_rows("t", [0], item=-2**31 - 1), ValueError,
                 "item must be an int from -2147483648 to 2147483647", id="gather_item"),
    pytest.param(lambda c: c.gather_rows("t", [0, 2**64 + 1]), ValueError,
                 "index[1] must be an int " + I64, id="gather_index"),
    pytest.param(lambda c: c.gather_rows("t", [True]), TypeError,
                 "index[0] must be an int, not bool", id="gather_index_bool"),
    pytest.param(lambda c: c.write_rows("t", 2**64 + 1, rows(1, 9.0)), ValueError,
                 "start must be an int " + I64, id="write_start"),
    pytest.param(lambda c: c.create_tensor_bin("u", "float32", (2**64 + 4, 2)), ValueError,
                 "shape[0] must be an int " + I64, id="shape"),
    pytest.param(lambda c: c.create_tensor_bin("u", "float32", (4, 2.0)), TypeError,
                 "shape[1] must be an int, not float", id="shape_float"),
])
def test_out_of_range_ints_are_refused(client, call, error, message):
    """An int that does not fit its argument raises ValueError naming it (not OverflowError),
    and nothing is read, written or made."""
    client.create_tensor_bin("t", np.float32, (ROWS, COLS))
    with pytest.raises(error, match=re.escape(message)):
        call(client)
    assert not client.read_rows("t", 0, ROWS).any()
    assert client.list().keys() == {"t"}


def test_nul_in_a_key_dtype_or_name_is_refused(client):
    """A str the library takes as a C string would be cut at a NUL: "a\0zzz" is not key "a"."""
    client.put("kk", {"a": np.arange(4, dtype=np.float32)})
    client.create_tensor_bin("tb", "float32", (4,))
    with pytest.raises(tensorshare.InvalidArgumentError, match="NUL"):
        client.read_rows("kk", 0, 2, key="a\0zzz")
    with pytest.raises(tensorshare.InvalidArgumentError, match="NUL"):
        client.gather_rows("kk", [0], key="a\0zzz")
    with pytest.raises(ValueError):
        client.write_rows("tb\0x", 0, np.zeros(1, np.float32))
    with pytest.raises(tensorshare.InvalidArgumentError, match="dtype"):
        client.create_tensor_bin("tn", "float32\0x", (2,))
    assert client.read_rows("kk", 0, 2, key="a").tolist() == [0.0, 1.0]


def test_listener_sees_rows_events(client, tensord):
    seen = []
    done = threading.Event()

    def cb(n):
        seen.append((n.event, n.version, n.n_items))
        if len(seen) >= 6:
            done.set()

    other = tensorshare.Client(tensord.address, timeout=10)
    try:
        client.listen("ev", cb)
        other.create_tensor_bin("ev", "float32", (ROWS, COLS))
        versions = [other.write_rows("ev", i, rows(1, float(i))) for i in range(5)]
        assert done.wait(10)
        assert [e for e, _, _ in seen] == ["put"] + ["rows"] * 5
        assert [v for _, v, _ in seen[1:]] == versions
        assert all(n == 1 for _, _, n in seen)
        assert client.wait("ev", versions[-1] - 1, timeout=5)[0] == versions[-1]
        client.unlisten("ev")
    finally:
        other.close()


def test_concurrent_writers(tensord):
    a = tensorshare.Client(tensord.address, timeout=10)
    b = tensorshare.Client(tensord.unix_address, timeout=10)
    try:
        a.create_tensor_bin("c", "float32", (ROWS, COLS))
        errors = []

        def run(c, first):
            try:
                for i in range(ROWS // 2):
                    c.write_rows("c", first + i, rows(1, float(first + i)))
            except Exception as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        ts = [threading.Thread(target=run, args=(a, 0)), threading.Thread(target=run, args=(b, ROWS // 2))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert not errors
        got = a.read_rows("c", 0, ROWS, tensor_type="numpy")
        np.testing.assert_array_equal(got[:, 0], np.arange(ROWS, dtype=np.float32))
    finally:
        a.close()
        b.close()


def test_peek_ref_follows_writes(tensord):
    c = tensorshare.Client(tensord.unix_address, timeout=10, tensor_type="numpy")
    try:
        c.create_tensor_bin("live", "float32", (1 << 18, 4))  # 4 MiB: a memfd
        (m,) = c.peek("live", ref=True)
        assert not m[7].any()
        c.write_rows("live", 7, np.full((1, 4), 3.5, np.float32))
        deadline = time.monotonic() + 5
        while m[7, 0] != 3.5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert m[7, 0] == 3.5  # the mapping is the bin's memory
    finally:
        c.close()


def test_raw_bytes_are_rows_of_the_bins_dtype(client):
    client.create_tensor_bin("raw", "int64", (3, 2))
    client.write_rows("raw", 1, np.array([[1, 2], [3, 4]], np.int64).tobytes())
    client.write_rows("raw", 0, bytearray(np.array([[7, 8]], np.int64).tobytes()))
    client.write_rows("raw", 0, memoryview(b""))
    assert client.read_rows("raw", 0, 3, tensor_type="numpy").tolist() == [[7, 8], [1, 2], [3, 4]]
    with pytest.raises(tensorshare.InvalidArgumentError, match="whole rows"):
        client.write_rows("raw", 0, b"x" * 15)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.write_rows("raw", 2, b"x" * 32)  # two rows from row 2 of 3
    with pytest.raises(tensorshare.BinNotFoundError):
        client.write_rows("no-such-bin", 0, b"x" * 16)
    # A typed buffer keeps its own dtype and shape.
    client.write_rows("raw", 2, memoryview(bytearray(16)).cast("q", (1, 2)))
    assert client.read_rows("raw", 2, 3, tensor_type="numpy").tolist() == [[0, 0]]
