"""tensorshare.RLTrainer and RLWorker (rl.h from Python).

The trainer runs in the test's process and the workers in processes of their own
(rl_worker_proc.py), as in a real setup; the other tests check the API's semantics in one
process: versions, the staleness filter, timeouts told apart from updates, borrowed adds,
on_event, and closing.
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tensorshare
from tensorshare.rl import NO_FILTER, Batch, Params, RLTrainer, RLWorker

HERE = os.path.dirname(os.path.abspath(__file__))
# seconds; the longest any wait of these tests may take (bounded; CI has 2 cores)
WAIT_S = 30.0


def _env():
    env = dict(os.environ)
    pkg = os.environ.get("TS_PYTHONPATH")
    if pkg:
        env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _collect_n(trainer, n):
    """Collect until n items arrived (bounded by WAIT_S); returns the items."""
    got = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, "only %d of %d items arrived" % (len(got), n)
        try:
            got += trainer.collect(0, timeout=min(left, 1.0))
        except tensorshare.TimeoutError:
            pass
    return got


def test_trainer_and_worker_processes(tensord, client):
    """Two worker processes: experience comes back tagged with the version each worker used."""
    workers, items = 2, 5
    trainer = RLTrainer(client, prefix="t/", tensor_type="numpy")
    assert trainer.publish({"w": np.full(4, 10.0, dtype=np.float32)}) == 0
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "rl_worker_proc.py"),
                               tensord.address, str(i), str(items)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
             for i in range(workers)]
    try:
        first = _collect_n(trainer, workers * items)
        assert len(first) == workers * items
        assert {v for _, v in first} == {0}
        seen = {(d["worker"], d["seq"]) for d, _ in first}
        assert seen == {(w, s) for w in range(workers) for s in range(items)}
        for d, _ in first:
            assert np.array_equal(d["x"], np.full(4, 10.0 + d["seq"], dtype=np.float32))
        assert trainer.publish({"w": np.full(4, 20.0, dtype=np.float32)}) == 1
        second = _collect_n(trainer, workers * items)
        assert {v for _, v in second} == {1}
        assert all(d["x"][0] == 20.0 + d["seq"] for d, _ in second)
        for p in procs:
            out, err = p.communicate(timeout=WAIT_S)
            assert p.returncode == 0, err
            stats = json.loads(out.strip().splitlines()[-1])
            assert stats["added"] == 2 * items and stats["add_failed"] == 0
            assert stats["retrieved_version"] == 1
        st = trainer.stats()
        assert st["received"] == 2 * workers * items and st["dropped_stale"] == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        trainer.close()


def test_versions_resume_and_the_staleness_filter(client):
    trainer = RLTrainer(client)
    assert trainer.version == -1
    worker = RLWorker(client)
    assert worker.params() is None
    assert trainer.publish({"w": np.zeros(2, dtype=np.float32)}) == 0
    p = worker.await_params(timeout=WAIT_S)
    assert isinstance(p, Params) and p.version == 0
    worker.add(np.ones(3, dtype=np.float32))  # tagged 0
    worker.flush(timeout=WAIT_S)
    assert trainer.publish({"w": np.ones(2, dtype=np.float32)}) == 1
    worker.add(np.ones(3, dtype=np.float32))  # still tagged 0: 1 not retrieved yet
    worker.flush(timeout=WAIT_S)
    with pytest.raises(tensorshare.TimeoutError):
        trainer.collect(timeout=0.2)  # both items are stale for tolerance 0
    assert trainer.stats()["dropped_stale"] == 2
    trainer.close()
    # A new trainer resumes after the stored version; tolerance 1 keeps version - 1.
    trainer = RLTrainer(client, staleness_tolerance=1)
    assert trainer.version == 1
    worker.add(np.full(3, 7, dtype=np.float32))  # tagged 0
    worker.flush(timeout=WAIT_S)
    assert trainer.publish({"w": np.ones(2, dtype=np.float32)}) == 2
    with pytest.raises(tensorshare.TimeoutError):
        trainer.collect(timeout=0.2)  # 0 < 2 - 1
    p = worker.params()
    assert p.version == 2
    worker.add({"r": np.full(3, 8, dtype=np.float32)})
    worker.flush(timeout=WAIT_S)
    batch = trainer.collect(timeout=WAIT_S)
    assert isinstance(batch, Batch) and batch.versions == [2]
    assert np.array_equal(np.asarray(batch.data[0]["r"]), np.full(3, 8, dtype=np.float32))
    worker.close()
    trainer.close()
    # NO_FILTER keeps everything.
    trainer = RLTrainer(client, staleness_tolerance=NO_FILTER)
    with RLWorker(client) as w2:
        w2.add(np.zeros(1, dtype=np.float32))  # tagged -1: never retrieved
        w2.flush(timeout=WAIT_S)
    assert trainer.collect(timeout=WAIT_S).versions == [-1]
    trainer.close()


def test_await_times_out_instead_of_returning_old_params(client):
    trainer = RLTrainer(client)
    worker = RLWorker(client)
    trainer.publish({"w": np.zeros(1, dtype=np.float32)})
    worker.await_params(timeout=WAIT_S)
    t0 = time.monotonic()
    with pytest.raises(tensorshare.TimeoutError):
        worker.await_params(timeout=0.2)
    assert time.monotonic() - t0 < WAIT_S
    with pytest.raises(tensorshare.TimeoutError):
        worker.await_params(timeout=0)
    # An await blocked in another thread (GIL released) wakes on a publish.
    got = []
    t = threading.Thread(target=lambda: got.append(worker.await_params(timeout=WAIT_S)))
    t.start()
    time.sleep(0.1)
    trainer.publish({"w": np.ones(1, dtype=np.float32)})
    t.join(WAIT_S)
    assert got and got[0].version == 1
    with pytest.raises(ValueError):
        worker.await_params(timeout=-1)
    worker.close()
    trainer.close()


def test_collect_from_a_stopped_tensord_says_no_reply_within_its_bound(tensord):
    """rl.h: a collect returns within its timeout plus one request timeout, and a request tensord
    does not answer ends it with the client's message, not "no experience kept"."""
    import signal

    c = tensorshare.Client(tensord.address, timeout=1.0)
    trainer = RLTrainer(c, prefix="stall/")
    os.kill(tensord.proc.pid, signal.SIGSTOP)
    try:
        for timeout in (0.3, 0):
            t0 = time.monotonic()
            with pytest.raises(tensorshare.TimeoutError,
                               match="^no reply within the request timeout$"):
                trainer.collect(timeout=timeout)
            assert time.monotonic() - t0 < timeout + 1.0 + 0.4
    finally:
        os.kill(tensord.proc.pid, signal.SIGCONT)
    with pytest.raises(tensorshare.TimeoutError, match="no experience kept in 'stall/data'"):
        trainer.collect(timeout=0.1)
    trainer.close()
    c.close()


