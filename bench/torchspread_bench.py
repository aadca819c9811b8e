#!/usr/bin/env python3
"""Torch Spread's NetworkClient on the batcher benchmark's MLP, for a same-run comparison.

    TORCHSPREAD_DIR=/path/to/TorchSpread bench/torchspread_bench.py --clients 8 --requests 300

Torch Spread (a Python dynamic batcher for PyTorch) is not part of this repository: point
TORCHSPREAD_DIR at a checkout of it (it needs numpy, pyzmq, lz4 and msgpack; on Debian
python3-zmq, python3-lz4, python3-msgpack). Its NetworkManager serves an MLP of --widths
(default 8,32,4: tests/shim's mlp.pt shape, float32, one intra-op thread per network) with
--max-batch rows per batch on --networks CPU networks; --clients separate client processes each
send --requests single-row blocking predictions through their own NetworkClient (shared-memory
buffers on this host). Prints one line per repeat and the median rate:

    torchspread  clients 8  repeat 1  req/s 12345

With --pin the manager's processes run on cpu0 and the clients on cpu1, as bench/run.sh pins
servers and clients. bench/batcher_vs_torchspread.sh runs this beside batcher_bench.
"""
import argparse
import os
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--networks", type=int, default=1)
    p.add_argument("--widths", default="8,32,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pin", action="store_true")
    return p.parse_args()


ts_dir = os.environ.get("TORCHSPREAD_DIR")
if not ts_dir or not os.path.isdir(os.path.join(ts_dir, "torch_spread")):
    sys.exit("torchspread_bench: set TORCHSPREAD_DIR to a checkout of Torch Spread")
sys.path.insert(0, ts_dir)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch_spread import NetworkClient, NetworkManager, SpreadModule, mp_ctx  # noqa: E402

SERVER_CPU, CLIENT_CPU = 0, 1


def pin(cpu, on):
    if on and os.cpu_count() >= 2:
        os.sched_setaffinity(0, {cpu})


class BenchMLP(SpreadModule):
    """Linear layers of the given widths with a ReLU between them (as make_models --mlp)."""

    def __init__(self, worker, widths):
        super().__init__(worker)
        # Like the batcher benchmark's replicas: one intra-op thread per network.
        torch.set_num_threads(1)
        layers = []
        for i in range(len(widths) - 1):
            layers.append(nn.Linear(widths[i], widths[i + 1]))
            if i + 2 < len(widths):
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def client_main(config, index, requests, in_cols, do_pin, ready, start, results):
    pin(CLIENT_CPU, do_pin)
    torch.set_num_threads(1)
    x = torch.full((1, in_cols), 0.1 * (index % 7))
    with NetworkClient(config, 1) as client:
        client.predict(x)  # warm-up, before the clock
        ready.put(index)
        start.wait()
        t0 = time.monotonic()
        for _ in range(requests):
            client.predict(x)
        results.put((t0, time.monotonic()))


def main():
    a = parse_args()
    widths = [int(w) for w in a.widths.split(",")]
    pin(SERVER_CPU, a.pin)  # the manager's processes inherit the server CPU
    manager = NetworkManager(
        (widths[0],), torch.float32, (widths[-1],), torch.float32, a.max_batch, BenchMLP,
        network_args=[widths], placement={"cpu": a.networks})
    rates = []
    with manager:
        for rep in range(a.repeats):
            start = mp_ctx.Event()
            ready = mp_ctx.Queue()
            results = mp_ctx.Queue()
            procs = [mp_ctx.Process(target=client_main,
                                    args=(manager.client_config, i, a.requests, widths[0], a.pin,
                                          ready, start, results))
                     for i in range(a.clients)]
            for p in procs:
                p.start()
            for _ in procs:  # every client registered and warmed up
                ready.get(timeout=600)
            start.set()
            spans = [results.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
            wall = max(e for _, e in spans) - min(s for s, _ in spans)
            rate = a.clients * a.requests / wall
            rates.append(rate)
            print("torchspread  clients %d  repeat %d  req/s %.0f" % (a.clients, rep + 1, rate),
                  flush=True)
    print("torchspread  clients %d  median req/s %.0f" % (a.clients, statistics.median(rates)),
          flush=True)


if __name__ == "__main__":
    main()
