"""A training script's view of a sharded tensord: three shards (--shard i/3), one Client over all
of them ("A0,A1,A2"), state dicts and experience per run kept together by hash tags, and one shard
killed and restarted from its snapshot in the middle.

What it checks: the other runs keep working while the shard is down; the dead shard's calls fail
fast with tensorshare.ConnectionError (never after the request timeout, never on another shard);
after the restart the same Client works again without being reopened, the snapshot's state dict
is back, versions are above the old ones, and a listener saw disconnected, resubscribed, then the
new put. numpy arrays stand for torch tensors (the same records; torch is not needed here).
"""
import binascii
import threading
import time

import numpy as np
import pytest

import tensorshare

SHARDS = 3
SLOTS = 16384
# seconds; the Client's request timeout: far above the fail-fast bound below
REQUEST_TIMEOUT_S = 10.0
# seconds; a call to a dead shard fails within this (docs/CLUSTER.md: at once)
FAST_S = 2.0
# seconds; the longest a restarted shard may take to answer the same Client again
RECOVER_S = 15.0


def slot(name):
    """docs/PROTOCOL.md section 14: CRC-16/XMODEM of the hash key, mod 16384."""
    key = name.encode()
    i = key.find(b"{")
    if i >= 0:
        j = key.find(b"}", i + 1)
        if j > i + 1:
            key = key[i + 1:j]
    return binascii.crc_hqx(key, 0) % SLOTS


def shard_of(name):
    """The default split: shard i owns [floor(i*16384/3), floor((i+1)*16384/3) - 1]."""
    s = slot(name)
    for i in range(SHARDS):
        if s < (i + 1) * SLOTS // SHARDS:
            return i
    return SHARDS - 1


def run_per_shard():
    """One run name per shard: bins "{run}.params" and "{run}.experience" share its slot."""
    runs = {}
    for k in range(1000):
        name = "run%d" % k
        runs.setdefault(shard_of("{%s}" % name), name)
        if len(runs) == SHARDS:
            return [runs[i] for i in range(SHARDS)]
    raise AssertionError("no run name for some shard")


def state_dict(seed):
    rng = np.random.default_rng(seed)
    return {
        "layer1.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "layer1.bias": rng.standard_normal(16).astype(np.float32),
        "step": seed,
    }


def same_state(a, b):
    return (set(a) == set(b) and a["step"] == b["step"]
            and all(np.array_equal(np.asarray(a[k]), b[k]) for k in b if k != "step"))


def test_cluster_survives_shard_restart(start_tensord, tmp_path):
    victim = 1
    shards = [start_tensord("--shard", "%d/%d" % (i, SHARDS), "--save",
                            str(tmp_path / ("shard%d.tsd" % i)), "--save-interval", "0")
              for i in range(SHARDS)]
    address = ",".join(d.address for d in shards)
    runs = run_per_shard()
    params = ["{%s}.params" % r for r in runs]
    experience = ["{%s}.experience" % r for r in runs]

    c = tensorshare.Client(address, timeout=REQUEST_TIMEOUT_S, tensor_type="numpy")
    try:
        versions = [c.put(params[i], state_dict(100 + i)) for i in range(SHARDS)]
        for i in range(SHARDS):
            c.append(experience[i], {"obs": np.zeros(4, np.float32), "reward": 1.0})
        # Each shard holds its own run's bins, and no other (LIST on one shard is local).
        for i, d in enumerate(shards):
            with tensorshare.Client(d.address, timeout=REQUEST_TIMEOUT_S) as p:
                names = set(p.list())
                assert {params[i], experience[i]} <= names
                assert all(shard_of(n) == i for n in names), names
                if i == victim:
                    p.save()

        events = []
        lock = threading.Lock()

        def on_change(n):
            with lock:
                events.append((n.event, n.version))

        c.listen(params[victim], on_change)

        # SIGKILL by PID: the snapshot written by save() is all the shard keeps.
        d = shards[victim]
        d.proc.kill()
        d.proc.wait()
        d.proc = None

        t0 = time.monotonic()
        with pytest.raises(tensorshare.ConnectionError):
            c.peek(params[victim])
        assert time.monotonic() - t0 < FAST_S
        for i in range(SHARDS):
            if i != victim:
                c.append(experience[i], {"obs": np.ones(4, np.float32), "reward": 0.5})
                assert same_state(c.peek(params[i])[0], state_dict(100 + i))

        d.start()  # the same port, the same snapshot
        deadline = time.monotonic() + RECOVER_S
        while True:
            try:
                got = c.peek(params[victim])
                break
            except tensorshare.ConnectionError:
                assert time.monotonic() < deadline, "the restarted shard never answered"
                time.sleep(0.05)
        assert same_state(got[0], state_dict(100 + victim))
        new_version = c.put(params[victim], state_dict(200))
        assert new_version > versions[victim]
        deadline = time.monotonic() + RECOVER_S
        while time.monotonic() < deadline:
            with lock:
                kinds = [e for e, _ in events]
            if "put" in kinds:
                break
            time.sleep(0.02)
        assert "disconnected" in kinds and "resubscribed" in kinds and "put" in kinds, kinds
        assert kinds.index("disconnected") < kinds.index("resubscribed") < kinds.index("put")
        with lock:
            assert [v for e, v in events if e == "put"][-1] == new_version
        c.unlisten(params[victim])
    finally:
        c.close()
