"""tensorshare.Predictor: remote predictions through tensord.

A TorchScript MLP made here with torch.jit is served by tsinfer (built only when libtorch is:
the tests that need it skip otherwise, saying so); the answers must equal the same model's
forward run locally. The tests without a model server (timeouts, closing, bad arguments) always
run.
"""
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import tensorshare
from tensorshare.predictor import Predictor

# seconds; the longest any wait of these tests may take (bounded; CI has 2 cores)
WAIT_S = 30.0
IN, OUT = 8, 4  # the model's features per row in and out


def tsinfer_path():
    path = os.environ.get("TS_TSINFER")
    if not path and os.environ.get("TS_BUILD_DIR"):
        path = os.path.join(os.environ["TS_BUILD_DIR"], "bin", "tsinfer")
    return path if path and os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="torch is needed to make the TorchScript model")
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))
    net.eval()
    path = str(tmp_path_factory.mktemp("models") / "mlp.pt")
    torch.jit.script(net).save(path)
    return net, path


@pytest.fixture
def served(tensord, model, tmp_path):
    """tsinfer serving the model as "policy" on tensord; stopped by PID after the test."""
    exe = tsinfer_path()
    if exe is None:
        pytest.skip("tsinfer is not built (it needs libtorch: a TS_WITH_TORCH build); set "
                    "TS_TSINFER or TS_BUILD_DIR")
    log = open(tmp_path / "tsinfer.log", "wb")
    proc = subprocess.Popen([exe, "--server", tensord.address, "--model", model[1], "--name",
                             "policy", "--input", ":float32:%d" % IN, "--output",
                             ":float32:%d" % OUT, "--max-batch", "16", "--max-delay-us", "500",
                             "--device", "cpu", "--threads", "1"], stdout=log, stderr=log)
    yield model[0]
    proc.terminate()
    try:
        proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def _local(net, x):
    import torch

    with torch.no_grad():
        return net(torch.as_tensor(np.asarray(x))).numpy()


def test_predict_equals_local_forward(served, client):
    net = served
    rng = np.random.default_rng(1)
    with Predictor(client, "policy") as p:
        # Requests sent before tsinfer took the queue are answered once it does.
        for rows in (1, 3, 16):
            x = rng.standard_normal((rows, IN), dtype=np.float32)
            y = p.predict(x, timeout=WAIT_S)
            assert np.asarray(y).shape == (rows, OUT)
            np.testing.assert_allclose(np.asarray(y), _local(net, x), rtol=1e-5, atol=1e-6)
        y, version = p.predict(x, timeout=WAIT_S, return_version=True)
        assert version == 0
        np.testing.assert_allclose(np.asarray(y), _local(net, x), rtol=1e-5, atol=1e-6)


def test_predict_async_many_in_flight(served, client):
    net = served
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((1 + i % 4, IN), dtype=np.float32) for i in range(40)]
    with Predictor(client, "policy", tensor_type="numpy") as p:
        futs = [p.predict_async(x, timeout=WAIT_S, return_version=True) for x in xs]
        for x, f in zip(xs, futs):
            y, version = f.result(WAIT_S)
            assert isinstance(y, np.ndarray) and version == 0
            np.testing.assert_allclose(y, _local(net, x), rtol=1e-5, atol=1e-6)


def test_predict_from_threads(served, client):
    """Blocking predictions from several threads at once (the GIL is released while waiting)."""
    net = served
    errors = []

    def run(seed):
        rng = np.random.default_rng(seed)
        try:
            with Predictor(client, "policy") as p:
                for _ in range(10):
                    x = rng.standard_normal((1, IN), dtype=np.float32)
                    np.testing.assert_allclose(np.asarray(p.predict(x, timeout=WAIT_S)),
                                               _local(net, x), rtol=1e-5, atol=1e-6)
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors


def test_input_that_does_not_match_the_schema(served, client):
    with Predictor(client, "policy") as p:
        p.predict(np.zeros((1, IN), dtype=np.float32), timeout=WAIT_S)  # the server is up
        with pytest.raises(tensorshare.RecordError) as e:
            p.predict(np.zeros((1, IN + 1), dtype=np.float32), timeout=WAIT_S)
        assert e.value.name == "ESCHEMA"


def test_timeout_without_a_server(client):
    with Predictor(client, "nobody") as p:
        with pytest.raises(tensorshare.TimeoutError):
            p.predict(np.zeros((1, IN), dtype=np.float32), timeout=0.2)
        f = p.predict_async(np.zeros((1, IN), dtype=np.float32), timeout=0.2)
        with pytest.raises(tensorshare.TimeoutError):
            f.result(WAIT_S)
        with pytest.raises(ValueError):
            p.predict(np.zeros((1, IN), dtype=np.float32), timeout=0)
        with pytest.raises(tensorshare.RecordError):
            p.predict(object())


def test_close_cancels_outstanding_predictions(client):
    p = Predictor(client, "nobody")
    futs = [p.predict_async(np.zeros((1, IN), dtype=np.float32), timeout=WAIT_S)
            for _ in range(3)]
    p.close()
    for f in futs:
        with pytest.raises(tensorshare.CancelledError):
            f.result(WAIT_S)
    p.close()  # idempotent
    assert p.closed
    with pytest.raises(tensorshare.CancelledError):
        p.predict(np.zeros((1, IN), dtype=np.float32))
    # Predictions are calls of the service: no bin was made.
    assert not [b for b in client.list() if b.startswith("nobody/")]