def test_params_views_outlive_the_worker(client):
    trainer = RLTrainer(client)
    worker = RLWorker(client, tensor_type="numpy")
    trainer.publish({"w": np.arange(1000, dtype=np.float32)})
    p = worker.await_params(timeout=WAIT_S)
    worker.close()
    trainer.close()
    assert p.value["w"][999] == 999.0  # the snapshot lives as long as its views
    assert not p.value["w"].flags.writeable


def test_borrowed_adds_and_nonblocking_adds(client):
    trainer = RLTrainer(client, staleness_tolerance=NO_FILTER)
    worker = RLWorker(client, max_in_flight=1)
    data = [np.full(256, i, dtype=np.float32) for i in range(20)]
    for d in data:
        worker.add(d, copy=False)  # sent from d's memory; kept referenced until flush
    worker.flush(timeout=WAIT_S)
    got = _collect_n(trainer, 20)
    assert [float(np.asarray(d)[0]) for d, _ in got] == [float(i) for i in range(20)]
    # block=False refuses at once (EAGAIN) while max_in_flight adds are on their way.
    refused = 0
    for _ in range(50):
        try:
            worker.add(np.zeros(1 << 16, dtype=np.float32), block=False)
        except tensorshare.Error as e:
            assert e.name == "EAGAIN"
            refused += 1
    worker.flush(timeout=WAIT_S)
    assert refused > 0
    worker.close()
    trainer.close()


