#!/usr/bin/env python3
"""The Python package measured against the C client and redis-py, in one run.

    bench/run.sh python [--repeats N] [--smoke] [--no-redis] [--no-pin]

(or python3 bench/python_bench.py --build DIR ... with the package importable). Not a test: the
numbers only mean something as ratios taken in the same run, on an otherwise idle machine.

What runs, against one tensord (and one redis-server) started here and pinned to cpu0, with this
process and the C programs pinned to cpu1, as bench/tsbench.c does:

- put then get of one float32 tensor of 1 MiB and 64 MiB, from a NumPy array and from a torch
  tensor, through tensorshare.Client (blocking put, blocking get of the whole bin, the item read
  through its zero-copy view), against the same rounds through libtensorshare called from C
  code: ts_put then ts_get of a tensor over the caller's memory (TS_BORROW), as bench_ts.c does.
  The C rounds are driven through ctypes (two foreign calls per round, about a microsecond in
  all, which makes the C side look slower by that much: under 1 % of a 1 MiB round).
- small operations: 64 B put then get, one client, blocking, through tensorshare.Client, against
  the C client (bench/tsrounds ADDRESS N blocking, its own process; and ts_put/ts_get called
  from this process through ctypes, which shares the process's conditions), and against
  redis-py with the hiredis parser (SET then GET of 64 bytes) on redis-server. The per-call
  overhead of the Python package is its time per call minus the C client's.

Every case alternates the systems (Python first on even repeats, the references first on odd
ones), and the table shows medians over the repeats: wall time (what the targets are about) and
the client process's CPU time per round or call (all its threads: time.process_time, and
tsrounds' own figure), which other load on a shared machine disturbs far less than wall time.
"""
import argparse
import ctypes
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

TS_FLOAT32 = 9  # tensorshare.h's wire code for float32
TS_BORROW = 0


def pin(cpu, enabled):
    """Pin the calling process (and the threads it starts afterwards) to one CPU."""
    if enabled and hasattr(os, "sched_setaffinity") and os.cpu_count() >= 2:
        os.sched_setaffinity(0, {cpu})


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.02)
    return False


class Server:
    """A daemon started pinned to cpu0 and stopped by its pid."""

    def __init__(self, argv, log_path, pinning):
        self.log = open(log_path, "ab")
        preexec = (lambda: pin(0, True)) if pinning else None
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=self.log, preexec_fn=preexec)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_tensord(path, tmp, pinning):
    port_file = os.path.join(tmp, "tensord.port")
    srv = Server([path, "--port", "0", "--port-file", port_file, "--log-level", "warn"],
                 os.path.join(tmp, "tensord.log"), pinning)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        try:
            with open(port_file) as f:
                port = int(f.read().strip() or "0")
            if port > 0 and wait_port(port):
                return srv, port
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    srv.stop()
    raise RuntimeError("tensord did not start; see " + os.path.join(tmp, "tensord.log"))


def start_redis(path, tmp, pinning):
    port = free_port()
    srv = Server([path, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                  "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"],
                 os.path.join(tmp, "redis.log"), pinning)
    if not wait_port(port):
        srv.stop()
        raise RuntimeError("redis-server did not start")
    return srv, port


