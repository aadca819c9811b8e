"""Values at the edges of what a record holds: torch's lazy conjugate and negative views, empty
tensors, dtypes torch and numpy cannot export, look-alikes of numpy_bfloat16, and a dict that
changes while it is converted. Each refused value changes nothing on the server."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import tensorshare


def test_lazy_conjugate_and_negative_views_send_their_values(client):
    """torch keeps .conj() (and the imaginary part of one) as a flag over the same memory: the
    values sent must be the tensor's values, not the memory's."""
    conj = torch.tensor([1 + 2j, 3 - 4j]).conj()
    neg = torch.tensor([1 + 2j, 5 + 6j]).conj().imag
    assert conj.is_conj() and neg.is_neg()
    client.put("lazy", {"conj": conj, "neg": neg})
    [r] = client.get("lazy")
    assert r["conj"].tolist() == [1 - 2j, 3 + 4j]
    assert r["neg"].tolist() == [-2.0, -6.0]


EMPTY_TORCH = [
    ("0x3", lambda: torch.empty(0, 3)),
    ("3x0 transposed", lambda: torch.empty(3, 0).t()),
    ("bfloat16 0x2", lambda: torch.empty(0, 2, dtype=torch.bfloat16)),
    ("bool 0", lambda: torch.empty(0, dtype=torch.bool)),
    ("8-d with a 0", lambda: torch.empty((2, 1, 0, 1, 1, 1, 1, 2))),
]


@pytest.mark.parametrize("make", [e[1] for e in EMPTY_TORCH], ids=[e[0] for e in EMPTY_TORCH])
@pytest.mark.parametrize("tensor_type", ["torch", "numpy"])
def test_empty_tensors_round_trip(client, make, tensor_type):
    t = make()
    client.put("empty", {"t": t})
    [r] = client.get("empty", tensor_type=tensor_type)
    assert tuple(r["t"].shape) == tuple(t.shape)
    if tensor_type == "torch":
        assert r["t"].dtype == t.dtype


def test_empty_numpy_arrays_round_trip(client):
    for a in (np.empty((2, 0)), np.empty((3, 0), np.int8).T, np.empty(0, np.bool_)):
        client.put("empty", a)
        [r] = client.get("empty", tensor_type="numpy")
        assert r.shape == a.shape and r.dtype == a.dtype


REFUSED = [
    ("datetime64", lambda: np.array(["2020-01-01"], dtype="datetime64[D]")),
    ("timedelta64", lambda: np.zeros(2, dtype="timedelta64[s]")),
    ("sparse", lambda: torch.eye(3).to_sparse()),
    ("meta", lambda: torch.empty(3, device="meta")),
    ("quantized", lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)),
    # Structured dtypes that only resemble tensorshare.numpy_bfloat16.
    ("bfloat16 of two u1", lambda: np.zeros(3, dtype=[("x", "u1"), ("bfloat16", "u1")])),
    ("bfloat16 field of f2", lambda: np.zeros(3, dtype=[("bfloat16", "<f2")])),
    ("bfloat16 field of i2", lambda: np.zeros(3, dtype=[("bfloat16", "<i2")])),
]


@pytest.mark.parametrize("make", [r[1] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_unsendable_tensors_are_record_errors_and_change_nothing(client, make):
    client.put("keep", {"x": 1})
    before = client.list()
    with pytest.raises(tensorshare.RecordError) as info:
        client.put("keep", {"bad": make()})
    assert info.value.name == "EBADRECORD" and isinstance(info.value, ValueError)
    with pytest.raises(tensorshare.RecordError):
        client.append_async("new-bin", [make()])
    assert client.list() == before
    assert client.peek("keep") == [{"x": 1}]


def test_numpy_bfloat16_is_still_bfloat16(client):
    a = np.frombuffer(bytes([0x80, 0x3F, 0x00, 0x40]), dtype=tensorshare.numpy_bfloat16)
    client.put("bf", a)
    [t] = client.get("bf")
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, 2.0]


MUTATING_DICT_SCRIPT = """
import sys
import numpy as np
import tensorshare

class ClearsTheDict:
    # A tensor-like object whose export empties the dict it is in: the key being converted is
    # then freed (under -X dev its memory is overwritten at once).
    def __init__(self, d):
        self.d = d
    def __dlpack_device__(self):
        self.d.clear()
        return (1, 0)
    def __dlpack__(self, stream=None):
        return np.arange(3, dtype=np.int32).__dlpack__()

