/*
 * zc_bench: same-host zero copy, measured against its physical references in one run.
 *
 *   zc_bench [--repeats N] [--max-mib M] [--readers R] [--skip curve,put,pss,drop] [--no-pin]
 *            [--tensord PATH]
 *
 * It starts its own tensord (pinned to cpu0, the client to cpu1) with a unix socket and reports:
 *   curve  a get and a peek by reference (ts_get_ref, ts_peek_ref) of one float32 tensor from 1 MiB
 *          up to --max-mib (default 1024), with a copying ts_get through the same unix socket as
 *          the reference row (up to 256 MiB);
 *   put    a 64 MiB put through a shared buffer (ts_shared_new, fill by memcpy, ts_shared_put)
 *          against memcpy of 64 MiB into warm memory and into fresh memory (the ceilings), and a
 *          ts_put through the socket;
 *   pss    R reader processes (default 8) each map the same 1 GiB item by reference and read
 *          every page: the proportional set sizes of the readers and of tensord, and the growth of
 *          the machine's shared and anonymous memory (/proc/meminfo);
 *   drop   DELETE of a 1 GiB item held in a client's shared buffer (tensord holds its last
 *          reference) while a second connection sends PINGs: the worst PING round trip, with the
 *          release on tensord's reclaim thread against the reference, the release on the loop
 *          thread (a tensord started with TSD_RECLAIM_OFF=1); each repeat starts both afresh.
 * The systems of a row alternate (the reference first on odd repeats); tables show medians over
 * the repeats. Nothing here is a test: the numbers are meaningful as ratios within one run.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <tensorshare/tensorshare.h>

#include "bench.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

#define MIB          ((size_t)1 << 20)
#define MAX_REPEATS  32
#define COPY_MAX_MIB 256          /* the copying reference row stops here (its time grows) */
#define PUT_SIZE     (64 * MIB)   /* the shared-buffer put case */
#define PSS_SIZE     (1024 * MIB) /* the item the readers of the pss case share */
#define MAX_READERS  64
#define PAGE         4096
/* peeks per size and repeat: a peek leaves the item, so one put serves them all */
#define PEEK_ITERS 100

static struct {
    const char *tensord;
    int repeats;
    size_t max_mib;
    int readers;
    int skip_curve, skip_put, skip_pss, skip_drop;
    char dir[128];
    char sock[256];
    char addr[300];
    pid_t pid;
} g;

static void die(const char *what, int rc)
{
    fprintf(stderr, "zc_bench: %s: %s (%s)\n", what, ts_strerror(rc), ts_last_error());
    if (g.pid > 0)
        bench_stop(g.pid);
    exit(1);
}

static int start_tensord(void)
{
    char log[256];
    snprintf(g.sock, sizeof(g.sock), "%s/tensord.sock", g.dir);
    snprintf(g.addr, sizeof(g.addr), "unix:%s", g.sock);
    snprintf(log, sizeof(log), "%s/tensord.log", g.dir);
    char *argv[] = {(char *)g.tensord, "--port", "0",           "--unix", g.sock,
                    "--max-memory",    "12g",    "--log-level", "warn",   NULL};
    g.pid = bench_spawn(argv, 0, log);
    if (g.pid < 0 || bench_wait_listening(0, g.sock, 15) != 0) {
        fprintf(stderr, "zc_bench: tensord (%s) did not start; see %s\n", g.tensord, log);
        return -1;
    }
    return 0;
}

static ts_client_t *client_open(void)
{
    ts_client_t *c;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 120000;
    int rc = ts_client_open(&c, g.addr, &o);
    if (rc != 0)
        die("connect", rc);
    return c;
}

/* A shared buffer holding one float32 tensor of size bytes, filled from src (or a pattern). */
static ts_shared_t *shared_tensor(size_t size, const void *src)
{
    int64_t n = (int64_t)(size / 4);
    ts_value_t *layout = ts_tensor_spec_new(TS_FLOAT32, 1, &n);
    ts_shared_t *sh = NULL;
    int rc = layout != NULL ? ts_shared_new(layout, &sh) : TS_ENOMEM;
    ts_value_free(layout);
    if (rc != 0)
        die("ts_shared_new", rc);
    void *data = ts_value_tensor(ts_shared_value(sh))->data;
    if (src != NULL)
        memcpy(data, src, size);
    else
        memset(data, 0x3c, size);
    return sh;
}