def test_on_event_runs_on_the_io_thread_and_cannot_reenter(client):
    trainer = RLTrainer(client)
    events = []
    errors = []
    done = threading.Event()

    def on_event(event, version, error):
        events.append((event, version, error))
        try:
            worker.params()
        except tensorshare.DeadlockError as e:
            errors.append(e)
        done.set()

    worker = RLWorker(client, on_event=on_event)
    trainer.publish({"w": np.zeros(1, dtype=np.float32)})
    assert done.wait(WAIT_S)
    assert ("params", 0, None) in events
    assert errors and isinstance(errors[0], tensorshare.DeadlockError)
    worker.close()
    trainer.close()


def test_close_and_client_lifetime(tensord):
    c = tensorshare.Client(tensord.address, timeout=10)
    worker = RLWorker(c)
    trainer = RLTrainer(c)
    c.close()  # takes effect once the trainer and the worker are closed
    trainer.publish({"w": np.zeros(1, dtype=np.float32)})
    assert worker.await_params(timeout=WAIT_S).version == 0
    worker.close()
    worker.close()  # idempotent
    with pytest.raises(tensorshare.CancelledError):
        worker.params()
    with trainer:
        pass
    assert trainer.closed and trainer.client is None
    with pytest.raises(tensorshare.CancelledError):
        trainer.publish({"w": np.zeros(1, dtype=np.float32)})
    with pytest.raises(tensorshare.CancelledError):
        RLTrainer(c)


def test_used_after_fork_raises_connection_error(client):
    """A child process cannot use the parent's trainer or worker (the library threads are the
    parent's): every call raises ConnectionError there, and nothing of the parent's is freed."""
    trainer = RLTrainer(client)
    worker = RLWorker(client)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                trainer.publish({"w": np.zeros(1, dtype=np.float32)})
            except tensorshare.ConnectionError as e:
                if e.name == "ENOTCONN":
                    code = 0
            try:
                worker.params()
                code = 1
            except tensorshare.ConnectionError:
                pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    # The parent's objects still work.
    assert trainer.publish({"w": np.zeros(1, dtype=np.float32)}) == 0
    assert worker.await_params(timeout=WAIT_S).version == 0
    worker.close()
    trainer.close()


def test_forked_child_exits_normally_with_the_parents_objects(tensord):
    """rl_fork_proc.py: a child that exits normally (atexit, finalization) with the parent's
    trainer, worker and predictor around neither hangs nor crashes, and the parent's still work."""
    out = subprocess.run([sys.executable, os.path.join(HERE, "rl_fork_proc.py"), tensord.address],
                         env=_env(), capture_output=True, text=True, timeout=WAIT_S * 2)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


class _Alarm(Exception):
    pass


def test_unlimited_waits_let_signal_handlers_run(client):
    """collect() and await_params() with no timeout wait in slices, so a signal handler (Ctrl-C's
    KeyboardInterrupt, here SIGALRM's) interrupts them instead of waiting for data."""
    import signal

    def on_alarm(signum, frame):
        raise _Alarm()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        trainer = RLTrainer(client)
        worker = RLWorker(client)
        for wait in (lambda: trainer.collect(), lambda: worker.await_params()):
            t0 = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(_Alarm):
                wait()
            assert time.monotonic() - t0 < 5.0
        # Both still work after the interruption.
        trainer.publish({"w": np.zeros(1, dtype=np.float32)})
        assert worker.await_params(timeout=WAIT_S).version == 0
        worker.close()
        trainer.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class _RefuseViews:
    """A torch function mode under which Tensor.view raises: a collected bool tensor (uint8 bytes
    viewed as bool) then cannot be made, after the collect took the items out of the data bin."""

    def __init__(self):
        torch = pytest.importorskip("torch")
        from torch.overrides import TorchFunctionMode

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.Tensor.view:
                    raise RuntimeError("no views today")
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def test_collect_whose_conversion_fails_hands_over_what_it_took(client):
    """collect() takes the items out of the data bin before they are converted: when a
    conversion fails, the exception carries every item it took, oldest first, as (data, version)
    pairs, None where one could not be made; the trainer keeps working."""
    torch = pytest.importorskip("torch")
    refuse = _RefuseViews()  # made first: it imports torch.overrides
    trainer = RLTrainer(client, staleness_tolerance=NO_FILTER, tensor_type="torch")
    live_views = tensorshare._tensorshare._live_views()
    client.append("data", {"data": {"n": 1}, "version": 4})
    client.append("data", {"data": {"n": 2, "flags": torch.tensor([True, False])}, "version": 5})
    client.append("data", {"data": {"n": 3, "t": torch.arange(3)}, "version": 6})
    with refuse:
        with pytest.raises(RuntimeError, match="no views today") as info:
            trainer.collect(timeout=WAIT_S)
    items = info.value.items
    assert len(items) == 3 and items[1] is None
    assert items[0] == ({"n": 1}, 4)
    assert items[2][0]["n"] == 3 and items[2][0]["t"].tolist() == [0, 1, 2] and items[2][1] == 6
    if hasattr(info.value, "__notes__"):  # Python 3.11+
        assert any("took 3 items" in note for note in info.value.__notes__)
    assert "data" not in client.list()  # they are out of the bin, as the exception says
    del items, info
    assert tensorshare._tensorshare._live_views() == live_views  # nothing of the batch leaked
    client.append("data", {"data": {"n": 4}, "version": 7})
    batch = trainer.collect(timeout=WAIT_S)
    assert batch.data == [{"n": 4}] and batch.versions == [7]
    trainer.close()


