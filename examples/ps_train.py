#!/usr/bin/env python3
"""A click model trained through the parameter server by four worker processes, compared with
the same model trained in one process (docs/PS.md).

The model: an embedding table (one row per item id) whose row is concatenated with a few dense
features and fed to a small MLP that predicts a click (binary cross-entropy). The data is
synthetic, made from a fixed seed: a hidden "true" embedding and weight vector decide each
sample's click probability.

Distributed run: the MLP's parameters are dense parameters (async SGD on the server) and the
embedding is a server-side table (SGD). Workers take batch numbers from a shared counter
(Client.add), so a worker that dies loses at most the batch it held and a restarted one carries
on; every batch is trained once in all, as in the single-process run. Halfway through, the
driver kills worker 1 with SIGKILL and starts it again. At 70% (--restart-at), it restarts
daemon 1 from its snapshot: SAVE, SIGTERM (whose final snapshot holds everything up to the
stop), then tensord again on the same port with the same --save file; the workers retry each
call that fails meanwhile (their clients reconnect by themselves) and carry on with the
restored parameters, table rows and counter.

The two daemons form a cluster (--shard 0/2 and 1/2, address "A,B"): dense parameters are
routed by name to either shard, and the embedding table exists on both with its rows spread by
id (docs/PS.md "Several daemons"). Every worker creates the parameters and the table it uses
with keep=True, which leaves the existing (or restored) ones as they are.

    python3 examples/ps_train.py --tensord build/server/tensord            # starts two daemons
    python3 examples/ps_train.py --address 127.0.0.1:7000,127.0.0.1:7001   # uses running ones

It prints both final losses (on a held-out set), asserts they are within --tolerance, and
writes the loss curves to --out (a CSV; a PNG too when matplotlib is installed;
examples/ps_plot.py draws the CSV).
"""
import argparse
import csv
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import tensorshare
except ImportError:  # run from a source tree: the build's package
    sys.path.insert(0, os.path.join(HERE, "..", "build", "python"))
    import tensorshare
from tensorshare import ps  # noqa: E402

EMB = "clicks/emb"  # the table's name (on every shard; its rows spread by id)
PREFIX = "clicks/mlp/"  # the MLP's parameters, routed by name across the shards
COUNTER = "clicks/next_batch"
DENSE = 6  # dense features per sample
DIM = 8  # embedding width
TEST = 4096  # held-out samples after the training ones
START_TIMEOUT_S = 10.0  # seconds a daemon may take to start listening
RETRY_S = 30.0  # seconds a call is retried while a daemon restarts
RETRY_SLEEP_S = 0.02  # seconds between two tries


def retry(fn):
    """fn() again while a daemon is away (restarting from its snapshot): connection errors and
    timeouts, for at most RETRY_S. A push whose connection dropped before its answer may have
    been applied; retrying it can apply one gradient twice, once per restart at most."""
    deadline = time.monotonic() + RETRY_S
    while True:
        try:
            return fn()
        except (tensorshare.ConnectionError, tensorshare.TimeoutError,
                tensorshare.ConnectionResetError, tensorshare.ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(RETRY_SLEEP_S)


def make_data(seed, n, num_ids):
    """Synthetic clicks: (ids int64 [n], x float32 [n, DENSE], y float32 [n])."""
    g = np.random.default_rng(seed)
    true_emb = g.normal(0, 1, (num_ids, 1)).astype(np.float32)
    true_w = g.normal(0, 1, DENSE).astype(np.float32)
    ids = g.integers(0, num_ids, n).astype(np.int64)
    x = g.normal(0, 1, (n, DENSE)).astype(np.float32)
    logit = 1.5 * true_emb[ids, 0] + x @ true_w * 0.7
    y = (g.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, x, y


def make_mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM + DENSE, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1))


def batch_loss(mlp, rows, x, y):
    logits = mlp(torch.cat([rows, torch.from_numpy(x)], 1)).squeeze(1)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(y))


def batch_slice(args, b):
    n = args.batch
    return slice(b * n, (b + 1) * n)


def train_local(args, data, test):
    """One process: the same model, data order, initial values and SGD."""
    ids, x, y = data
    mlp = make_mlp(args.seed)
    # The same initial rows as the server's table (the table's initializer from its seed).
    emb = torch.nn.Embedding(args.num_ids, DIM)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(args.init_rows))
    opt = torch.optim.SGD(list(mlp.parameters()) + list(emb.parameters()), lr=args.lr)
    curve = []
    for b in range(args.batches):
        s = batch_slice(args, b % args.batches_per_epoch)
        loss = batch_loss(mlp, emb(torch.from_numpy(ids[s])), x[s], y[s])
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append((b, loss.item()))
    with torch.no_grad():
        final = batch_loss(mlp, emb(torch.from_numpy(test[0])), test[1], test[2]).item()
    return curve, final