static void shared_put(ts_client_t *c, const char *bin, size_t size, const void *src)
{
    ts_shared_t *sh = shared_tensor(size, src);
    int rc = ts_shared_put(c, bin, sh, NULL);
    ts_shared_free(sh);
    if (rc != 0)
        die("ts_shared_put", rc);
}

static ts_value_t *tensor_over(void *data, size_t size)
{
    int64_t n = (int64_t)(size / 4);
    return ts_tensor_new(TS_FLOAT32, 1, &n, data, TS_BORROW);
}

/* ---------------------------------------------------------------------------------------------
 * curve: get and peek by reference against a copying get
 */

typedef struct {
    double ref_get, ref_peek, ref_free, copy_get;
} curve_row;

static int iters_for(size_t size)
{
    if (size <= 16 * MIB)
        return 50;
    if (size <= 256 * MIB)
        return 12;
    return 4;
}

/*
 * Median seconds of a get by reference, of freeing what it returned, and of a PING right after
 * that free. The items are appended first (untimed), so that each timed get finds its item
 * settled, as a reader would. Freeing a taken item gives its pages back (milliseconds for large
 * ones), and on a VM a server idle that long is slow to wake: the PING after the free measures
 * that wake-up, and leaves the server awake for the next get, which so measures the get itself.
 */
static void run_get_ref(ts_client_t *c, size_t size, int iters, double *get_s, double *free_s,
                        double *wake_s)
{
    double g_s[64], f_s[64], w_s[64];
    for (int i = 0; i < iters; i++) {
        ts_shared_t *sh = shared_tensor(size, NULL);
        int rc = ts_shared_append(c, "zc.curve.get", sh, NULL);
        ts_shared_free(sh);
        if (rc != 0)
            die("ts_shared_append", rc);
    }
    int rc = ts_ping(c);
    if (rc != 0)
        die("ts_ping", rc);
    for (int i = 0; i < iters; i++) {
        ts_items_t *it = NULL;
        double t0 = bench_now();
        rc = ts_get_ref(c, "zc.curve.get", 1, &it);
        double t1 = bench_now();
        if (rc != 0)
            die("ts_get_ref", rc);
        ts_items_free(it);
        double t2 = bench_now();
        rc = ts_ping(c);
        double t3 = bench_now();
        if (rc != 0)
            die("ts_ping", rc);
        g_s[i] = t1 - t0;
        f_s[i] = t2 - t1;
        w_s[i] = t3 - t2;
    }
    *get_s = bench_median(g_s, (size_t)iters);
    *free_s = bench_median(f_s, (size_t)iters);
    *wake_s = bench_median(w_s, (size_t)iters);
}

static double run_peek_ref(ts_client_t *c, size_t size)
{
    double s[PEEK_ITERS];
    int iters = PEEK_ITERS;
    shared_put(c, "zc.curve", size, NULL);
    for (int i = 0; i < iters; i++) {
        ts_items_t *it = NULL;
        double t0 = bench_now();
        int rc = ts_peek_ref(c, "zc.curve", 1, &it);
        double t1 = bench_now();
        if (rc != 0)
            die("ts_peek_ref", rc);
        ts_items_free(it);
        s[i] = t1 - t0;
    }
    return bench_median(s, (size_t)iters);
}

static double run_copy_get(ts_client_t *c, size_t size, int iters, void *buf)
{
    double s[64];
    ts_value_t *v = tensor_over(buf, size);
    for (int i = 0; i < iters; i++) {
        int rc = ts_put(c, "zc.copy", v, NULL);
        if (rc != 0)
            die("ts_put", rc);
        ts_items_t *it = NULL;
        double t0 = bench_now();
        rc = ts_get(c, "zc.copy", 1, &it);
        double t1 = bench_now();
        if (rc != 0)
            die("ts_get", rc);
        ts_items_free(it);
        s[i] = t1 - t0;
    }
    ts_value_free(v);
    return bench_median(s, (size_t)iters);
}

/*
 * The floor of any read by reference on this machine: mapping a memfd of size bytes read-only and
 * reading its first page, then unmapping it, in this process alone (no server, no socket). Median
 * seconds of each over MAP_FLOOR_ITERS tries.
 */
#define MAP_FLOOR_ITERS 50

