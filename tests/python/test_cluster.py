"""The Python package over a cluster: tensorshare.Client("A0,A1,A2") with three tensord started
with --shard i/3 puts and gets by name, each bin lands on the shard that owns its name (checked
with a plain Client on each shard), hash tags keep names together, and LIST and STATS merge the
shards (docs/CLUSTER.md)."""
import binascii

import numpy as np

import tensorshare

SHARDS = 3
SLOTS = 16384


def shard_of(name):
    """docs/PROTOCOL.md section 14: CRC-16/XMODEM of the hash key mod 16384, default split."""
    key = name.encode()
    i = key.find(b"{")
    if i >= 0:
        j = key.find(b"}", i + 1)
        if j > i + 1:
            key = key[i + 1:j]
    s = binascii.crc_hqx(key, 0) % SLOTS
    return next(k for k in range(SHARDS) if s < (k + 1) * SLOTS // SHARDS)


def test_cluster_put_get_by_name(start_tensord):
    shards = [start_tensord("--shard", "%d/%d" % (i, SHARDS)) for i in range(SHARDS)]
    names = ["bin%d" % k for k in range(24)] + ["{run7}.params", "{run7}.grads"]
    assert {shard_of(n) for n in names} == set(range(SHARDS))
    with tensorshare.Client(",".join(d.address for d in shards), tensor_type="numpy") as c:
        for k, name in enumerate(names):
            c.put(name, {"x": np.full(4, k, np.float32), "k": k})
        for k, name in enumerate(names):
            got = c.peek(name)[0]
            assert got["k"] == k
            assert np.array_equal(got["x"], np.full(4, k, np.float32))
        assert set(names) <= set(c.list())
        stats = c.stats()
        assert len(stats["shards"]) == SHARDS
        assert stats["shards_down"] == 0
    for i, d in enumerate(shards):
        with tensorshare.Client(d.address) as p:
            here = set(p.list())
        assert here == {n for n in names if shard_of(n) == i}
    assert shard_of("{run7}.params") == shard_of("{run7}.grads") == shard_of("run7")


def test_cluster_wait_on_a_stopped_shard_ends_within_timeout_plus_request_timeout(start_tensord):
    """A wait for a bin whose shard is stopped (SIGSTOP) ends within its timeout plus the request
    timeout, saying that the shard did not answer (it took two request timeouts on top before)."""
    import os
    import signal
    import time

    import pytest

    shards = [start_tensord("--shard", "%d/%d" % (i, SHARDS)) for i in range(SHARDS)]
    stopped = shards[shard_of("bin0")]
    with tensorshare.Client(",".join(d.address for d in shards), timeout=1.0) as c:
        v = c.put("bin0", 1)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(tensorshare.TimeoutError,
                               match="^no reply within the request timeout$"):
                c.wait("bin0", v, timeout=0.5)
            took = time.monotonic() - t0
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        assert 0.9 < took < 0.5 + 1.0 + 0.4
        with pytest.raises(tensorshare.TimeoutError, match="^timed out$"):
            c.wait("bin0", v, timeout=0.1)