def worker(args):
    """One worker process: take batch numbers until none are left."""
    ids, x, y = make_data(args.seed, args.samples + TEST, args.num_ids)
    mlp = make_mlp(args.seed)
    out = open(args.curve, "a")
    with tensorshare.Client(args.address, tensor_type="torch") as c:
        pc = ps.ParameterClient(c, mlp, PREFIX)
        # What a worker starting (again) does: create with keep, which changes nothing that
        # exists with these settings; the first pull then loads the server's values.
        retry(lambda: pc.create(mlp, keep=True, optimizer=ps.SGD, lr=args.lr))
        retry(lambda: ps.emb_create(c, EMB, DIM, optimizer=ps.SGD, lr=args.lr, seed=args.seed,
                                    num_ids=args.num_ids))
        while True:
            b = retry(lambda: c.add(COUNTER)) - 1
            if b >= args.batches:
                break
            s = batch_slice(args, b % args.batches_per_epoch)
            retry(lambda: pc.pull(mlp))
            batch_ids = torch.from_numpy(ids[s])
            _, rows = retry(lambda: ps.emb_pull(c, EMB, batch_ids, DIM))
            rows.requires_grad_(True)
            loss = batch_loss(mlp, rows, x[s], y[s])
            mlp.zero_grad()
            loss.backward()
            # Each parameter retried on its own, so that a restart does not push the others twice.
            for n, p in mlp.named_parameters():
                retry(lambda: ps.push(c, PREFIX + n, p.grad.contiguous(), pc.versions[n]))
            # The mean loss's row gradients; the server applies lr (SGD) per row.
            grads = rows.grad.contiguous()
            retry(lambda: ps.emb_push(c, EMB, batch_ids, grads))
            out.write("%d,%f\n" % (b, loss.item()))
            out.flush()
            if args.slow_ms:
                time.sleep(args.slow_ms / 1000)
    out.close()