static void map_floor(size_t size, double *map_s, double *unmap_s)
{
    int fd = memfd_create("zc-floor", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0)
        die("memfd_create", TS_ENOMEM);
    void *w = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (w == MAP_FAILED)
        die("mmap", TS_ENOMEM);
    memset(w, 0x3c, size);
    munmap(w, size);
    double m[MAP_FLOOR_ITERS], u[MAP_FLOOR_ITERS];
    volatile uint8_t sink = 0;
    for (int i = 0; i < MAP_FLOOR_ITERS; i++) {
        double t0 = bench_now();
        const uint8_t *p = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            die("mmap", TS_ENOMEM);
        sink += p[0];
        double t1 = bench_now();
        munmap((void *)p, size);
        double t2 = bench_now();
        m[i] = t1 - t0;
        u[i] = t2 - t1;
    }
    (void)sink;
    close(fd);
    *map_s = bench_median(m, MAP_FLOOR_ITERS);
    *unmap_s = bench_median(u, MAP_FLOOR_ITERS);
}

static void case_curve(ts_client_t *c)
{
    size_t sizes[16], ns = 0;
    for (size_t m = 1; m <= g.max_mib && ns < 16; m *= 4)
        sizes[ns++] = m * MIB;
    void *buf = bench_alloc(COPY_MAX_MIB * MIB);
    if (buf == NULL)
        die("allocation", TS_ENOMEM);
    bench_fill(buf, COPY_MAX_MIB * MIB, 0, 1);
    double fm, fu;
    map_floor(64 * MIB, &fm, &fu);
    printf("\nthis machine, one process, a 64 MiB memfd: mmap + first page read %.1f us, munmap "
           "%.1f us (the floor of a read by reference)\n",
           fm * 1e6, fu * 1e6);
    printf("\n#### Get by reference (unix socket, one float32 tensor; median us per call)\n\n");
    printf("| size | get_ref | peek_ref | free (munmap) | PING after the free | get (copy) | "
           "copy / get_ref |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (size_t k = 0; k < ns; k++) {
        size_t size = sizes[k];
        int iters = iters_for(size);
        double gr[MAX_REPEATS], pr[MAX_REPEATS], fr[MAX_REPEATS], cg[MAX_REPEATS], wr[MAX_REPEATS];
        int copy = size <= COPY_MAX_MIB * MIB;
        for (int r = 0; r < g.repeats; r++) {
            if (copy && (r & 1))
                cg[r] = run_copy_get(c, size, iters, buf);
            run_get_ref(c, size, iters, &gr[r], &fr[r], &wr[r]);
            pr[r] = run_peek_ref(c, size);
            if (copy && !(r & 1))
                cg[r] = run_copy_get(c, size, iters, buf);
        }
        double mg = bench_median(gr, (size_t)g.repeats), mp = bench_median(pr, (size_t)g.repeats);
        double mf = bench_median(fr, (size_t)g.repeats), mw = bench_median(wr, (size_t)g.repeats);
        printf("| %zu MiB | %.1f | %.1f | %.1f | %.1f |", size / MIB, mg * 1e6, mp * 1e6, mf * 1e6,
               mw * 1e6);
        if (copy) {
            double mc = bench_median(cg, (size_t)g.repeats);
            printf(" %.1f | %.1fx |\n", mc * 1e6, mc / mg);
        } else {
            printf(" - | - |\n");
        }
        fflush(stdout);
    }
    ts_delete(c, "zc.curve", NULL);
    bench_free(buf);
}

/* ---------------------------------------------------------------------------------------------
 * put: a shared-buffer put against memcpy
 */