def test_answers_come_through_the_service_on_the_clients_io_thread(tensord, client):
    """A model served as the service "doubler" (here a Python handler speaking the predictor's
    protocol, docs/BATCHER.md): no bin is made, and the futures complete on the client's I/O
    thread, where a blocking client call raises DeadlockError."""
    from tensorshare.service import Service

    server = tensorshare.Client(tensord.address, timeout=10)
    io_thread = []
    f = client.ping_async()
    f.add_done_callback(lambda _: io_thread.append(threading.get_ident()))
    f.result(WAIT_S)
    with Service(server, "doubler", lambda r: {"status": 0, "version": 3,
                                                "output": np.asarray(r["input"]) * 2}):
        with Predictor(client, "doubler", tensor_type="numpy") as p:
            x = np.arange(IN, dtype=np.float32).reshape(1, IN)
            y, version = p.predict(x, timeout=WAIT_S, return_version=True)
            assert version == 3 and (y == x * 2).all()
            seen = []
            done = threading.Event()

            def callback(f):
                seen.append(threading.get_ident())
                try:
                    client.ping()
                except Exception as e:  # noqa: BLE001 - the test looks at it
                    seen.append(e)
                done.set()

            f = p.predict_async(x, timeout=WAIT_S)
            f.add_done_callback(callback)
            assert (f.result(WAIT_S) == x * 2).all()
            assert done.wait(WAIT_S)
            assert seen[0] == io_thread[0]
            assert isinstance(seen[1], tensorshare.DeadlockError), seen
            assert not [b for b in client.list() if b.startswith("doubler")]  # no reply bin
    server.close()


def test_close_ends_a_blocking_predict_in_another_thread(client):
    p = Predictor(client, "nobody")
    out = {}

    def predict():
        t0 = time.monotonic()
        try:
            p.predict(np.zeros((1, IN), dtype=np.float32), timeout=float("inf"))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out["error"] = e
        out["took"] = time.monotonic() - t0

    t = threading.Thread(target=predict)
    t.start()
    time.sleep(0.3)
    p.close()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert isinstance(out["error"], tensorshare.CancelledError), out
    assert out["took"] < 5


def test_a_signal_handler_interrupts_a_blocking_predict(client):
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with Predictor(client, "nobody") as p:
            t0 = time.monotonic()
            with pytest.raises(Interrupted):
                p.predict(np.zeros((1, IN), dtype=np.float32), timeout=WAIT_S)
            assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_blocking_predict_in_a_predictions_callback_is_refused(client):
    with Predictor(client, "nobody") as p:
        seen = []
        done = threading.Event()

        def callback(f):
            try:
                p.predict(np.zeros((1, IN), dtype=np.float32), timeout=WAIT_S)
            except Exception as e:  # noqa: BLE001 - the test looks at it
                seen.append(e)
            done.set()

        f = p.predict_async(np.zeros((1, IN), dtype=np.float32), timeout=0.2)
        f.add_done_callback(callback)
        assert done.wait(WAIT_S)
        assert isinstance(seen[0], tensorshare.DeadlockError), seen


FORK_PREDICTION_SCRIPT = """
import os, sys, time
import numpy as np
import tensorshare
from tensorshare.predictor import Predictor
c = tensorshare.Client(sys.argv[1])
p = Predictor(c, "nobody")
pending = p.predict_async(np.zeros((1, 8), dtype=np.float32), timeout=60)
ran = []
pending.add_done_callback(lambda f: ran.append(f))  # the parent's: not run in the child
pid = os.fork()
if pid == 0:
    code = 0
    t0 = time.monotonic()
    try:
        pending.result(5)
        code = 3
    except tensorshare.ConnectionError as e:
        code = 0 if "fork" in str(e) and time.monotonic() - t0 < 4 else 4
    except BaseException:
        code = 5  # concurrent.futures.TimeoutError: it would have waited forever
    os._exit(code if not ran else 6)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), "parent pending", pending.done(), flush=True)
p.close()
print("after close", type(pending.exception(10)).__name__, len(ran), flush=True)
c.close()
"""


def test_a_parents_pending_prediction_fails_in_the_child(tensord):
    """A prediction still pending when the process forks fails in the child with
    ConnectionError (the parent's library threads, which would complete it, do not exist
    there) without running the parent's done-callbacks; the parent's future is untouched."""
    import sys

    env = dict(os.environ)
    pkg = os.environ.get("TS_PYTHONPATH")
    if pkg:
        env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", FORK_PREDICTION_SCRIPT, tensord.address],
                       capture_output=True, text=True, timeout=WAIT_S * 2, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["child", "0", "parent", "pending", "False", "after", "close",
                                "CancelledError", "1"], p.stdout + p.stderr


def test_an_input_of_zero_rows_is_refused_before_sending(client):
    # No model is needed: the input is refused before anything is sent.
    with Predictor(client, "nobody") as p:
        for bad in (np.zeros((0, IN), np.float32), {"x": np.zeros((0, IN), np.float32)}):
            with pytest.raises(tensorshare.RecordError, match="0 rows") as info:
                p.predict(bad, timeout=1.0)
            assert info.value.name == "ESCHEMA"
            with pytest.raises(tensorshare.RecordError, match="0 rows"):
                p.predict_async(bad, timeout=1.0)


def test_a_service_name_with_nul_is_refused(client):
    # "policy\0x" would be cut to "policy" by the library.
    with pytest.raises(tensorshare.InvalidArgumentError, match="NUL"):
        Predictor(client, "policy\0x")
