#!/usr/bin/env python3
"""Gathering rows of a tensor bin, measured against numpy.memmap, in one run.

    bench/run.sh rows [--repeats N] [--smoke] [--rows R] [--cols C] [--gather K]

(or python3 bench/rows_bench.py --build DIR ... with the package importable). Not a test: the
numbers only mean something as ratios taken in the same run, on an otherwise idle machine.

One tensord is started here (TCP and a unix socket); a float32 tensor bin [R, C] (default
[1048576, 64], 256 MiB) is filled with random rows by write_rows, and the same rows are written
to a file. Each round gathers K (default 4096) random rows (a fresh int64 index per round, the
same indexes for every method of a repeat) by:

- gather_rows over TCP: GATHER_ROWS, the server copies the rows into its reply, the client
  receives them (tensorshare.Client, NumPy views);
- gather_rows over the unix socket: the same through the unix socket;
- by reference: peek(ref=True) on the unix socket once (the bin's memfd mapped read-only and
  shared), then NumPy fancy indexing of the mapping (m[index]), so each round is a local gather
  from the server's own pages;
- numpy.memmap of the file (page cache warm), fancy indexed the same way.

Every repeat runs the methods in a rotated order, each for a fixed number of rounds; the table
shows the median over the repeats of the time per gather, and the result of every method is
checked against the memmap's once.
"""
import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import tensorshare

START_TIMEOUT_S = 15
STOP_TIMEOUT_S = 10


def start_tensord(tensord, workdir, max_memory):
    port_file = os.path.join(workdir, "port")
    sock = os.path.join(workdir, "tensord.sock")
    log = open(os.path.join(workdir, "tensord.log"), "w")
    proc = subprocess.Popen([tensord, "--port", "0", "--port-file", port_file, "--unix", sock,
                             "--max-memory", str(max_memory), "--log-level", "warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if os.path.exists(port_file) and os.path.exists(sock):
            with open(port_file) as f:
                port = f.read().strip()
            if port:
                try:
                    socket.create_connection(("127.0.0.1", int(port)), 1).close()
                    return proc, "127.0.0.1:" + port, "unix:" + sock
                except OSError:
                    pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    sys.exit("rows_bench: tensord did not start (see %s)" % log.name)


def stop_tensord(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build", help="the build directory holding server/tensord")
    ap.add_argument("--rows", type=int, default=1 << 20)
    ap.add_argument("--cols", type=int, default=64)
    ap.add_argument("--gather", type=int, default=4096, help="rows per gather")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=50, help="gathers per method per repeat")
    ap.add_argument("--smoke", action="store_true", help="a small, quick run")
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.repeats, args.rounds = 1 << 14, 3, 5
    tensord = os.path.join(args.build, "server", "tensord")
    rows, cols, k = args.rows, args.cols, args.gather
    nbytes = rows * cols * 4
    workdir = tempfile.mkdtemp(prefix="rows-bench-")
    proc = None
    try:
        proc, tcp_addr, unix_addr = start_tensord(tensord, workdir, 4 * nbytes + (1 << 30))
        tcp = tensorshare.Client(tcp_addr, timeout=120, tensor_type="numpy")
        ux = tensorshare.Client(unix_addr, timeout=120, tensor_type="numpy")
        rng = np.random.default_rng(7)
        data = rng.standard_normal((rows, cols), dtype=np.float32)
        path = os.path.join(workdir, "rows.f32")
        data.tofile(path)
        tcp.create_tensor_bin("emb", "float32", (rows, cols))
        chunk = max(1, (16 << 20) // (cols * 4))
        for s in range(0, rows, chunk):
            tcp.write_rows("emb", s, data[s:s + chunk])
        mm = np.memmap(path, dtype=np.float32, mode="r", shape=(rows, cols))
        t0 = time.perf_counter()
        (ref,) = ux.peek("emb", ref=True)
        map_s = time.perf_counter() - t0
        del data

        methods = [
            ("gather_rows, TCP", lambda ix: tcp.gather_rows("emb", ix)),
            ("gather_rows, unix socket", lambda ix: ux.gather_rows("emb", ix)),
            ("by reference: peek(ref=True) mapping[index]", lambda ix: ref[ix]),
            ("numpy.memmap[index] (page cache)", lambda ix: mm[ix]),
        ]
        # Warm up every path (and the page cache of the file), then check the results agree.
        ix = rng.integers(0, rows, k, dtype=np.int64)
        want = mm[ix]
        _ = mm[:].sum()
        for name, fn in methods:
            got = fn(ix)
            if not np.array_equal(np.asarray(got), want):
                sys.exit("rows_bench: %s returned other rows than the memmap" % name)
        times = {name: [] for name, _ in methods}
        for rep in range(args.repeats):
            idx = [rng.integers(0, rows, k, dtype=np.int64) for _ in range(args.rounds)]
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for name, fn in order:
                t0 = time.perf_counter()
                for ix in idx:
                    fn(ix)
                times[name].append((time.perf_counter() - t0) / args.rounds)
        ref_t = statistics.median(times[methods[-1][0]])
        mb = k * cols * 4 / 1e6
        print("gather %d random rows of a float32 [%d, %d] tensor bin (%.0f MiB); %d repeats x "
              "%d gathers, medians" % (k, rows, cols, nbytes / (1 << 20), args.repeats,
                                       args.rounds))
        print("%-46s %12s %10s %10s" % ("method", "us/gather", "GB/s", "x memmap"))
        for name, _ in methods:
            t = statistics.median(times[name])
            print("%-46s %12.1f %10.2f %10.2f" % (name, t * 1e6, mb / t / 1e3, t / ref_t))
        print("(the by-reference mapping itself: one peek(ref=True), %.1f ms)" % (map_s * 1e3))
        del ref
        tcp.close()
        ux.close()
    finally:
        if proc is not None:
            stop_tensord(proc)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