static void case_put(ts_client_t *c)
{
    size_t size = PUT_SIZE;
    void *src = bench_alloc(size), *warm = bench_alloc(size);
    if (src == NULL || warm == NULL)
        die("allocation", TS_ENOMEM);
    bench_fill(src, size, 0, 2);
    memcpy(warm, src, size);
    ts_value_t *v = tensor_over(src, size);
    double mw[MAX_REPEATS], mf[MAX_REPEATS], sp[MAX_REPEATS], sc[MAX_REPEATS], tp[MAX_REPEATS];
    const int iters = 10;
    for (int r = 0; r < g.repeats; r++) {
        for (int pass = 0; pass < 2; pass++) {
            int ref_first = r & 1;
            if (pass == ref_first) {
                double s[16], s2[16];
                for (int i = 0; i < iters; i++) {
                    double t0 = bench_now();
                    memcpy(warm, src, size);
                    double t1 = bench_now();
                    void *fresh = mmap(NULL, size, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                    if (fresh == MAP_FAILED)
                        die("mmap", TS_ENOMEM);
                    double t2 = bench_now();
                    memcpy(fresh, src, size);
                    double t3 = bench_now();
                    munmap(fresh, size);
                    s[i] = t1 - t0;
                    s2[i] = t3 - t2;
                }
                mw[r] = bench_median(s, iters);
                mf[r] = bench_median(s2, iters);
            } else {
                double s[16], s2[16], s3[16];
                for (int i = 0; i < iters; i++) {
                    double t0 = bench_now();
                    ts_shared_t *sh = shared_tensor(size, src);
                    double t1 = bench_now();
                    int rc = ts_shared_put(c, "zc.put", sh, NULL);
                    double t2 = bench_now();
                    ts_shared_free(sh);
                    if (rc != 0)
                        die("ts_shared_put", rc);
                    double t3 = bench_now();
                    rc = ts_put(c, "zc.put", v, NULL);
                    double t4 = bench_now();
                    if (rc != 0)
                        die("ts_put", rc);
                    s[i] = t2 - t0;
                    s2[i] = t2 - t1;
                    s3[i] = t4 - t3;
                }
                sp[r] = bench_median(s, iters);
                sc[r] = bench_median(s2, iters);
                tp[r] = bench_median(s3, iters);
            }
        }
    }
    double n = (double)g.repeats;
    double w = bench_median(mw, (size_t)n), f = bench_median(mf, (size_t)n);
    double s = bench_median(sp, (size_t)n), cm = bench_median(sc, (size_t)n);
    double t = bench_median(tp, (size_t)n);
    double gb = (double)size / 1e9;
    printf("\n#### Put of 64 MiB on one host (median per put; GB/s = 64 MiB / time)\n\n");
    printf("| path | ms | GB/s | vs memcpy (warm) | vs memcpy (fresh) |\n|---|---|---|---|---|\n");
    printf("| memcpy into warm memory (ceiling) | %.2f | %.2f | 1.00 | %.2f |\n", w * 1e3, gb / w,
           f / w);
    printf("| memcpy into fresh memory (ceiling) | %.2f | %.2f | %.2f | 1.00 |\n", f * 1e3, gb / f,
           w / f);
    printf("| shared buffer: new + fill + put | %.2f | %.2f | %.2f | %.2f |\n", s * 1e3, gb / s,
           w / s, f / s);
    printf("| shared buffer: the put (commit) alone | %.3f | - | - | - |\n", cm * 1e3);
    printf("| ts_put through the unix socket | %.2f | %.2f | %.2f | %.2f |\n", t * 1e3, gb / t,
           w / t, f / t);
    ts_delete(c, "zc.put", NULL);
    ts_value_free(v);
    bench_free(src);
    bench_free(warm);
}

/* ---------------------------------------------------------------------------------------------
 * pss: readers sharing one item
 */

/* A field of /proc/<pid>/smaps_rollup (pid 0: self) or /proc/meminfo (pid -1), in bytes. */
static long long proc_kb_field(pid_t pid, const char *field)
{
    char path[64], line[256];
    if (pid < 0)
        snprintf(path, sizeof(path), "/proc/meminfo");
    else if (pid == 0)
        snprintf(path, sizeof(path), "/proc/self/smaps_rollup");
    else
        snprintf(path, sizeof(path), "/proc/%d/smaps_rollup", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    size_t flen = strlen(field);
    long long v = -1;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, field, flen) == 0 && line[flen] == ':') {
            v = strtoll(line + flen + 1, NULL, 10) * 1024;
            break;
        }
    }
    fclose(f);
    return v;
}

/* A reader: map the item, read every page, report, wait for the parent's go, exit. */
static void reader_main(int wfd, int rfd)
{
    ts_client_t *c = client_open();
    long long before = proc_kb_field(0, "Pss");
    ts_items_t *it = NULL;
    int rc = ts_peek_ref(c, "zc.pss", 1, &it);
    if (rc != 0)
        die("reader ts_peek_ref", rc);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(it, 0));
    const volatile uint8_t *p = t->data;
    size_t len = ts_tensor_nbytes(t);
    unsigned sum = 0;
    for (size_t off = 0; off < len; off += PAGE)
        sum += p[off];
    long long after = proc_kb_field(0, "Pss");
    long long msg[3] = {before, after, (long long)sum};
    if (write(wfd, msg, sizeof(msg)) != (ssize_t)sizeof(msg))
        _exit(2);
    char go;
    if (read(rfd, &go, 1) != 1)
        _exit(3);
    ts_items_free(it);
    ts_client_free(c);
    _exit(0);
}

