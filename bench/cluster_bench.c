/*
 * cluster_bench: what the cluster client adds per operation. One tensord (pinned to cpu0) and
 * two clients of it in one process (pinned to cpu1): a plain client on its address, and a
 * cluster client opened with a one-shard map file ("cluster:FILE") naming the same daemon, so
 * that both send the same frames to the same server and the difference is the routing (the slot
 * of the name, the owner lookup, holding the handle open for redirects). Small operations: PUT of
 * 64 bytes, GET of it back, and PING-like round trips (PEEK of a missing bin: a named request
 * with an empty answer; ts_ping itself fans out and would not compare like with like). The two
 * clients alternate in short blocks (A/B, then B/A), each pair of blocks gives a ratio; the
 * result is the median of those ratios (cluster time / plain time per operation), per repeat,
 * then the median over the repeats.
 *
 *   bench/run.sh cluster [--repeats N] [--ops N] [--no-pin]
 */
#include "bench.h"

#include "tensorshare/tensorshare.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* repeats at most (each runs both clients once per case) */
#define MAX_REPEATS 64
/* bytes of the tensor a PUT carries */
#define SMALL_BYTES 64
/* operations per timed block; a pair of blocks (plain, cluster) gives one ratio */
#define BLOCK_OPS 200
/* pairs of blocks per repeat at most */
#define MAX_PAIRS 4096
/* bins the operations cycle through (different slots, as a real workload's names) */
#define NAMES 64

static struct {
    const char *tensord;
    int repeats;
    int ops;
    char dir[64];
    pid_t pid;
} g;

static void die(const char *what, int rc)
{
    fprintf(stderr, "cluster_bench: %s: %s (%s)\n", what, ts_strerror(rc), ts_last_error());
    if (g.pid > 0)
        bench_stop(g.pid);
    exit(1);
}

enum { OP_PUT = 0, OP_GET, OP_PEEK_MISSING, N_OPS };
static const char *const op_names[N_OPS] = {"PUT 64 B", "GET 64 B", "PEEK missing (ping-like)"};

/* Microseconds per operation of kind op on c over ops operations. */
static double run(ts_client_t *c, int op, const ts_value_t *item, char names[NAMES][32], int ops)
{
    double t0 = bench_now();
    for (int i = 0; i < ops; i++) {
        const char *name = names[i % NAMES];
        int rc;
        if (op == OP_PUT) {
            rc = ts_put(c, name, item, NULL);
        } else if (op == OP_GET) {
            /* PUT and GET in pairs would time both: PEEK reads the item without removing it. */
            ts_items_t *items = NULL;
            rc = ts_peek(c, name, 1, &items);
            ts_items_free(items);
        } else {
            ts_items_t *items = NULL;
            rc = ts_peek(c, "cluster_bench.missing", 1, &items);
            ts_items_free(items);
            rc = rc == TS_ENOENT ? 0 : rc; /* the answer every time: no such bin */
        }
        if (rc != 0)
            die(op_names[op], rc);
    }
    return (bench_now() - t0) * 1e6 / ops;
}

static void usage(void)
{
    fprintf(stderr,
            "usage: cluster_bench [--repeats N (3..%d, default 5)] [--ops N (default "
            "20000)] [--tensord PATH] [--no-pin]\n",
            MAX_REPEATS);
}

