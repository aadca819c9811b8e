"""tensorshare.compat: the original tensorshare's API over tensord.

The original README's client example runs unchanged but for its import line
(compat_readme_example.py, run by compat_run.py in a subprocess); the other tests check the
callback messages, the thread callbacks run on, listen/ignore, stop's draining and the RL
classes of the original.
"""
import os
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# seconds; the longest a test waits for a callback or a subprocess (bounded, CI has 2 cores)
WAIT_S = 30.0

torch = pytest.importorskip("torch", reason="the original's API hands out torch tensors")


def _env(port):
    env = dict(os.environ)
    env["TS_TEST_PORT"] = str(port)
    pkg = os.environ.get("TS_PYTHONPATH")
    if pkg:
        env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_readme_example_runs_unchanged(tensord):
    """The README's client example, only its import changed, runs to its end and prints all."""
    with open(os.path.join(HERE, "compat_readme_example.py")) as f:
        first = f.readline()
    assert first == "from tensorshare.compat import TensorShare\n"
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "compat_run.py"), "compat_readme_example.py"],
        cwd=HERE, env=_env(tensord.port), capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "peek data_bin {'status': 'OK', 'data': {'a': tensor(" in text
    assert "'version': 0}" in text
    assert "Bin xyz updated. Num items: " in text
    assert "get xyz {'status': 'OK', 'data': " in text
    # The list callback prints the bins, then stops the client: start() returned (exit 0).
    assert "{'status': 'OK', 'data': {" in text and "'data_bin': 1" in text


class Running:
    """A compat.TensorShare whose start() runs on a thread of its own, as the reactor did."""

    def __init__(self, port):
        from tensorshare.compat import TensorShare

        self.ts = TensorShare("127.0.0.1", port)
        self.thread = threading.Thread(target=self.ts.start, daemon=True)
        self.thread.start()

    def call(self, method, *args):
        """Call method(*args, callback) and wait for the callback's message."""
        done = threading.Event()
        got = {}

        def cb(msg):
            got["msg"] = msg
            got["thread"] = threading.get_ident()
            done.set()

        getattr(self.ts, method)(*args, cb)
        assert done.wait(WAIT_S), method
        assert got["thread"] == self.thread.ident, "callbacks run on the start() thread"
        return got["msg"]

    def stop(self):
        self.ts.stop()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def ts(tensord):
    r = Running(tensord.port)
    yield r
    r.stop()


def test_put_get_peek_list_delete_messages(ts):
    assert ts.call("put", "b", {"a": torch.arange(3), "version": 0}) == {"status": "OK"}
    peek = ts.call("peek", "b")
    assert peek["status"] == "OK" and torch.equal(peek["data"]["a"], torch.arange(3))
    assert ts.call("list") == {"status": "OK", "data": {"b": 1}}
    assert ts.call("append", "b", torch.ones(2)) == {"status": "OK"}
    got = ts.call("get", "b")
    # More than one item: the list of items, oldest first (the get removed them all).
    assert isinstance(got["data"], list) and len(got["data"]) == 2
    assert torch.equal(got["data"][1], torch.ones(2))
    assert ts.call("list") == {"status": "OK", "data": {}}
    # A bin made by a single append gives the object itself, as in the original.
    assert ts.call("append", "one", torch.zeros(1)) == {"status": "OK"}
    assert torch.equal(ts.call("get", "one")["data"], torch.zeros(1))
    # delete of a missing bin is OK, as in the original.
    assert ts.call("delete", "missing") == {"status": "OK"}


def test_errors_are_err_messages_with_the_original_prefixes(ts):
    miss = ts.call("get", "nothing")
    assert miss["status"] == "ERR" and miss["msg"].startswith("Failed to retrieve data: ")
    assert "BinNotFoundError" in miss["msg"]
    peek = ts.call("peek", "nothing")
    assert peek["status"] == "ERR" and peek["msg"].startswith("Failed to retrieve data: ")
    # Objects that are not records are refused (nothing is pickled).
    bad = ts.call("put", "b", object())
    assert bad["status"] == "ERR" and bad["msg"].startswith("Failed to put data: ")
    bad = ts.call("append", "b", object())
    assert bad["status"] == "ERR" and bad["msg"].startswith("Failed to append data: ")
    ign = ts.call("ignore", "never-listened")
    assert ign["status"] == "ERR" and ign["msg"].startswith("Failed to unregister as listener: ")