static void case_pss(ts_client_t *c)
{
    shared_put(c, "zc.pss", PSS_SIZE, NULL);
    long long d_before = proc_kb_field(g.pid, "Pss");
    long long sh_before = proc_kb_field(-1, "Shmem"), an_before = proc_kb_field(-1, "AnonPages");
    int up[2], down[2];
    if (pipe(up) != 0 || pipe(down) != 0)
        die("pipe", TS_ENOMEM);
    pid_t kids[MAX_READERS];
    int n = g.readers;
    fflush(stdout);
    for (int i = 0; i < n; i++) {
        kids[i] = fork();
        if (kids[i] == 0) {
            close(up[0]);
            close(down[1]);
            reader_main(up[1], down[0]);
        }
        if (kids[i] < 0)
            die("fork", TS_ENOMEM);
    }
    close(up[1]);
    close(down[0]);
    long long r_grow = 0, r_pss = 0;
    int got = 0;
    for (; got < n; got++) {
        long long msg[3];
        if (bench_read_all(up[0], msg, sizeof(msg)) != 0)
            break;
        r_grow += msg[1] - msg[0];
        r_pss += msg[1];
    }
    long long d_after = proc_kb_field(g.pid, "Pss");
    long long sh_after = proc_kb_field(-1, "Shmem"), an_after = proc_kb_field(-1, "AnonPages");
    close(down[1]); /* every reader reads end of file: its go */
    for (int i = 0; i < n; i++) {
        int st;
        waitpid(kids[i], &st, 0);
    }
    close(up[0]);
    ts_delete(c, "zc.pss", NULL);
    if (got < n) {
        fprintf(stderr, "zc_bench: only %d of %d readers reported\n", got, n);
        return;
    }
    double gib = (double)(1u << 30);
    printf("\n#### %d reader processes mapping one 1 GiB item by reference (GiB)\n\n", n);
    printf("| what | GiB |\n|---|---|\n");
    printf("| PSS added by the readers (sum) | %.3f |\n", (double)r_grow / gib);
    printf("| tensord's PSS before / after | %.3f / %.3f |\n", (double)d_before / gib,
           (double)d_after / gib);
    printf("| readers + tensord PSS after (all holders of the item) | %.3f |\n",
           (double)(r_pss + d_after) / gib);
    printf("| machine's Shmem + AnonPages growth while mapped | %.3f |\n",
           (double)((sh_after - sh_before) + (an_after - an_before)) / gib);
}

/* ---------------------------------------------------------------------------------------------
 * drop: what a large release costs everybody else
 */

#define DROP_PING_GAP_US 200   /* us between PINGs */
#define DROP_SETTLE_US   50000 /* us of PINGs before and after the DELETE */

static struct {
    pthread_t thr;
    atomic_int stop;
    double worst;
    int rc;
} dp;

static void *drop_pinger(void *arg)
{
    ts_client_t *pc = arg;
    bench_pin_self(1);
    while (!atomic_load(&dp.stop)) {
        double t0 = bench_now();
        int rc = ts_ping(pc);
        double d = bench_now() - t0;
        if (rc != 0) {
            dp.rc = rc;
            break;
        }
        if (d > dp.worst)
            dp.worst = d;
        usleep(DROP_PING_GAP_US);
    }
    return NULL;
}

/* One DELETE of a PSS_SIZE shared item on a fresh tensord; the worst PING and the DELETE's time. */
static void drop_once(int reclaim_off, double *worst_s, double *delete_s)
{
    if (g.pid > 0)
        bench_stop(g.pid);
    g.pid = -1;
    setenv("TSD_RECLAIM_OFF", reclaim_off ? "1" : "0", 1);
    int rc = start_tensord();
    unsetenv("TSD_RECLAIM_OFF");
    if (rc != 0)
        exit(1);
    ts_client_t *c = client_open();
    ts_client_t *pc = client_open();
    shared_put(c, "zc.drop", PSS_SIZE, NULL);
    dp.worst = 0;
    dp.rc = 0;
    atomic_store(&dp.stop, 0);
    if (pthread_create(&dp.thr, NULL, drop_pinger, pc) != 0)
        die("pthread_create", TS_ENOMEM);
    usleep(DROP_SETTLE_US);
    double t0 = bench_now();
    rc = ts_delete(c, "zc.drop", NULL);
    double t1 = bench_now();
    usleep(DROP_SETTLE_US);
    atomic_store(&dp.stop, 1);
    pthread_join(dp.thr, NULL);
    if (rc != 0)
        die("ts_delete", rc);
    if (dp.rc != 0)
        die("ts_ping", dp.rc);
    *worst_s = dp.worst;
    *delete_s = t1 - t0;
    ts_client_free(pc);
    ts_client_free(c);
}

