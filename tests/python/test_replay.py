"""Replay tables from Python (Client.table_*; docs/PYTHON.md "Replay tables") against a real
tensord: create, insert and sample with records as dicts of arrays, FIFO order, a prioritized
sampler's stated probabilities, updates and removals by key, the rate limiter's TimeoutError,
bad arguments that change nothing, clashes with other bins."""
import math
import re

import numpy as np
import pytest

import tensorshare


def test_insert_sample_fifo(client):
    st = client.table_create("t", capacity=3, sampler="fifo")
    assert st["size"] == 0
    keys = [client.table_insert("t", {"x": np.arange(4, dtype=np.float32) + i, "i": i}, 1.0)
            for i in range(4)]
    assert keys == [1, 2, 3, 4]  # the FIFO remover evicted key 1
    draws = client.table_sample("t", n=2, timeout_ms=1000)
    assert [d["key"] for d in draws] == [2, 2]
    assert draws[1]["times_sampled"] == 2 and draws[0]["probability"] == 1.0
    assert draws[0]["value"]["i"] == 1
    np.testing.assert_array_equal(np.asarray(draws[0]["value"]["x"]),
                                  np.arange(4, dtype=np.float32) + 1)
    info = client.table_info("t")
    assert info["size"] == 3 and info["inserts"] == 4 and info["deletes"] == 1
    assert info["sampler"] == "fifo" and info["remover"] == "fifo"


def test_prioritized_and_update(client):
    client.table_create("p", capacity=10, sampler="prioritized", priority_exponent=1.0)
    for i, pr in enumerate([1.0, 3.0]):
        client.table_insert("p", {"i": i}, pr)
    d = client.table_sample("p", n=1)
    assert math.isclose(d[0]["probability"], [0.25, 0.75][d[0]["key"] - 1])
    st = client.table_update("p", [1, 2, 77], [0.0, 2.0, 1.0])
    assert st["done"] == 2 and st["skipped"] == 1
    assert all(x["key"] == 2 for x in client.table_sample("p", n=50))
    st = client.table_remove("p", [2, 3])
    assert st["done"] == 1 and st["skipped"] == 1 and st["size"] == 1


def test_rate_limiter_timeout(client):
    client.table_create("r", capacity=10, min_size_to_sample=2)
    client.table_insert("r", {"i": 0})
    with pytest.raises(TimeoutError):
        client.table_sample("r", n=1, timeout_ms=50)
    client.table_create("band", capacity=10, samples_per_insert=1.0, error_buffer=1.0)
    client.table_insert("band", {"i": 0})
    client.table_insert("band", {"i": 1})
    with pytest.raises(TimeoutError):
        client.table_insert("band", {"i": 2}, timeout_ms=0)
    assert client.table_info("band")["inserts"] == 2


def test_bad_input_changes_nothing(client):
    with pytest.raises(ValueError):
        client.table_create("b", sampler="nope")
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.table_create("b", capacity=0)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.table_create("b", priority_exponent=float("nan"))
    with pytest.raises(tensorshare.BinNotFoundError):
        client.table_info("b")
    client.table_create("b", capacity=5)
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.table_insert("b", {"i": 0}, float("nan"))
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.table_update("b", [1], [-1.0])
    assert client.table_info("b")["size"] == 0
    client.put("plain", {"i": 1})
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.table_create("plain")
    with pytest.raises(tensorshare.InvalidArgumentError):
        client.put("b", {"i": 1})
    assert client.delete("b") == 0


IAE = tensorshare.InvalidArgumentError
U32 = "from 0 to 4294967295"
MS = "timeout_ms must be an int from 0 to 2147483647"


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda c: c.table_create("n", max_times_sampled=2**32), IAE,
                 "max_times_sampled must be an int %s, not 4294967296" % U32, id="max_times"),
    pytest.param(lambda c: c.table_create("n", max_times_sampled=2**32 + 3), IAE,
                 "max_times_sampled must be an int %s, not 4294967299" % U32, id="max_times_3"),
    pytest.param(lambda c: c.table_create("n", max_times_sampled=-1), IAE,
                 "max_times_sampled must be an int %s, not -1" % U32, id="max_times_neg"),
    pytest.param(lambda c: c.table_create("n", min_size_to_sample=2**64 + 1), IAE,
                 "min_size_to_sample must be an int from 1 to 2**64-1", id="min_size"),
    pytest.param(lambda c: c.table_create("n", capacity=2**64), IAE,
                 "capacity must be an int from 1 to 16777216, not 18446744073709551616",
                 id="capacity"),
    pytest.param(lambda c: c.table_create("n", capacity=-1), IAE,
                 "capacity must be an int from 1 to 16777216, not -1", id="capacity_neg"),
    pytest.param(lambda c: c.table_create("n", capacity=True), TypeError,
                 "capacity must be an int, not bool", id="capacity_bool"),
    pytest.param(lambda c: c.table_sample("t", 2**32 + 1), IAE,
                 "n must be an int from 1 to 1024, not 4294967297", id="n"),
    pytest.param(lambda c: c.table_sample("t", -1), IAE,
                 "n must be an int from 1 to 1024, not -1", id="n_neg"),
    pytest.param(lambda c: c.table_sample("t", 1.0), TypeError, "n must be an int, not float",
                 id="n_float"),
    pytest.param(lambda c: c.table_sample("t", 1, 2**32 + 5), ValueError, MS, id="sample_wait"),
    pytest.param(lambda c: c.table_insert("t", 1, 1.0, -1), ValueError, MS + ", not -1",
                 id="insert_wait"),
    pytest.param(lambda c: c.table_insert("t", 1, 1.0, True), TypeError,
                 "timeout_ms must be an int, not bool", id="insert_wait_bool"),
    pytest.param(lambda c: c.table_update("t", [-1], [1.0]), IAE,
                 "keys[0] must be an int from 0 to 2**64-1, not -1", id="update_key"),
    pytest.param(lambda c: c.table_remove("t", [1, 2**64 + 1]), IAE,
                 "keys[1] must be an int from 0 to 2**64-1", id="remove_key"),
])
def test_out_of_range_ints_are_refused(client, call, error, message):
    """An int that does not fit its argument is refused and changes nothing, never cut to fit
    (2**32 + 1 taken as 1); bad values of the table's settings and keys raise
    InvalidArgumentError, as the other bad values do."""
    client.table_create("t", capacity=5)
    client.table_insert("t", {"i": 0})
    with pytest.raises(error, match=re.escape(message)):
        call(client)
    info = client.table_info("t")
    assert (info["size"], info["inserts"], info["samples"]) == (1, 1, 0)
    with pytest.raises(tensorshare.BinNotFoundError):
        client.table_info("n")
