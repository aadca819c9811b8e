/*
 * tls_bench: what TLS costs a large transfer, against plain TCP in the same run.
 *
 *   tls_bench [--repeats N] [--mib M] [--iters I] [--no-pin] [--tensord PATH]
 *
 * It makes a throwaway CA and server certificate (the openssl command), starts two tensord
 * (pinned to cpu0: one with --tls-cert/--tls-key, one plain; only one is busy at a time), and
 * from this process (pinned to cpu1, the client's I/O thread with it) puts then gets one float32
 * tensor of --mib MiB (default 64) --iters times (default 4) per run, through tls://127.0.0.1
 * and through 127.0.0.1. The two alternate (TLS first on odd repeats); the report gives the
 * median rate of each in GB/s (bytes put plus bytes got, per second), the ratio TLS / plain,
 * and whether the CPU has AES instructions (OpenSSL uses them for AES-GCM). The plain client keeps
 * its caller-side fast path (as users get it); the TLS client goes through its I/O thread, and
 * a third row runs plain TCP that way too (TS_CLIENT_DIRECT=0), to tell TLS's own cost from that
 * of losing the fast path. Nothing here is a test: the numbers are only meaningful as ratios
 * taken in one run on an otherwise idle machine.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tensorshare/tensorshare.h>

#include "bench.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

#define MIB         ((size_t)1 << 20)
#define MAX_REPEATS 32

static struct {
    const char *tensord;
    int repeats;
    size_t mib;
    int iters;
    char dir[128];
    char cert[256], key[256], ca[256];
    pid_t tls_pid, plain_pid;
    int tls_port, plain_port;
} g;

static void cleanup(void)
{
    if (g.tls_pid > 0)
        bench_stop(g.tls_pid);
    if (g.plain_pid > 0)
        bench_stop(g.plain_pid);
    g.tls_pid = g.plain_pid = 0;
    if (g.dir[0] != '\0') {
        char cmd[300];
        snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g.dir);
        if (system(cmd) != 0)
            fprintf(stderr, "tls_bench: could not remove %s\n", g.dir);
    }
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "tls_bench: %s: %s (%s)\n", what, ts_strerror(rc), ts_last_error());
    cleanup();
    exit(1);
}

/* The CA and the server's certificate for 127.0.0.1, with the openssl command. */
static int make_certs(void)
{
    snprintf(g.ca, sizeof(g.ca), "%s/ca.pem", g.dir);
    snprintf(g.cert, sizeof(g.cert), "%s/server.pem", g.dir);
    snprintf(g.key, sizeof(g.key), "%s/server.key", g.dir);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "(set -e; cd '%s'; K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes';"
             " openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 -subj /CN=bench-ca"
             " -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign;"
             " printf 'subjectAltName=IP:127.0.0.1\\n' > server.ext;"
             " openssl req $K -keyout server.key -out server.csr -subj /CN=127.0.0.1;"
             " openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial"
             " -out server.pem -days 2 -extfile server.ext) >'%s/openssl.log' 2>&1",
             g.dir, g.dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* Start tensord (TLS or plain) pinned to cpu0; its port, or -1. */
static int start(int tls, pid_t *pid)
{
    char port_file[256], log[256];
    snprintf(port_file, sizeof(port_file), "%s/%s.port", g.dir, tls ? "tls" : "plain");
    snprintf(log, sizeof(log), "%s/%s.log", g.dir, tls ? "tls" : "plain");
    char *argv[16];
    int n = 0;
    argv[n++] = (char *)g.tensord;
    argv[n++] = "--port";
    argv[n++] = "0";
    argv[n++] = "--port-file";
    argv[n++] = port_file;
    argv[n++] = "--max-memory";
    argv[n++] = "4g";
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    if (tls) {
        argv[n++] = "--tls-cert";
        argv[n++] = g.cert;
        argv[n++] = "--tls-key";
        argv[n++] = g.key;
    }
    argv[n] = NULL;
    *pid = bench_spawn(argv, 0, log);
    if (*pid < 0)
        return -1;
    int port = bench_read_port_file(port_file);
    if (port < 0)
        fprintf(stderr, "tls_bench: tensord did not start; see %s\n", log);
    return port;
}

/* CPU seconds per GB moved, client and server, of the last run of each kind. */
static double cpu_client[3][MAX_REPEATS], cpu_server[3][MAX_REPEATS];
static int cur_repeat;

/* One run: iters rounds of put then get of the tensor; the rate in GB/s. */
static double run(int tls, ts_value_t *t)
{
    /*
     * tls 2: plain TCP with every byte through the client's I/O thread (TS_CLIENT_DIRECT=0, read
     * at open), as on a TLS connection: what TLS costs beyond losing the caller-side fast path.
     */
    if (tls == 2)
        setenv("TS_CLIENT_DIRECT", "0", 1);
    char addr[64];
    snprintf(addr, sizeof(addr), "%s127.0.0.1:%d", tls == 1 ? "tls://" : "",
             tls == 1 ? g.tls_port : g.plain_port);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.tls_ca_file = g.ca;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, &o);
    unsetenv("TS_CLIENT_DIRECT");
    if (rc != 0)
        die(addr, rc);
    /* One round untimed: connections warm, buffers allocated on both sides. */
    ts_items_t *items = NULL;
    if ((rc = ts_put(c, "b", t, NULL)) != 0 || (rc = ts_get(c, "b", 0, &items)) != 0)
        die("warm-up", rc);
    ts_items_free(items);
    pid_t spid = tls == 1 ? g.tls_pid : g.plain_pid;
    double c0 = bench_cpu_self(), s0 = bench_cpu_pid(spid);
    double t0 = bench_now();
    for (int i = 0; i < g.iters; i++) {
        if ((rc = ts_put(c, "b", t, NULL)) != 0)
            die("put", rc);
        if ((rc = ts_get(c, "b", 0, &items)) != 0)
            die("get", rc);
        ts_items_free(items);
    }
    double secs = bench_now() - t0;
    double gb = 2.0 * (double)g.mib * (double)MIB * g.iters / 1e9;
    cpu_client[tls][cur_repeat] = (bench_cpu_self() - c0) / gb;
    cpu_server[tls][cur_repeat] = (bench_cpu_pid(spid) - s0) / gb;
    ts_client_free(c);
    return gb / secs;
}