COLLECT_WITHOUT_NUMPY = """
import sys
sys.modules["numpy"] = None  # import numpy fails in this process
import tensorshare
from tensorshare.rl import NO_FILTER, RLTrainer
c = tensorshare.Client(sys.argv[1], tensor_type="numpy")
trainer = RLTrainer(c, staleness_tolerance=NO_FILTER)
c.append("data", {"data": {"x": memoryview(b"abcd")}, "version": 0})
try:
    trainer.collect(timeout=10)
    print("collected")
except ImportError:
    print("ImportError", c.list()["data"].n_items if "data" in c.list() else 0)
trainer.close()
c.close()
"""


def test_collect_that_cannot_make_tensors_takes_nothing(tensord):
    """A tensor_type whose module cannot be imported fails collect() before anything is taken
    out of the data bin."""
    p = subprocess.run([sys.executable, "-c", COLLECT_WITHOUT_NUMPY, tensord.address],
                       capture_output=True, text=True, timeout=WAIT_S * 2, env=_env())
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["ImportError", "1"], p.stdout + p.stderr


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_close_from_another_thread_ends_collect_and_await(client, timeout):
    trainer = RLTrainer(client, prefix="cl/")
    worker = RLWorker(client, prefix="cl/")
    out = {}

    def wait(name, fn):
        t0 = time.monotonic()
        try:
            out[name] = fn(timeout=timeout)
        except BaseException as e:  # noqa: B902 - the test looks at what it was
            out[name] = e
        out[name + "_s"] = time.monotonic() - t0

    threads = [threading.Thread(target=wait, args=("collect", lambda timeout: trainer.collect(
                   1, timeout=timeout))),
               threading.Thread(target=wait, args=("await", worker.await_params))]
    for t in threads:
        t.start()
    time.sleep(0.4)
    trainer.close()
    worker.close()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    for name in ("collect", "await"):
        assert isinstance(out[name], tensorshare.CancelledError), out[name]
        assert out[name].name == "ECANCELED" and "closed" in out[name].message
        assert out[name + "_s"] < 5