def start_daemon(tensord, i, n, folder, port=0):
    """Shard i of n with --save FOLDER/snapI (loaded again when it exists); (process, address)."""
    port_file = os.path.join(folder, "port%d" % i)
    if os.path.exists(port_file):
        os.unlink(port_file)
    log = open(os.path.join(folder, "tensord%d.log" % i), "ab")
    p = subprocess.Popen([tensord, "--port", str(port), "--port-file", port_file, "--shard",
                          "%d/%d" % (i, n), "--save", os.path.join(folder, "snap%d" % i),
                          "--log-level", "warn"], stdout=log, stderr=log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (os.path.exists(port_file) and open(port_file).read().strip()):
        if time.monotonic() > deadline or p.poll() is not None:
            raise SystemExit("tensord did not start (see %s)" % folder)
        time.sleep(0.01)
    return p, "127.0.0.1:" + open(port_file).read().strip()


def start_daemons(tensord, n, folder):
    started = [start_daemon(tensord, i, n, folder) for i in range(n)]
    return [p for p, _ in started], [a for _, a in started]


def restart_daemon(args, daemons, addrs, i):
    """SAVE daemon i, stop it (SIGTERM: its final snapshot), start it again from the file."""
    with tensorshare.Client(addrs[i]) as one:
        one.save()
    daemons[i].send_signal(signal.SIGTERM)
    daemons[i].wait(START_TIMEOUT_S)
    port = int(addrs[i].rsplit(":", 1)[1])
    daemons[i], _ = start_daemon(args.tensord, i, len(daemons), args.tmp, port)


def spawn_worker(args, k):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--address", args.address,
           "--curve", os.path.join(args.tmp, "curve%d.csv" % k)] + args.common
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensord", help="start two daemons from this binary")
    ap.add_argument("--address", help="cluster (or one daemon's) address")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--num-ids", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="largest allowed |distributed - single| final loss")
    ap.add_argument("--no-kill", action="store_true", help="do not kill and restart a worker")
    ap.add_argument("--restart-at", type=float, default=0.7,
                    help="fraction of the batches after which daemon 1 is restarted from its "
                    "snapshot (with --tensord; 0: never)")
    ap.add_argument("--out", default="ps_train_curves.csv")
    ap.add_argument("--slow-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--curve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.batches_per_epoch = args.samples // args.batch
    args.batches = args.batches_per_epoch * args.epochs
    if args.worker:
        return worker(args)
    args.common = ["--samples", str(args.samples), "--num-ids", str(args.num_ids), "--batch",
                   str(args.batch), "--epochs", str(args.epochs), "--seed", str(args.seed),
                   "--slow-ms", str(args.slow_ms)]
    args.tmp = tempfile.mkdtemp(prefix="ps_train-")
    daemons, addrs = [], []
    if args.tensord:
        daemons, addrs = start_daemons(args.tensord, 2, args.tmp)
        args.address = ",".join(addrs)
    if not args.address:
        raise SystemExit("give --tensord or --address")
    try:
        data = make_data(args.seed, args.samples + TEST, args.num_ids)
        # The held-out set: the samples after the training ones (the same hidden model).
        test = tuple(a[args.samples:] for a in data)
        with tensorshare.Client(args.address, tensor_type="torch") as c:
            try:  # a previous run's counter on the same daemons
                c.delete(COUNTER)
            except tensorshare.BinNotFoundError:
                pass
            ps.emb_create(c, EMB, DIM, optimizer=ps.SGD, lr=args.lr, seed=args.seed,
                          num_ids=args.num_ids)
            _, rows = ps.emb_pull(c, EMB, torch.arange(args.num_ids), DIM)
            args.init_rows = rows.numpy().copy()
            ps.ParameterClient(c, make_mlp(args.seed), PREFIX).create(
                make_mlp(args.seed), optimizer=ps.SGD, lr=args.lr)
            t0 = time.monotonic()
            workers = [spawn_worker(args, k) for k in range(args.workers)]
            killed = restarted = False
            events = []
            while any(w.poll() is None for w in workers):
                done = retry(lambda: c.add(COUNTER, 0))
                if not killed and not args.no_kill and done >= args.batches // 2:
                    workers[1].send_signal(signal.SIGKILL)
                    workers[1].wait()
                    workers[1] = spawn_worker(args, 1)
                    killed = True
                    events.append((done, "worker 1 killed"))
                    print("killed worker 1 at batch %d and restarted it" % done)
                if (not restarted and daemons and args.restart_at > 0 and
                        done >= int(args.batches * args.restart_at)):
                    t = time.monotonic()
                    restart_daemon(args, daemons, addrs, 1)
                    restarted = True
                    events.append((done, "daemon 1 restarted from its snapshot"))
                    print("restarted daemon 1 from its snapshot at batch %d (%.2f s down)"
                          % (done, time.monotonic() - t))
                time.sleep(0.02)
            if any(w.returncode != 0 for w in workers):
                raise SystemExit("a worker failed")
            wall = time.monotonic() - t0
            mlp = make_mlp(args.seed)
            retry(lambda: ps.ParameterClient(c, mlp, PREFIX).pull(mlp))
            _, rows = retry(lambda: ps.emb_pull(c, EMB, torch.from_numpy(test[0]), DIM))
            with torch.no_grad():
                dist_final = batch_loss(mlp, rows, test[1], test[2]).item()
        t1 = time.monotonic()
        local_curve, local_final = train_local(args, data, test)
        local_wall = time.monotonic() - t1
        dist_curve = []
        for k in range(args.workers):
            with open(os.path.join(args.tmp, "curve%d.csv" % k)) as f:
                dist_curve += [(int(b), float(v)) for b, v in csv.reader(f)]
        dist_curve.sort()
        write_curves(args.out, local_curve, dist_curve, events)
        print("batches %d of %d samples, %d workers, lr %g" % (args.batches, args.batch,
                                                              args.workers, args.lr))
        print("single process: final held-out loss %.4f (%.1f s)" % (local_final, local_wall))
        print("%d workers, 2 daemons: final held-out loss %.4f (%.1f s, %d batches trained)"
              % (args.workers, dist_final, wall, len(dist_curve)))
        diff = abs(dist_final - local_final)
        print("difference %.4f (tolerance %.4f)" % (diff, args.tolerance))
        assert diff <= args.tolerance, "the distributed loss is not within the tolerance"
    finally:
        for p in daemons:
            p.send_signal(signal.SIGTERM)
            p.wait(10)
        # The workers' curves, the daemons' logs, ports and snapshots.
        shutil.rmtree(args.tmp, ignore_errors=True)


def write_curves(path, local_curve, dist_curve, events):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "batch", "loss"])
        for b, what in events:
            w.writerow(["event:" + what, b, 0])
        for b, v in local_curve:
            w.writerow(["single", b, v])
        for b, v in dist_curve:
            w.writerow(["distributed", b, v])
    try:
        sys.path.insert(0, HERE)
        import ps_plot

        ps_plot.plot(path, os.path.splitext(path)[0] + ".png")
    except ImportError:
        print("matplotlib is not installed: curves in %s (examples/ps_plot.py draws them)" % path)


if __name__ == "__main__":
    main()