key = "".join(["key-", "k" * 40])  # made at run time: the dict holds its only reference
d = {}
d[key] = ClearsTheDict(d)
del key
c = tensorshare.Client(sys.argv[1])
c.put("m", d)
[r] = c.get("m", tensor_type="numpy")
print(list(r.keys()) == ["key-" + "k" * 40] and r["key-" + "k" * 40].tolist() == [0, 1, 2])
"""


def test_dict_changed_during_its_conversion(tensord):
    """Converting a value may run Python code that changes the dict being converted: the key
    in use must stay valid (no use after free)."""
    env = dict(os.environ, PYTHONPATH=os.environ.get("TS_PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-X", "dev", "-c", MUTATING_DICT_SCRIPT,
                        tensord.address], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "True"


class NotACapsule:
    """A __dlpack__ that hands back something other than an unused DLPack capsule."""

    def __init__(self, what):
        self.what = what

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None):
        if self.what == "used":
            capsule = np.arange(3).__dlpack__()
            torch.utils.dlpack.from_dlpack(capsule)  # consumes it: renamed "used_dltensor"
            return capsule
        return 42


@pytest.mark.parametrize("what", ["int", "used"])
def test_bad_dlpack_exports_are_record_errors(client, what):
    client.put("keep", 1)
    with pytest.raises(tensorshare.RecordError, match="NotACapsule"):
        client.put("keep", {"t": NotACapsule(what)})
    assert client.peek("keep") == [1]


def test_huge_broadcast_views_are_refused_without_being_sent(client):
    """A stride-0 view claims 2**60 bytes that do not exist: making it contiguous fails (no
    allocator gives that much, whatever the overcommit setting) with a clear exception, and
    nothing reaches the server."""
    huge = 1 << 60
    a = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), shape=(huge,), strides=(0,))
    t = torch.zeros(1, dtype=torch.uint8).expand(huge)
    client.put("keep", 1)
    for value in (a, t, {"nested": [a]}):
        with pytest.raises((MemoryError, tensorshare.RecordError)):
            client.put("keep", value)
    assert client.peek("keep") == [1]
    assert list(client.list()) == ["keep"]


def test_received_numpy_memory_refuses_a_fortran_order_request(client):
    """The memory of a received array is C-ordered: a consumer asking for Fortran order through
    the buffer protocol gets BufferError, not C-ordered memory it would read transposed."""
    import ctypes

    client.put("f", np.arange(6, dtype=np.int32).reshape(2, 3))
    [a] = client.get("f", tensor_type="numpy")
    owner = a.base
    while not type(owner).__name__ == "View":
        owner = owner.obj if isinstance(owner, memoryview) else owner.base

    class Buffer(ctypes.Structure):
        _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p),
                    ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
                    ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                    ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
                    ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
                    ("internal", ctypes.c_void_p)]

    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(Buffer), ctypes.c_int]
    release = ctypes.pythonapi.PyBuffer_Release
    release.argtypes = [ctypes.POINTER(Buffer)]
    strides_nd = 0x0010 | 0x0008  # PyBUF_STRIDES (with PyBUF_ND)
    for contiguity, ok in ((0x0020, True), (0x0080, True), (0x0040, False)):  # C, ANY, F
        b = Buffer()
        if ok:
            assert get(owner, ctypes.byref(b), contiguity | strides_nd) == 0
            assert b.ndim == 2
            release(ctypes.byref(b))
        else:
            with pytest.raises(BufferError):
                get(owner, ctypes.byref(b), contiguity | strides_nd)
    del a, owner


DEFAULT_TYPE_SCRIPT = r"""
import sys
import numpy as np
import tensorshare

class Refuse:
    '''Makes `import torch` raise exc (a Ctrl-C during the import, or torch missing).'''
    def __init__(self, exc):
        self.exc = exc
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise self.exc
        return None

c = tensorshare.Client(sys.argv[1])
c.put("b", {"x": np.zeros(2, np.float32)})
finder = Refuse(KeyboardInterrupt())
sys.meta_path.insert(0, finder)
try:
    c.peek("b")
    print("no KeyboardInterrupt")
except KeyboardInterrupt:
    print("KeyboardInterrupt")
try:
    print(c.tensor_type)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
finder.exc = ModuleNotFoundError("No module named 'torch'")
if sys.argv[2] == "missing":  # a missing torch decides the default: numpy, for good
    print(type(c.peek("b")[0]["x"]).__module__, c.tensor_type)
    sys.meta_path.remove(finder)
    print(type(c.peek("b")[0]["x"]).__module__, c.tensor_type)
else:  # the interrupted import decided nothing: the next conversion imports torch
    sys.meta_path.remove(finder)
    print(type(c.peek("b")[0]["x"]).__module__, c.tensor_type)
c.close()
"""


@pytest.mark.parametrize("then, expect", [
    ("present", ["KeyboardInterrupt", "KeyboardInterrupt", "torch torch"]),
    ("missing", ["KeyboardInterrupt", "KeyboardInterrupt", "numpy numpy", "numpy numpy"]),
])
def test_default_tensor_type_only_import_error_means_no_torch(tensord, then, expect):
    """The process default tensor type is decided by the first conversion that needs it, which
    imports torch: only an ImportError means "no torch" (numpy from then on); a Ctrl-C during
    the import is raised and decides nothing."""
    env = dict(os.environ, PYTHONPATH=os.environ.get("TS_PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", DEFAULT_TYPE_SCRIPT, tensord.address, then],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:-1] == expect