def test_listen_reports_every_change_and_ignore_stops_it(ts):
    notes = []
    seen = threading.Condition()

    def on_change(msg):
        with seen:
            notes.append(msg)
            seen.notify_all()

    ts.ts.listen("x", on_change)  # returns once tensord confirmed it
    assert ts.call("put", "x", torch.ones(1))["status"] == "OK"
    assert ts.call("append", "x", torch.ones(1))["status"] == "OK"
    assert ts.call("get", "x")["status"] == "OK"
    with seen:
        assert seen.wait_for(lambda: len(notes) >= 3, WAIT_S)
    assert notes[:3] == [{"status": "OK", "bin": "x", "n_items": n} for n in (1, 2, 0)]
    assert ts.call("ignore", "x") == {"status": "OK"}
    assert ts.call("put", "x", torch.ones(1))["status"] == "OK"
    assert ts.call("list")["status"] == "OK"  # a round trip after the put
    time.sleep(0.1)
    assert len(notes) == 3


def test_stop_lets_earlier_requests_finish_and_is_idempotent(tensord):
    from tensorshare.compat import TensorShare

    ts = TensorShare("127.0.0.1", tensord.port)
    results = []
    # Requested before start(): their callbacks run once start() runs, on its thread.
    for i in range(20):
        ts.put("b%d" % i, torch.full((1000,), float(i)), results.append)
    ts.list(lambda msg: (results.append(msg), ts.stop()))
    ts.start()  # returns after stop(), once every earlier request completed
    assert len(results) == 21 and all(r["status"] == "OK" for r in results)
    assert len(results[-1]["data"]) == 20
    ts.stop()  # a second stop is a no-op
    with pytest.raises(RuntimeError):
        ts.put("late", torch.ones(1))


def test_unreachable_server_raises_instead_of_hanging(tensord):
    import tensorshare
    from tensorshare.compat import TensorShare

    port = tensord.port
    tensord.stop()
    with pytest.raises(tensorshare.ConnectionError):
        TensorShare("127.0.0.1", port, timeout=2)


def test_rl_trainer_and_worker_of_the_original(tensord):
    from tensorshare.compat import RLTrainer, RLWorker

    trainer = RLTrainer("127.0.0.1", tensord.port, False, filter_version=True)
    worker = RLWorker("127.0.0.1", tensord.port)
    threads = [threading.Thread(target=x.start, daemon=True) for x in (trainer, worker)]
    for t in threads:
        t.start()
    try:
        assert worker.get_parameters() is None
        assert trainer.get_data() == []
        net = torch.nn.Linear(4, 2)
        assert trainer.publish_parameters(net.state_dict()) == 0
        params = worker.await_new_parameters(timeout=WAIT_S)
        net2 = torch.nn.Linear(4, 2)
        net2.load_state_dict(params)  # a state dict of torch tensors
        assert torch.equal(net2.weight, net.weight)
        # Nothing newer: the timeout returns the current parameters, as the original did.
        assert torch.equal(worker.await_new_parameters(timeout=0.1)["weight"], net.weight)
        for i in range(3):
            worker.add_data(torch.full((1, 4), float(i)))
        deadline = time.monotonic() + WAIT_S
        data, versions = [], []
        while len(data) < 3 and time.monotonic() < deadline:
            d, v = trainer.get_data(return_versions=True)
            data += d
            versions += v
            time.sleep(0.01)
        assert versions == [0, 0, 0]
        assert [float(x[0, 0]) for x in data] == [0.0, 1.0, 2.0]
        # After publish 1, experience tagged 0 is dropped when read.
        assert trainer.publish_parameters(net.state_dict()) == 1
        worker.add_data(torch.zeros(1, 4))  # still tagged 0: 1 was not retrieved yet
        worker._worker.flush(timeout=WAIT_S)
        assert trainer.get_data() == []
        assert worker.get_parameters() is not None
        worker.add_data(torch.ones(1, 4))  # tagged 1
        worker._worker.flush(timeout=WAIT_S)
        assert len(trainer.get_data()) == 1
    finally:
        trainer.stop()
        worker.stop()
        worker.stop()  # twice, as the README's pattern does
        for t in threads:
            t.join(WAIT_S)
            assert not t.is_alive()


def test_rl_trainer_hosting_the_server():
    """host_server=True starts tensord ($TS_TENSORD) on the port and stop() ends it."""
    import socket

    from tensorshare.compat import RLTrainer, RLWorker

    if not os.environ.get("TS_TENSORD"):
        pytest.skip("TS_TENSORD is not set (ctest sets it)")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    trainer = RLTrainer("127.0.0.1", port, True)
    try:
        worker = RLWorker("127.0.0.1", port)
        trainer.publish_parameters({"w": torch.ones(2)})
        assert torch.equal(worker.await_new_parameters(WAIT_S)["w"], torch.ones(2))
        worker.stop()
    finally:
        trainer.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
