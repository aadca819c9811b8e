"""Values both ways: every dtype bit-exact through torch and numpy, 0-d to 8-d, nested records,
zero-copy views that keep their receive buffer alive, and bad input refused before sending."""
import ctypes
import gc
import os

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare import _tensorshare

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128]


def numpy_dtypes():
    return [np.dtype(np.bool_), np.dtype(np.uint8), np.dtype(np.int8), np.dtype(np.int16),
            np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float16),
            tensorshare.numpy_bfloat16, np.dtype(np.float32), np.dtype(np.float64),
            np.dtype(np.complex64), np.dtype(np.complex128)]


def torch_bytes(t):
    """The tensor's memory, whatever its dtype (bfloat16 has no numpy view)."""
    assert t.is_contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def random_torch(dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        raw = bytearray(np.random.randint(0, 2, n, dtype=np.uint8).tobytes())
    else:
        # Random bits: NaNs, infinities and denormals included, to check bit-exactness.
        raw = bytearray(os.urandom(n * size))
    return torch.frombuffer(raw, dtype=dtype).reshape(shape).clone()


def random_numpy(dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    if dtype == np.bool_:
        return np.random.randint(0, 2, shape).astype(np.bool_)
    return np.frombuffer(os.urandom(n * dtype.itemsize), dtype=dtype).reshape(shape).copy()


SHAPES = [(), (3,), (2, 3), (2, 1, 3), (1, 2, 2, 2), (2,) * 5, (2,) * 6, (1, 2) * 3 + (2,),
          (2,) * 8]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_dtypes_and_ranks_round_trip(client, dtype):
    for shape in SHAPES:
        t = random_torch(dtype, shape)
        client.put("t", t)
        [r] = client.get("t")
        assert isinstance(r, torch.Tensor)
        assert r.dtype == dtype and tuple(r.shape) == shape
        assert torch_bytes(r) == torch_bytes(t)


@pytest.mark.parametrize("idx", range(12))
def test_numpy_dtypes_and_ranks_round_trip(client, idx):
    dtype = numpy_dtypes()[idx]
    for shape in SHAPES:
        a = random_numpy(dtype, shape)
        client.put("n", a)
        [r] = client.get("n", tensor_type="numpy")
        assert isinstance(r, np.ndarray)
        assert r.dtype == dtype and r.shape == shape
        assert r.tobytes() == a.tobytes()
        assert not r.flags.writeable


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_to_numpy_and_back(client, dtype):
    t = random_torch(dtype, (4, 5))
    client.put("x", t)
    [a] = client.get("x", tensor_type="numpy")
    assert a.tobytes() == torch_bytes(t)
    client.put("x", a)
    [back] = client.get("x", tensor_type="torch")
    assert back.dtype == dtype
    assert torch_bytes(back) == torch_bytes(t)


def test_client_tensor_type_numpy(tensord):
    with tensorshare.Client(tensord.address, tensor_type="numpy") as c:
        assert c.tensor_type == "numpy"
        c.put("b", torch.arange(4))
        [a] = c.peek("b")
        assert isinstance(a, np.ndarray)
        [t] = c.peek("b", tensor_type="torch")
        assert isinstance(t, torch.Tensor)
    with pytest.raises(ValueError):
        tensorshare.Client(tensord.address, tensor_type="jax")


def test_nested_records(client):
    rec = {
        "params": {"w": torch.randn(3, 4), "b": np.arange(4, dtype=np.float32),
                   "layers": [{"k": torch.ones(2)}, {"k": torch.zeros(2, dtype=torch.int8)}]},
        "version": 7,
        "big": 2**63 - 1,
        "small": -(2**63),
        "pi": 3.25,
        "inf": float("inf"),
        "name": "grüße \u2603",
        "blob": b"\x00\x01\xff",
        "empty": {},
        "nothing": [],
        "tuple": (1, 2.0, "x"),
        "flag": True,
        "scalar": np.float32(1.5),
    }
    client.put("rec", rec)
    [r] = client.get("rec")
    assert r["version"] == 7 and r["big"] == 2**63 - 1 and r["small"] == -(2**63)
    assert r["pi"] == 3.25 and r["inf"] == float("inf")
    assert r["name"] == "grüße \u2603" and r["blob"] == b"\x00\x01\xff"
    assert r["empty"] == {} and r["nothing"] == [] and r["tuple"] == [1, 2.0, "x"]
    assert r["flag"] == 1
    assert torch.equal(r["params"]["w"], rec["params"]["w"])
    assert torch.equal(r["params"]["b"], torch.arange(4, dtype=torch.float32))
    assert torch.equal(r["params"]["layers"][1]["k"], torch.zeros(2, dtype=torch.int8))
    assert r["scalar"].shape == () and float(r["scalar"]) == 1.5
    assert list(r.keys()) == list(rec.keys())


NUMPY_SCALARS = [np.bool_(True), np.uint8(200), np.int8(-5), np.int16(-300), np.int32(-70000),
                 np.int64(-(2**40)), np.float16(1.5), np.float32(2.25), np.float64(3.125),
                 np.complex64(1 - 2j), np.complex128(3 + 4j)]


@pytest.mark.parametrize("scalar", NUMPY_SCALARS, ids=[type(s).__name__ for s in NUMPY_SCALARS])
def test_numpy_scalars_are_0d_tensors(client, scalar):
    """Every numpy scalar arrives as a 0-d array of its dtype, numpy.float64 (a float
    subclass) included."""
    client.put("s", {"x": scalar, "l": [scalar]})
    [r] = client.get("s", tensor_type="numpy")
    for got in (r["x"], r["l"][0]):
        assert isinstance(got, np.ndarray), type(got)
        assert got.shape == () and got.dtype == scalar.dtype and got[()] == scalar


def test_numpy_string_scalars_and_plain_numbers_stay_what_they_are(client):
    client.put("s", [np.str_("ab"), np.bytes_(b"cd"), 1.5, 7, True])
    [r] = client.get("s")
    assert r == ["ab", b"cd", 1.5, 7, 1]
    assert [type(x) for x in r] == [str, bytes, float, int, int]


def test_non_contiguous_inputs_are_sent_contiguous(client):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    assert not t.is_contiguous()
    a = np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2]
    client.put("nc", {"t": t, "a": a})
    [r] = client.get("nc")
    assert torch.equal(r["t"], t.contiguous())
    assert np.array_equal(r["a"].numpy(), a)


def test_requires_grad_and_slices(client):
    p = torch.nn.Parameter(torch.randn(3, 3))
    row = torch.arange(10)[3:7]  # a view with a storage offset
    client.put("g", {"p": p, "row": row})
    [r] = client.get("g")
    assert torch.equal(r["p"], p.detach())
    assert torch.equal(r["row"], torch.arange(3, 7))


def test_received_tensors_are_views_of_one_buffer(client):
    a = torch.randn(256)
    b = torch.randn(256)
    client.append("z", {"a": a, "b": b})
    client.append("z", {"a": a, "b": b})
    base = _tensorshare._live_views()
    items = client.get("z")
    assert _tensorshare._live_views() == base + 4
    ptrs = sorted(t.data_ptr() for item in items for t in item.values())
    # All four tensors lie in the one receive buffer of the reply: a copy per tensor would
    # land in separate allocations, not within the reply's few kilobytes.
    assert ptrs[-1] - ptrs[0] < 4 * 1024 + 4 * 256 * 4
    assert all(p % 64 == 0 for p in ptrs)  # tensorshare's 64-byte alignment, not torch's copy
    del items
    gc.collect()
    assert _tensorshare._live_views() == base


def test_views_outlive_the_client(tensord):
    c = tensorshare.Client(tensord.address)
    t = torch.arange(1 << 16, dtype=torch.int32)
    c.put("keep", {"t": t, "n": np.arange(10)})
    [r] = c.get("keep", tensor_type="numpy")
    base = _tensorshare._live_views()
    c.close()
    del c
    gc.collect()
    # Other traffic reuses whatever the client freed; the views must still read their data.
    with tensorshare.Client(tensord.address) as c2:
        for i in range(20):
            c2.put("other", torch.full((1 << 16,), i, dtype=torch.int32))
            c2.get("other")
    assert np.array_equal(r["t"], t.numpy())
    assert np.array_equal(r["n"], np.arange(10))
    tensor = torch.from_numpy(r["t"].copy())
    assert torch.equal(tensor, t)
    del r
    gc.collect()
    assert _tensorshare._live_views() == base - 2


class FakeCudaTensor:
    """What a CUDA tensor looks like to DLPack consumers (device type 2 = kDLCUDA)."""

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        raise AssertionError("must not be exported")


BAD_VALUES = [
    ("uint16", lambda: np.zeros(3, dtype=np.uint16), "unsupported dtype"),
    ("uint64", lambda: np.zeros(3, dtype=np.uint64), "unsupported dtype"),
    ("object", lambda: np.array([1, "a"], dtype=object), "object arrays"),
    ("big-endian", lambda: np.zeros(3, dtype=">f4"), "unsupported dtype"),
    ("9-d", lambda: torch.zeros((1,) * 9), "at most 8"),
    ("9-d numpy", lambda: np.zeros((1,) * 9), "at most 8"),
    ("deep", lambda: nest(40), "deeper than"),
    ("cycle", lambda: cycle(), "deeper than"),
    ("None", lambda: {"a": None}, "NoneType"),
    ("set", lambda: {1, 2}, "set"),
    ("int key", lambda: {1: 2}, "keys must be str"),
    ("NUL key", lambda: {"a\0b": 1}, "NUL"),
    ("huge int", lambda: 2**64, "64-bit"),
    ("cuda", lambda: FakeCudaTensor(), "copied to the host"),
]


def nest(depth):
    v = 1
    for _ in range(depth):
        v = [v]
    return v


def cycle():
    a = []
    a.append(a)
    return a


@pytest.mark.parametrize("name,make,words", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_are_refused_and_change_nothing(client, name, make, words):
    client.put("keep", {"x": 1})
    before = client.list()
    with pytest.raises(tensorshare.RecordError) as info:
        client.put("keep", make())
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, tensorshare.Error)
    assert words in str(info.value)
    with pytest.raises(tensorshare.RecordError):
        client.append("new-bin", {"ok": 1, "bad": make()})
    assert client.list() == before
    assert client.peek("keep") == [{"x": 1}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensor_refused(client):
    with pytest.raises(tensorshare.RecordError, match="cpu"):
        client.put("c", torch.ones(3, device="cuda"))
    with pytest.raises(tensorshare.BinNotFoundError):
        client.peek("c")



NO_COPY_SCRIPT = """
import gc, resource, sys
import numpy as np, torch
import tensorshare
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kind, size = sys.argv[2], 96 << 20
c = tensorshare.Client(sys.argv[1])
big = torch.ones(size, dtype=torch.uint8) if kind == "torch" else np.ones(size, dtype=np.uint8)
gc.collect()
p0 = peak()
c.put("big", {"t": big})
p1 = peak()
[r] = c.get("big", tensor_type=kind)
p2 = peak()
assert int(r["t"][-1]) == 1 and r["t"].shape[0] == size
print(size, p1 - p0, p2 - p1)
"""


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_big_put_and_get_make_no_copies(tensord, kind):
    """A put reads the caller's memory in place, and a get's tensors are views of the one
    receive buffer: the peak memory of a fresh process grows by the received bytes once."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.environ.get("TS_PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", NO_COPY_SCRIPT, tensord.address, kind],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    size, put_growth, get_growth = map(int, p.stdout.split())
    assert put_growth < size // 4
    # One receive buffer of size bytes; a copy into torch or numpy memory would double it.
    assert get_growth < size + size // 2


MISSING_NUMPY_SCRIPT = """
import sys
sys.modules["numpy"] = None  # import numpy now raises ImportError
import tensorshare
c = tensorshare.Client(sys.argv[1], tensor_type="numpy")
c.put("a", {"m": memoryview(bytes(range(8))).cast("B", (2, 4))})  # no numpy needed to send
for get in (lambda: c.get("a"), lambda: c.get_async("a").result(10)):
    try:
        get()
        print("no error")
    except ImportError:
        pass
print(c.list()["a"].n_items)
"""


def test_get_without_the_tensor_module_takes_nothing(tensord):
    """A get whose tensors cannot be made (numpy missing) fails before it removes anything."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.environ.get("TS_PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", MISSING_NUMPY_SCRIPT, tensord.address],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1"]