/* 1 when /proc/cpuinfo lists the aes flag. */
static int has_aes(void)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f == NULL)
        return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL)
        found = strncmp(line, "flags", 5) == 0 && strstr(line, " aes ") != NULL;
    fclose(f);
    return found;
}

static void usage(void)
{
    printf("usage: tls_bench [--repeats N] [--mib M] [--iters I] [--no-pin] [--tensord PATH]\n");
}

int main(int argc, char **argv)
{
    g.tensord = TS_TENSORD_PATH;
    g.repeats = 5;
    g.mib = 64;
    g.iters = 4;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--repeats") == 0 && v != NULL) {
            g.repeats = (int)strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--mib") == 0 && v != NULL) {
            g.mib = (size_t)strtoul(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--iters") == 0 && v != NULL) {
            g.iters = (int)strtol(v, NULL, 10);
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
    if (g.repeats < 3 || g.repeats > MAX_REPEATS || g.mib < 1 || g.mib > 1024 || g.iters < 1) {
        fprintf(stderr, "tls_bench: --repeats 3..%d, --mib 1..1024, --iters >= 1\n", MAX_REPEATS);
        return 2;
    }
    snprintf(g.dir, sizeof(g.dir), "/tmp/tls_bench.XXXXXX");
    if (mkdtemp(g.dir) == NULL) {
        perror("tls_bench: mkdtemp");
        return 1;
    }
    if (make_certs() != 0) {
        fprintf(stderr, "tls_bench: openssl failed; see %s/openssl.log\n", g.dir);
        return 1;
    }
    g.tls_port = start(1, &g.tls_pid);
    g.plain_port = start(0, &g.plain_pid);
    if (g.tls_port < 0 || g.plain_port < 0) {
        cleanup();
        return 1;
    }
    bench_pin_self(1); /* the client's I/O thread, made at open, inherits it */
    int64_t shape[1] = {(int64_t)(g.mib * MIB / 4)};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, shape);
    if (t == NULL)
        die("tensor", TS_ENOMEM);
    bench_fill(ts_value_tensor(t)->data, g.mib * MIB, 0, 42); /* incompressible */

    bench_print_machine();
    printf("tls_bench: put+get of one %zu MiB float32 tensor, %d rounds per run, %d repeats "
           "(tensord on cpu0, client on cpu1%s)\n",
           g.mib, g.iters, g.repeats, bench_pinning() ? "" : "; not pinned");
    double tls_v[MAX_REPEATS], plain_v[MAX_REPEATS], io_v[MAX_REPEATS];
    for (int r = 0; r < g.repeats; r++) {
        cur_repeat = r;
        if (r % 2 == 0) {
            tls_v[r] = run(1, t);
            plain_v[r] = run(0, t);
            io_v[r] = run(2, t);
        } else {
            io_v[r] = run(2, t);
            plain_v[r] = run(0, t);
            tls_v[r] = run(1, t);
        }
        printf("  repeat %d: TLS %.2f GB/s, plain %.2f GB/s, plain through the I/O thread %.2f "
               "GB/s\n",
               r + 1, tls_v[r], plain_v[r], io_v[r]);
        fflush(stdout);
    }
    ts_value_free(t);
    double tm = bench_median(tls_v, (size_t)g.repeats);
    double pm = bench_median(plain_v, (size_t)g.repeats);
    printf("\n| %zu MiB put+get over TCP | GB/s (median of %d) |\n|---|---|\n", g.mib, g.repeats);
    double im = bench_median(io_v, (size_t)g.repeats);
    printf("| TLS (tls://) | %.2f |\n| plain | %.2f |\n| TLS / plain | %.2fx |\n", tm, pm, tm / pm);
    printf("| plain, I/O thread only (TS_CLIENT_DIRECT=0) | %.2f |\n| TLS / that | %.2fx |\n", im,
           tm / im);
    printf("\nCPU seconds per GB moved (median): TLS client %.3f, server %.3f; plain client "
           "%.3f, server %.3f\n",
           bench_median(cpu_client[1], (size_t)g.repeats),
           bench_median(cpu_server[1], (size_t)g.repeats),
           bench_median(cpu_client[0], (size_t)g.repeats),
           bench_median(cpu_server[0], (size_t)g.repeats));
    printf("CPU AES instructions: %s\n", has_aes() ? "yes" : "no");
    cleanup();
    return 0;
}