static void case_drop(void)
{
    double wo[MAX_REPEATS], wr[MAX_REPEATS], dl[MAX_REPEATS], dr[MAX_REPEATS];
    for (int r = 0; r < g.repeats; r++) {
        int first_off = r & 1; /* the reference first on odd repeats */
        for (int k = 0; k < 2; k++) {
            int off = k == 0 ? first_off : !first_off;
            if (off)
                drop_once(1, &wo[r], &dl[r]);
            else
                drop_once(0, &wr[r], &dr[r]);
        }
    }
    double mo = bench_median(wo, (size_t)g.repeats), mr = bench_median(wr, (size_t)g.repeats);
    printf("\n#### DELETE of a %zu MiB shared item while another connection PINGs (median ms)\n\n",
           PSS_SIZE / MIB);
    printf("| release | worst PING | DELETE |\n|---|---|---|\n");
    printf("| on the loop thread (TSD_RECLAIM_OFF=1, reference) | %.2f | %.2f |\n", mo * 1e3,
           bench_median(dl, (size_t)g.repeats) * 1e3);
    printf("| on the reclaim thread (default) | %.2f | %.2f |\n", mr * 1e3,
           bench_median(dr, (size_t)g.repeats) * 1e3);
    printf("\nworst PING, reference / default: %.1fx\n", mo / mr);
    fflush(stdout);
}

/* ---------------------------------------------------------------------------------------------
 * Driver
 */

static void usage(void)
{
    fprintf(stderr, "usage: zc_bench [--repeats N] [--max-mib M] [--readers R] "
                    "[--skip curve,put,pss,drop] [--no-pin] [--tensord PATH]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    g.tensord = getenv("TS_TENSORD") != NULL ? getenv("TS_TENSORD") : TS_TENSORD_PATH;
    g.repeats = 5;
    g.max_mib = 1024;
    g.readers = 8;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--repeats") == 0 && v != NULL) {
            g.repeats = (int)strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--max-mib") == 0 && v != NULL) {
            g.max_mib = (size_t)strtoull(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--readers") == 0 && v != NULL) {
            g.readers = (int)strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--tensord") == 0 && v != NULL) {
            g.tensord = v;
            i++;
        } else if (strcmp(a, "--skip") == 0 && v != NULL) {
            g.skip_curve = strstr(v, "curve") != NULL;
            g.skip_put = strstr(v, "put") != NULL;
            g.skip_pss = strstr(v, "pss") != NULL;
            g.skip_drop = strstr(v, "drop") != NULL;
            i++;
        } else if (strcmp(a, "--no-pin") == 0) {
            bench_set_pinning(0);
        } else {
            usage();
        }
    }
    if (g.repeats < 3 || g.repeats > MAX_REPEATS || g.max_mib < 1 || g.readers < 1 ||
        g.readers > MAX_READERS)
        usage();
    snprintf(g.dir, sizeof(g.dir), "/tmp/zc_bench.XXXXXX");
    if (mkdtemp(g.dir) == NULL) {
        perror("zc_bench: mkdtemp");
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    if (start_tensord() != 0)
        return 1;
    bench_pin_self(1);
    ts_client_t *c = client_open();
    printf("zc_bench: tensord pinned to cpu0, client to cpu1; %d repeats, medians\n", g.repeats);
    if (!g.skip_curve)
        case_curve(c);
    if (!g.skip_put)
        case_put(c);
    if (!g.skip_pss)
        case_pss(c);
    ts_client_free(c);
    if (!g.skip_drop)
        case_drop(); /* starts tensords of its own */
    if (g.pid > 0)
        bench_stop(g.pid);
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g.dir);
    if (system(cmd) != 0)
        fprintf(stderr, "zc_bench: could not remove %s\n", g.dir);
    return 0;
}
