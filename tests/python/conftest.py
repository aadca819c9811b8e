"""Fixtures shared by the Python tests: a real tensord per test, and a client on it.

How the tests find what they run (ctest sets both; python/CMakeLists.txt registers one ctest test
per test_*.py file, label "python"):

- TS_TENSORD: the tensord binary. Without it, ../../build/server/tensord from this folder.
- TS_PYTHONPATH: a folder holding the built package (the build tree's python/ folder, where
  tensorshare/ has the .py files and the extension). It goes first on sys.path; without it the
  installed tensorshare package is imported.

To run them by hand from a build directory DIR:

    TS_TENSORD=DIR/server/tensord TS_PYTHONPATH=DIR/python python3 -m pytest -q tests/python

Fixtures:

- tensord: a started Tensord (below) on 127.0.0.1, an ephemeral port and a unix socket in a
  temporary folder; stopped (by PID) after the test. .address is "127.0.0.1:PORT",
  .unix_address is "unix:PATH"; .restart() stops it and starts a new one on the same port and
  socket (for reconnect tests); .stop() and .start() do one half each. Its temporary folder
  (socket, port file, tensord.log) is removed after the test.
- client: a tensorshare.Client connected to tensord, closed after the test.
- start_tensord: a factory, start_tensord(*extra_flags) -> Tensord, for daemons with flags of
  their own (each is stopped after the test).
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

_pkg_dir = os.environ.get("TS_PYTHONPATH")
if _pkg_dir:
    sys.path.insert(0, _pkg_dir)

# seconds; how long tensord may take to start listening (a loaded CI machine with 2 cores)
START_TIMEOUT_S = 10.0
# seconds; how long tensord may take to exit after SIGTERM before it is killed
STOP_TIMEOUT_S = 10.0


def tensord_path():
    path = os.environ.get("TS_TENSORD")
    if not path:
        path = os.path.join(HERE, "..", "..", "build", "server", "tensord")
    if not os.access(path, os.X_OK):
        pytest.fail("tensord not found at %r: set TS_TENSORD" % path)
    return path


class Tensord:
    """One tensord process on 127.0.0.1 (ephemeral port) and a unix socket, stopped by PID."""

    def __init__(self, extra=()):
        self.dir = tempfile.mkdtemp(prefix="tsp-")
        self.unix_path = os.path.join(self.dir, "tensord.sock")
        self.port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "tensord.log")
        self.extra = list(extra)
        self.port = 0
        self.proc = None

    @property
    def address(self):
        return "127.0.0.1:%d" % self.port

    @property
    def unix_address(self):
        return "unix:" + self.unix_path

    def start(self):
        """Start tensord (on the port it had before, if any) and wait until it listens."""
        if os.path.exists(self.port_file):
            os.unlink(self.port_file)
        args = [tensord_path(), "--port", str(self.port), "--unix", self.unix_path,
                "--port-file", self.port_file, "--log-level", "warn"] + self.extra
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=log)
            while time.monotonic() < deadline and self.proc.poll() is None:
                if os.path.exists(self.port_file):
                    with open(self.port_file) as f:
                        text = f.read().strip()
                    if text:
                        self.port = int(text)
                        return self
                time.sleep(0.01)
            if self.proc.poll() is None or time.monotonic() >= deadline:
                break
            # It exited: the old port may still be in TIME_WAIT after a restart; try again.
            time.sleep(0.05)
        self.stop()
        with open(self.log_path, errors="replace") as f:
            pytest.fail("tensord did not start: " + f.read()[-2000:])

    def stop(self):
        """SIGTERM by PID, wait, SIGKILL if it does not exit in time."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None

    def restart(self):
        self.stop()
        return self.start()


@pytest.fixture
def start_tensord():
    started = []

    def start(*extra):
        d = Tensord(extra).start()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)


@pytest.fixture
def tensord(start_tensord):
    return start_tensord()


@pytest.fixture
def client(tensord):
    import tensorshare

    c = tensorshare.Client(tensord.address, timeout=10)
    yield c
    c.close()