def test_constructor_timeout_zero_does_not_wait(client):
    trainer = RLTrainer(client, prefix="t0/", timeout=0)
    trainer.publish({"a": 1})
    worker = RLWorker(client, prefix="t0/", timeout=0, max_in_flight=1)
    assert worker.params().version == 0
    # The first add may still be on its way: with no wait allowed, the next one cannot queue.
    for _ in range(50):
        try:
            worker.add({"x": 1})
        except tensorshare.TimeoutError:
            break
    worker.flush(10)
    t0 = time.monotonic()
    worker.close()
    trainer.close()
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("timeout", [0, 0.5])
def test_worker_close_waits_only_the_worker_timeout(tensord, timeout):
    """close() waits for the adds in flight up to the worker's timeout, not the Client's request
    timeout; the copy=False data of adds still in flight stays referenced until they are
    answered (the Client keeps it until it is closed)."""
    import signal
    import weakref
    c = tensorshare.Client(tensord.address, timeout=10)
    worker = RLWorker(c, prefix="w%s/" % timeout, timeout=timeout, max_in_flight=4)
    arr = np.full(1024, 7, dtype=np.float32)
    ref = weakref.ref(arr)
    os.kill(tensord.proc.pid, signal.SIGSTOP)
    try:
        worker.add({"x": arr}, copy=False)
        worker.add({"x": 2})
        del arr
        t0 = time.monotonic()
        worker.close()
        took = time.monotonic() - t0
        assert ref() is not None  # the first add may still read it
    finally:
        os.kill(tensord.proc.pid, signal.SIGCONT)
    assert timeout - 0.05 <= took < timeout + 3  # (ms rounding)
    # Answered after the close: both arrive.
    other = tensorshare.Client(tensord.address, timeout=10)
    deadline = time.monotonic() + WAIT_S
    n = 0
    while n < 2 and time.monotonic() < deadline:
        try:
            n = len(other.peek("w%s/data" % timeout))
        except tensorshare.BinNotFoundError:
            pass
        time.sleep(0.01)
    assert n == 2
    other.close()
    c.close()
    assert ref() is None  # released with the Client


def test_one_worker_per_parameters_bin_per_client(tensord, client):
    worker = RLWorker(client)
    with pytest.raises(tensorshare.InvalidArgumentError, match="already listens to 'parameters'"):
        RLWorker(client)
    with pytest.raises(tensorshare.InvalidArgumentError, match="already listens"):
        client.listen("parameters", lambda n: None)
    # Another prefix, or another Client, is another listener; trainers do not listen.
    others = [RLWorker(client, prefix="other/"), RLTrainer(client), RLTrainer(client)]
    c2 = tensorshare.Client(tensord.address, timeout=10)
    others.append(RLWorker(c2))
    for o in others + [worker]:
        o.close()
    c2.close()


def test_names_with_nul_are_refused(client):
    # The library would cut them short: "t/\0x" would be the prefix "t/".
    with pytest.raises(tensorshare.InvalidArgumentError, match="prefix"):
        RLTrainer(client, prefix="t/\0x")
    with pytest.raises(tensorshare.InvalidArgumentError, match="params_bin"):
        RLWorker(client, params_bin="p\0x")


def _collect(client, max_items):
    with RLTrainer(client) as trainer:
        return trainer.collect(max_items, timeout=0)


@pytest.mark.parametrize("make, error, message", [
    pytest.param(lambda c: RLWorker(c, max_in_flight=2**32 + 1), ValueError,
                 "max_in_flight must be an int from 1 to 4294967295, not 4294967297",
                 id="max_in_flight"),
    pytest.param(lambda c: RLWorker(c, max_in_flight=0), ValueError,
                 "max_in_flight must be an int from 1 to 4294967295, not 0", id="max_in_flight_0"),
    pytest.param(lambda c: RLWorker(c, max_in_flight=True), TypeError,
                 "max_in_flight must be an int, not bool", id="max_in_flight_bool"),
    pytest.param(lambda c: RLWorker(c, max_in_flight_bytes=2**63), ValueError,
                 "max_in_flight_bytes must be an int from 1 to 9223372036854775807",
                 id="max_in_flight_bytes"),
    pytest.param(lambda c: RLTrainer(c, staleness_tolerance=2**32), ValueError,
                 "staleness_tolerance must be an int from -2147483648 to 2147483647",
                 id="staleness_tolerance"),
    pytest.param(lambda c: RLTrainer(c, staleness_tolerance=1.0), TypeError,
                 "staleness_tolerance must be an int, not float", id="staleness_float"),
    pytest.param(lambda c: _collect(c, -1), ValueError,
                 "max_items must be an int from 0 to 9223372036854775807, not -1", id="collect"),
    pytest.param(lambda c: _collect(c, 2**64), ValueError,
                 "max_items must be an int from 0 to 9223372036854775807", id="collect_big"),
])
def test_out_of_range_ints_are_refused(client, make, error, message):
    """An int that does not fit its argument raises, naming it, instead of being cut to fit
    (max_in_flight 2**32 + 1 taken as 1) or raising OverflowError."""
    with pytest.raises(error, match=re.escape(message)):
        make(client)