int main(int argc, char **argv)
{
    g.tensord = TS_TENSORD_PATH;
    g.repeats = 5;
    g.ops = 20000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--repeats") == 0 && v != NULL) {
            g.repeats = (int)strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--ops") == 0 && v != NULL) {
            g.ops = (int)strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--tensord") == 0 && v != NULL) {
            g.tensord = v;
            i++;
        } else if (strcmp(a, "--no-pin") == 0) {
            bench_set_pinning(0);
        } else {
            usage();
            return strcmp(a, "--help") == 0 ? 0 : 2;
        }
    }
    if (g.repeats < 3 || g.repeats > MAX_REPEATS || g.ops < 2 * BLOCK_OPS) {
        usage();
        return 2;
    }
    snprintf(g.dir, sizeof(g.dir), "/tmp/cluster_bench.XXXXXX");
    if (mkdtemp(g.dir) == NULL) {
        perror("cluster_bench: mkdtemp");
        return 1;
    }
    bench_target t;
    g.pid = bench_start_tensord("cluster_bench", g.tensord, g.dir, "plain", 0, &t);
    if (g.pid < 0)
        return 1;
    char addr[64], map[128], caddr[160];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", t.port);
    snprintf(map, sizeof(map), "%s/one.map", g.dir);
    FILE *f = fopen(map, "w");
    if (f == NULL || fprintf(f, "# one shard: the same daemon\n%s\n", addr) < 0 || fclose(f) != 0)
        die("map file", TS_EINVAL);
    snprintf(caddr, sizeof(caddr), "cluster:%s", map);

    bench_pin_self(1); /* the clients' I/O threads, made at open, inherit it */
    ts_client_t *plain = NULL, *cluster = NULL;
    int rc = ts_client_open(&plain, addr, NULL);
    if (rc != 0)
        die("open plain", rc);
    if ((rc = ts_client_open(&cluster, caddr, NULL)) != 0)
        die("open cluster", rc);
    char names[NAMES][32];
    for (int i = 0; i < NAMES; i++)
        snprintf(names[i], sizeof(names[i]), "cluster_bench.%d", i);
    int64_t n = SMALL_BYTES / 4;
    ts_value_t *item = ts_tensor_alloc(TS_FLOAT32, 1, &n);
    if (item == NULL)
        die("tensor", TS_ENOMEM);
    bench_fill(ts_value_tensor(item)->data, SMALL_BYTES, 0, 7);
    for (int i = 0; i < NAMES; i++) { /* every bin exists before GET is timed */
        if ((rc = ts_put(plain, names[i], item, NULL)) != 0)
            die("warm-up", rc);
    }
    (void)run(plain, OP_PUT, item, names, g.ops); /* warm both paths once */
    (void)run(cluster, OP_PUT, item, names, g.ops);

    bench_print_machine();
    printf("cluster_bench: %d operations per run, %d repeats, one tensord (cpu0), the clients on "
           "cpu1%s; plain = \"%s\", cluster = a one-shard map of the same daemon\n",
           g.ops, g.repeats, bench_pinning() ? "" : " (not pinned)", addr);
    /*
     * On a shared machine the load changes from second to second, so the two clients alternate
     * in short blocks (BLOCK_OPS operations each, the order flipped every pair) and each pair
     * gives a ratio taken close together in time; a repeat reports the median of its pairs'
     * ratios, and the result is the median over the repeats.
     */
    double pv[N_OPS][MAX_REPEATS], cv[N_OPS][MAX_REPEATS], rv[N_OPS][MAX_REPEATS];
    int pairs = g.ops / BLOCK_OPS;
    if (pairs > MAX_PAIRS)
        pairs = MAX_PAIRS;
    static double pb[MAX_PAIRS], cb[MAX_PAIRS], ratio[MAX_PAIRS];
    for (int r = 0; r < g.repeats; r++) {
        for (int op = 0; op < N_OPS; op++) {
            for (int k = 0; k < pairs; k++) {
                if ((k + r) % 2 == 0) {
                    pb[k] = run(plain, op, item, names, BLOCK_OPS);
                    cb[k] = run(cluster, op, item, names, BLOCK_OPS);
                } else {
                    cb[k] = run(cluster, op, item, names, BLOCK_OPS);
                    pb[k] = run(plain, op, item, names, BLOCK_OPS);
                }
                ratio[k] = cb[k] / pb[k];
            }
            pv[op][r] = bench_median(pb, (size_t)pairs);
            cv[op][r] = bench_median(cb, (size_t)pairs);
            rv[op][r] = bench_median(ratio, (size_t)pairs);
        }
        printf("  repeat %d:", r + 1);
        for (int op = 0; op < N_OPS; op++)
            printf(" %s %.2f/%.2f us (x%.3f);", op_names[op], pv[op][r], cv[op][r], rv[op][r]);
        printf("\n");
    }
    printf("\n| operation | plain us/op | cluster us/op | cluster / plain (median of paired "
           "blocks) |\n");
    printf("|---|---|---|---|\n");
    for (int op = 0; op < N_OPS; op++) {
        printf("| %s | %.2f | %.2f | %.3f |\n", op_names[op],
               bench_median(pv[op], (size_t)g.repeats), bench_median(cv[op], (size_t)g.repeats),
               bench_median(rv[op], (size_t)g.repeats));
    }
    ts_value_free(item);
    ts_client_free(cluster);
    ts_client_free(plain);
    bench_stop(g.pid);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g.dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cluster_bench: could not remove %s\n", g.dir);
    return 0;
}