class CClient:
    """libtensorshare called directly (ctypes): the C client's own rounds."""

    def __init__(self, lib_path, address):
        lib = ctypes.CDLL(lib_path)
        vp = ctypes.c_void_p
        lib.ts_client_open.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, vp]
        lib.ts_client_free.argtypes = [vp]
        lib.ts_tensor_new.restype = vp
        lib.ts_tensor_new.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
                                      vp, ctypes.c_uint]
        lib.ts_value_free.argtypes = [vp]
        lib.ts_put.argtypes = [vp, ctypes.c_char_p, vp, vp]
        lib.ts_get.argtypes = [vp, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(vp)]
        lib.ts_items_count.argtypes = [vp]
        lib.ts_items_count.restype = ctypes.c_size_t
        lib.ts_items_free.argtypes = [vp]
        lib.ts_last_error.restype = ctypes.c_char_p
        self.lib = lib
        self.c = vp()
        rc = lib.ts_client_open(ctypes.byref(self.c), address.encode(), None)
        if rc != 0:
            raise RuntimeError("C client: cannot connect: " + lib.ts_last_error().decode())

    def putget(self, buf, size, iters):
        """Seconds per put-then-get round of a float32 tensor over buf (size bytes)."""
        lib = self.lib
        shape = (ctypes.c_int64 * 1)(size // 4)
        addr = ctypes.c_void_p(buf.ctypes.data)
        v = lib.ts_tensor_new(TS_FLOAT32, 1, shape, addr, TS_BORROW)
        if not v:
            raise RuntimeError("C client: ts_tensor_new failed")
        items = ctypes.c_void_p()
        bin_name = b"pybench:big"
        put, get, free = lib.ts_put, lib.ts_get, lib.ts_items_free

        def one():
            if put(self.c, bin_name, v, None) != 0 or get(self.c, bin_name, 0,
                                                          ctypes.byref(items)) != 0:
                raise RuntimeError("C client: " + lib.ts_last_error().decode())
            n = lib.ts_items_count(items)
            free(items)
            if n != 1:
                raise RuntimeError("C client: %d items" % n)

        try:
            one()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                one()
            return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters
        finally:
            lib.ts_value_free(v)

    def small(self, buf, secs):
        """(calls per second, CPU seconds per call): ts_put then ts_get of 64 B, blocking, called
        from this process through ctypes (each foreign call costs about half a microsecond)."""
        lib = self.lib
        shape = (ctypes.c_int64 * 1)(16)
        v = lib.ts_tensor_new(TS_FLOAT32, 1, shape, ctypes.c_void_p(buf.ctypes.data), TS_BORROW)
        items = ctypes.c_void_p()
        put, get, free, c = lib.ts_put, lib.ts_get, lib.ts_items_free, self.c
        bin_name = b"pybench:s"
        ref = ctypes.byref(items)
        n = 0
        try:
            end = time.perf_counter() + secs
            t0, c0 = time.perf_counter(), time.process_time()
            while time.perf_counter() < end:
                for _ in range(50):
                    if put(c, bin_name, v, None) != 0 or get(c, bin_name, 0, ref) != 0:
                        raise RuntimeError("C client: " + lib.ts_last_error().decode())
                    free(items)
                n += 100
            return n / (time.perf_counter() - t0), (time.process_time() - c0) / n
        finally:
            lib.ts_value_free(v)

    def close(self):
        self.lib.ts_client_free(self.c)


def py_putget(client, value, kind, iters, check):
    """Seconds per put-then-get round through tensorshare.Client (tensors out as kind)."""
    bin_name = "pybench:big"

    def one():
        client.put(bin_name, value)
        items = client.get(bin_name, tensor_type=kind)
        if len(items) != 1:
            raise RuntimeError("python: %d items" % len(items))
        return items[0]

    first = one()
    check(first)
    del first
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        one()
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def py_small(client, value, secs):
    """(calls per second, client CPU seconds per call) through tensorshare.Client, blocking; a
    put or a get is one call."""
    put, get = client.put, client.get
    n = 0
    end = time.perf_counter() + secs
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() < end:
        for _ in range(50):
            put("pybench:s", value)
            get("pybench:s", tensor_type="numpy")
        n += 100
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def redis_small(r, secs):
    """(calls per second, client CPU seconds per call) of redis-py (SET then GET of 64 bytes),
    blocking."""
    payload = os.urandom(64)
    r.set("pybench:s", payload)
    if r.get("pybench:s") != payload:
        raise RuntimeError("redis: value changed")
    s, g = r.set, r.get
    n = 0
    end = time.perf_counter() + secs
    t0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() < end:
        for _ in range(50):
            s("pybench:s", payload)
            g("pybench:s")
        n += 100
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def c_small(tsrounds, address, rounds, pinning):
    """(calls per second, client CPU seconds per call) of the C client (tsrounds blocking:
    ts_put then ts_get of 64 B, its own process)."""
    preexec = (lambda: pin(1, True)) if pinning else None
    out = subprocess.run([tsrounds, address, str(rounds), "blocking"], capture_output=True,
                         text=True, timeout=600, preexec_fn=preexec)
    m = re.search(r"([0-9]+) rounds, ([0-9.]+) s wall, client cpu ([0-9.]+) us per round",
                  out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError("tsrounds failed: " + out.stdout + out.stderr)
    return 2 * int(m.group(1)) / float(m.group(2)), float(m.group(3)) / 2 * 1e-6


def alternate(repeats, first, second):
    """Run first() and second() repeats times, alternating who goes first. Each returns
    (figure, cpu); returns the medians (fa, ca, fb, cb) and the raw runs."""
    a, b = [], []
    for r in range(repeats):
        if r % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())

    def med(runs, i):
        return statistics.median(x[i] for x in runs)

    return (med(a, 0), med(a, 1), med(b, 0), med(b, 1)), a, b


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.environ.get("TS_BENCH_BUILD", "build"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--raw", action="store_true", help="print every run")
    args = ap.parse_args()
    if args.smoke and args.repeats == 5:
        args.repeats = 1
    pinning = not args.no_pin and os.cpu_count() >= 2

    import numpy as np
    import tensorshare
    try:
        import torch
    except ImportError:
        torch = None
    redis = None
    if not args.no_redis:
        try:
            import redis
        except ImportError:
            print("redis-py is not installed: the Redis row is left out")

    build = args.build
    tensord = os.path.join(build, "server", "tensord")
    tsrounds = os.path.join(build, "bench", "tsrounds")
    libts = os.path.join(build, "lib", "libtensorshare.so")
    for p in (tensord, tsrounds, libts):
        if not os.path.exists(p):
            sys.exit("python_bench: %s is missing (build tensord, tsrounds and tensorshare)" % p)
    redis_path = shutil.which("redis-server") or "/usr/bin/redis-server"
    if redis is not None and not os.path.exists(redis_path):
        print("redis-server not found: the Redis row is left out")
        redis = None

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print("machine: %d CPUs; load before the run %s; python %s, tensorshare from %s" %
          (os.cpu_count(), load, sys.version.split()[0], os.path.dirname(tensorshare.__file__)))
    print("servers pinned to cpu0, clients to cpu1: %s; %d repeats, medians" %
          ("yes" if pinning else "no", args.repeats))
    tmp = tempfile.mkdtemp(prefix="pybench.")
    servers = []
    lines = []
    try:
        ts_srv, ts_port = start_tensord(tensord, tmp, pinning)
        servers.append(ts_srv)
        rd_port = None
        if redis is not None:
            rd_srv, rd_port = start_redis(redis_path, tmp, pinning)
            servers.append(rd_srv)
        pin(1, pinning)
        address = "127.0.0.1:%d" % ts_port
        py = tensorshare.Client(address)
        cc = CClient(libts, address)

        lines.append("| case | Python | C client | Python / C | target | client CPU per round, "
                     "Python / C |")
        lines.append("|---|---|---|---|---|---|")
        sizes = [(64 << 10, 20, None)] if args.smoke else [(1 << 20, 200, 1.2), (64 << 20, 8, 1.1)]
        for size, iters, target in sizes:
            src = np.random.default_rng(5).standard_normal(size // 4, dtype=np.float32)
            kinds = [("numpy", src)]
            if torch is not None:
                kinds.append(("torch", torch.from_numpy(src)))
            for kind, value in kinds:
                def check(item, src=src):
                    got = np.asarray(item)
                    if got.shape != src.shape or not np.array_equal(got[-4:], src[-4:]):
                        raise RuntimeError("python: the item came back changed")

                (p, pc, c, cc_cpu), pa, ca = alternate(
                    args.repeats, lambda: py_putget(py, value, kind, iters, check),
                    lambda: cc.putget(src, size, iters))
                if args.raw:
                    print("raw: %s %d B python %s c %s" % (kind, size, pa, ca))
                name = "%d MiB" % (size >> 20) if size >= 1 << 20 else "%d KiB" % (size >> 10)
                verdict = "-" if target is None else "%s <= %.1fx" % (
                    "pass" if p / c <= target else "MISS", target)
                lines.append("| put+get %s float32, tcp (%s) | %.3f ms | %.3f ms | %.2fx | %s | "
                             "%.0f / %.0f us (%.2fx) |" % (name, kind, p * 1e3, c * 1e3, p / c,
                                                           verdict, pc * 1e6, cc_cpu * 1e6,
                                                           pc / cc_cpu))
        lines.append("")

        secs = 0.3 if args.smoke else 1.5
        small = np.zeros(16, dtype=np.float32)  # 64 bytes
        py_small(py, small, 0.05)  # warm-up
        c_rate = c_small(tsrounds, address, 200, pinning)[0]
        c_rounds = max(200, int(c_rate * secs / 2))
        (p, pc, c, c_cpu), pa, ca = alternate(
            args.repeats, lambda: py_small(py, small, secs),
            lambda: c_small(tsrounds, address, c_rounds, pinning))
        if args.raw:
            print("raw: small python %s c %s" % (pa, ca))
        lines.append("| 64 B put/get, 1 client, blocking, tcp | Python | reference | "
                     "Python vs reference | target | client CPU per call, Python / reference |")
        lines.append("|---|---|---|---|---|---|")
        lines.append("| vs the C client (tsrounds, its own process) | %.0f calls/s | %.0f calls/s |"
                     " %.2fx | - | %.1f / %.1f us |" % (p, c, p / c, pc * 1e6, c_cpu * 1e6))
        overhead_wall = (1.0 / p - 1.0 / c) * 1e6
        overhead_cpu = (pc - c_cpu) * 1e6
        (p3, pc3, c3, cc3), pa, ca = alternate(args.repeats, lambda: py_small(py, small, secs),
                                               lambda: cc.small(small, secs))
        if args.raw:
            print("raw: small python %s c in-process %s" % (pa, ca))
        lines.append("| vs the C client (this process, through ctypes) | %.0f calls/s | %.0f "
                     "calls/s | %.2fx | - | %.1f / %.1f us |" % (p3, c3, p3 / c3, pc3 * 1e6,
                                                                  cc3 * 1e6))
        if redis is not None:
            r = redis.Redis(host="127.0.0.1", port=rd_port)
            parser = getattr(redis.connection, "DefaultParser", type(None)).__name__
            redis_small(r, 0.05)
            (p2, pc2, rr, rc), pa, ra = alternate(args.repeats,
                                                  lambda: py_small(py, small, secs),
                                                  lambda: redis_small(r, secs))
            if args.raw:
                print("raw: small python %s redis %s" % (pa, ra))
            lines.append("| vs redis-py %s (%s) | %.0f calls/s | %.0f calls/s | %.2fx | %s "
                         ">= 1.0x | %.1f / %.1f us |" % (redis.__version__, parser, p2, rr,
                                                          p2 / rr, "pass" if p2 >= rr else "MISS",
                                                          pc2 * 1e6, rc * 1e6))
            r.close()
        lines.append("")
        lines.append("Per-call overhead of the Python package over the C client (64 B put or get,"
                     " blocking): against tsrounds %.1f us of wall time (%.1f us per call against "
                     "%.1f us) and %.1f us of client CPU time; against the C calls made from this "
                     "process %.1f us of wall time and %.1f us of CPU time." %
                     (overhead_wall, 1e6 / p, 1e6 / c, overhead_cpu, (1.0 / p3 - 1.0 / c3) * 1e6,
                      (pc3 - cc3) * 1e6))
        cc.close()
        py.close()
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    for ln in lines:
        print(ln)


if __name__ == "__main__":
    main()
