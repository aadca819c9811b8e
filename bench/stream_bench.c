/*
 * stream_bench: streams (include/tensorshare/stream.h) measured against what they replace, in
 * one run, and printed as the "Streams" table of docs/PERFORMANCE.md.
 *
 *   stream_bench [--smoke] [--repeats N] [--tensord PATH] [--redis PATH | --no-redis]
 *                [--no-pin] [--unix] [--batches N] [--passes N] [--skip share,fail,latency]
 *                [--raw]
 *
 * share    One producer making 1 MiB image batches (examples/stream_images.h: decode and augment,
 *          about 7 ms of CPU each) feeding four consumer processes through a stream, against
 *          four independent loaders (four processes each making every batch themselves, no
 *          daemon): each consumer's batches/s, and the CPU of all processes (tensord included)
 *          per batch delivered. Every consumer checks every row's hash and that entries come
 *          exactly once and in order. The same with a producer doing no work (the transport
 *          rate of 1 MiB entries to four consumers) against ts_put + ts_get of 1 MiB.
 * fail     The same with one consumer killed (SIGKILL), one stopped for 2 s (SIGSTOP, SIGCONT)
 *          and one joining late: the longest wait between two batches of the others against the
 *          lease, and whether the stopped one went on where it was.
 * latency  64 B records from an append to a consumer blocked in ts_stream_read, paced 1 per ms,
 *          against Redis Streams (XADD to a reader blocked in XREAD BLOCK).
 *
 * tensord (and redis-server) run pinned to cpu0, every client process and thread to cpu1 (when
 * the machine has two CPUs and --no-pin is not given). Each case runs the systems alternately,
 * the table shows medians over the repeats. --smoke runs tiny counts once and fails when a
 * transfer or a check fails; it asserts no timing. Processes are forked before any client is
 * opened in them; the parent opens clients only between runs, with no child alive.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../examples/stream_images.h"
#include "tensorshare/stream.h"
#include "tensorshare/tensorshare.h"

#ifndef TS_TENSORD_PATH
#define TS_TENSORD_PATH "tensord"
#endif

#define MAX_REPEATS    15
#define N_CONSUMERS    4     /* consumers of the stream, and independent loaders */
#define BATCH_ROWS     32    /* rows per batch: 32 x 3 x 52 x 52 float32 = 0.99 MiB */
#define SHARE_WINDOW   32    /* entries a live consumer may be behind (credits) */
#define SHARE_KEEP     64    /* entries kept when every consumer is live all along */
#define FAIL_LEASE_MS  1000  /* ms; the lease in the failure scenario */
#define FAIL_PAUSE_MS  2000  /* ms; how long one consumer is stopped */
#define NEXT_WAIT_MS   1000  /* ms; one ts_stream_consumer_next wait */
#define RUN_DEADLINE_S 300.0 /* s; a run's children are killed after this */
#define LAT_RECORD     64    /* bytes of the latency case's float32 record */
#define LAT_PERIOD_US  1000  /* us between two appends of the latency case */
#define LAT_MAX        20000 /* latency samples per run at most */
#define RBUF           65536 /* bytes; the RESP client's read buffer */

static struct {
    int smoke, repeats, raw, use_unix;
    long batches, passes;
    const char *tensord, *redis, *skip;
    char dir[128];
    int failures;
    int seq; /* a new stream name per run */
} g = {.repeats = 5, .batches = 0, .passes = IMG_DECODE_PASSES};

typedef struct server {
    pid_t pid;
    bench_target t;
} server;

static void fail_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail_note(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "stream_bench: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    g.failures++;
}

static int skipped(const char *name)
{
    return g.skip != NULL && strstr(g.skip, name) != NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Servers
 */

static int start_tensord(server *s)
{
    s->pid = bench_start_tensord("stream_bench", g.tensord, g.dir, "tensord", 1, &s->t);
    return s->pid > 0 ? 0 : -1;
}

static int start_redis(server *s)
{
    s->pid = -1;
    if (g.redis == NULL)
        return -1;
    s->pid = bench_start_redis("stream_bench", g.redis, g.dir, "redis", 1, &s->t);
    return s->pid > 0 ? 0 : -1;
}

static void address_of(const server *s, char *buf, size_t cap)
{
    if (g.use_unix)
        snprintf(buf, cap, "unix:%s", s->t.unix_path);
    else
        snprintf(buf, cap, "127.0.0.1:%d", s->t.port);
}

static ts_client_t *open_client(const char *addr)
{
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 120000;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, &o);
    if (rc != 0) {
        fprintf(stderr, "stream_bench: connecting to %s: %s\n", addr, ts_last_error());
        return NULL;
    }
    return c;
}

/* ---------------------------------------------------------------------------------------------
 * Child processes: what each one reports, in memory shared with the parent
 */

enum role { ROLE_PRODUCER, ROLE_CONSUMER, ROLE_LOADER };

typedef struct slot {
    _Atomic uint64_t batches; /* batches so far (the parent watches it) */
    _Atomic int ready;        /* joined (consumers) or connected; waiting for the start */
    int done;                 /* finished and reported */
    int errors;               /* check failures: order, hash, missing */
    uint64_t first_id, last_id;
    double t_last;   /* monotonic s of the last batch */
    double max_gap;  /* s; the longest time between two consecutive batches */
    uint64_t gap_id; /* the id that ended the longest gap */
    double cpu;      /* s of CPU (user + system) from the start to the end */
    uint64_t waits;  /* producer: pushes that waited for credit */
    uint64_t lost;   /* consumer: entries its group lost to the window */
    char err[160];
} slot;

/* What a run's children do. */
typedef struct run_cfg {
    char addr[300];
    char stream[64];
    long batches;
    int work;       /* the producer (or loaders) make real batches; else the producer resends */
    int check_rows; /* consumers hash every row */
} run_cfg;

static slot *slots_new(int n)
{
    void *p = mmap(NULL, sizeof(slot) * (size_t)n, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void slots_free(slot *s, int n)
{
    if (s != NULL)
        munmap(s, sizeof(slot) * (size_t)n);
}

static void slot_err(slot *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void slot_err(slot *s, const char *fmt, ...)
{
    s->errors++;
    if (s->err[0] != '\0')
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err, sizeof(s->err), fmt, ap);
    va_end(ap);
}

/* Block until the parent closes the write end of the start pipe. */
static void wait_start(int fd)
{
    char ch;
    while (read(fd, &ch, 1) < 0 && errno == EINTR)
        ;
}

/* The batch buffers of a producer or loader, and the record over them. */
typedef struct batch {
    float *image;
    int64_t label[BATCH_ROWS], index[BATCH_ROWS], epoch[BATCH_ROWS], hash[BATCH_ROWS];
    uint8_t *src, *tmp;
    ts_value_t *record;
} batch;

static int batch_init(batch *b)
{
    memset(b, 0, sizeof(*b));
    b->image = bench_alloc((size_t)BATCH_ROWS * IMG_ROW_FLOATS * sizeof(float));
    b->src = bench_alloc(IMG_SRC_BYTES);
    b->tmp = bench_alloc(IMG_SRC_BYTES);
    b->record = ts_map_new();
    if (b->image == NULL || b->src == NULL || b->tmp == NULL || b->record == NULL)
        return -1;
    const int64_t ishape[4] = {BATCH_ROWS, IMG_CHANNELS, IMG_CROP, IMG_CROP};
    const int64_t vshape[1] = {BATCH_ROWS};
    if (ts_map_set(b->record, "image", ts_tensor_new(TS_FLOAT32, 4, ishape, b->image, TS_BORROW)) ||
        ts_map_set(b->record, "label", ts_tensor_new(TS_INT64, 1, vshape, b->label, TS_BORROW)) ||
        ts_map_set(b->record, "index", ts_tensor_new(TS_INT64, 1, vshape, b->index, TS_BORROW)) ||
        ts_map_set(b->record, "epoch", ts_tensor_new(TS_INT64, 1, vshape, b->epoch, TS_BORROW)) ||
        ts_map_set(b->record, "hash", ts_tensor_new(TS_INT64, 1, vshape, b->hash, TS_BORROW)))
        return -1;
    return 0;
}

static void batch_free(batch *b)
{
    ts_value_free(b->record);
    bench_free(b->image);
    bench_free(b->src);
    bench_free(b->tmp);
}

/* Make batch k (rows k*32..): the real work, or (work == 0) only its index column changes. */
static void batch_make(batch *b, long k, int work)
{
    uint64_t first = (uint64_t)k * BATCH_ROWS;
    if (work) {
        img_make_batch(b->image, b->label, b->index, b->epoch, b->hash, BATCH_ROWS, 0, first,
                       (int)g.passes, b->src, b->tmp);
        return;
    }
    for (int r = 0; r < BATCH_ROWS; r++) {
        b->index[r] = (int64_t)(first + (uint64_t)r);
        b->label[r] = (int64_t)((first + (uint64_t)r) % IMG_CLASSES);
    }
}

/*
 * Check a batch as a training process would before using it: every row's image hashes to its
 * "hash" (when check_rows), and its first index is the one entry id follows from. 0 or -1.
 */
static int batch_check(const float *image, const int64_t *index, const int64_t *hash, int64_t rows,
                       uint64_t id, int check_rows)
{
    if (rows != BATCH_ROWS || index[0] != (int64_t)((id - 1) * BATCH_ROWS))
        return -1;
    if (check_rows)
        for (int64_t r = 0; r < rows; r++)
            if ((int64_t)img_row_hash(image + (size_t)r * IMG_ROW_FLOATS, IMG_ROW_FLOATS) !=
                hash[r])
                return -1;
    return 0;
}

static void note_batch(slot *s, uint64_t id, double *t_prev)
{
    double t = bench_now();
    if (*t_prev > 0 && t - *t_prev > s->max_gap) {
        s->max_gap = t - *t_prev;
        s->gap_id = id;
    }
    *t_prev = t;
    s->t_last = t;
    atomic_fetch_add(&s->batches, 1);
}

static int child_producer(const run_cfg *cfg, slot *s, int start_fd)
{
    batch b;
    ts_client_t *c = open_client(cfg->addr);
    ts_stream_producer_t *p = NULL;
    if (c == NULL || batch_init(&b) != 0 ||
        ts_stream_producer_open(&p, c, cfg->stream, NULL, TS_TIMEOUT_INFINITE) != 0) {
        slot_err(s, "producer: %s", ts_last_error());
        atomic_store(&s->ready, 1);
        return 1;
    }
    /* The no-work producer resends one real batch: the transport's ceiling. */
    if (!cfg->work)
        img_make_batch(b.image, b.label, b.index, b.epoch, b.hash, BATCH_ROWS, 0, 0, 0, b.src,
                       b.tmp);
    atomic_store(&s->ready, 1);
    wait_start(start_fd);
    double c0 = bench_cpu_self(), t_prev = 0;
    for (long k = 0; k < cfg->batches; k++) {
        batch_make(&b, k, cfg->work);
        uint64_t id = 0;
        if (ts_stream_producer_push(p, b.record, &id) != 0) {
            slot_err(s, "producer: push %ld: %s", k, ts_last_error());
            break;
        }
        if (s->first_id == 0)
            s->first_id = id;
        s->last_id = id;
        note_batch(s, id, &t_prev);
    }
    if (ts_stream_producer_end_epoch(p, 0, NULL) != 0)
        slot_err(s, "producer: end of epoch: %s", ts_last_error());
    s->waits = ts_stream_producer_waits(p);
    s->cpu = bench_cpu_self() - c0;
    ts_stream_producer_free(p);
    ts_client_free(c);
    batch_free(&b);
    s->done = 1;
    return s->errors ? 1 : 0;
}

/*
 * A consumer: join group name (fan-out: its own group), wait for the start (and, when late_fd
 * >= 0, for the parent's word before joining), then read until the end marker, checking order
 * and rows.
 */
static int child_consumer(const run_cfg *cfg, slot *s, const char *group, int start_fd, int late_fd)
{
    ts_client_t *c = open_client(cfg->addr);
    if (c == NULL) {
        slot_err(s, "consumer %s: no connection", group);
        atomic_store(&s->ready, 1);
        return 1;
    }
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    o.start = TS_STREAM_OLDEST;
    o.timeout_ms = NEXT_WAIT_MS;
    ts_stream_consumer_t *sc = NULL;
    if (late_fd < 0 && ts_stream_consumer_open(&sc, c, cfg->stream, group, group, &o) != 0) {
        slot_err(s, "consumer %s: join: %s", group, ts_last_error());
        atomic_store(&s->ready, 1);
        ts_client_free(c);
        return 1;
    }
    atomic_store(&s->ready, 1);
    wait_start(start_fd);
    double c0 = bench_cpu_self();
    if (late_fd >= 0) {
        wait_start(late_fd);
        if (ts_stream_consumer_open(&sc, c, cfg->stream, group, group, &o) != 0) {
            slot_err(s, "consumer %s: late join: %s", group, ts_last_error());
            ts_client_free(c);
            return 1;
        }
    }
    double t_prev = 0, deadline = bench_now() + RUN_DEADLINE_S;
    uint64_t expect = 0;
    for (;;) {
        ts_value_t *v = NULL;
        ts_stream_item_t info;
        int rc = ts_stream_consumer_next(sc, &v, &info);
        if (rc == TS_ETIMEDOUT && bench_now() < deadline)
            continue;
        if (rc != 0) {
            slot_err(s, "consumer %s: next: %s", group, ts_last_error());
            break;
        }
        if (info.end_of_epoch)
            break;
        uint64_t id = info.first_id;
        const ts_tensor_t *img = ts_map_get_tensor(v, "image");
        const ts_tensor_t *ix = ts_map_get_tensor(v, "index");
        const ts_tensor_t *h = ts_map_get_tensor(v, "hash");
        if (expect != 0 && id != expect)
            slot_err(s, "consumer %s: id %" PRIu64 " after %" PRIu64, group, id, expect - 1);
        else if (info.last_id != id || img == NULL || ix == NULL || h == NULL ||
                 batch_check(img->data, ix->data, h->data, img->shape[0], id, cfg->check_rows))
            slot_err(s, "consumer %s: entry %" PRIu64 " failed its check", group, id);
        ts_value_free(v);
        if (s->first_id == 0)
            s->first_id = id;
        s->last_id = id;
        s->lost = info.lost;
        expect = id + 1;
        note_batch(s, id, &t_prev);
    }
    s->cpu = bench_cpu_self() - c0;
    ts_stream_consumer_close(sc, 1);
    ts_client_free(c);
    if (s->errors == 0 && (uint64_t)atomic_load(&s->batches) != (uint64_t)cfg->batches)
        slot_err(s, "consumer %s: %" PRIu64 " of %ld batches", group,
                 (uint64_t)atomic_load(&s->batches), cfg->batches);
    s->done = 1;
    return s->errors ? 1 : 0;
}

/* An independent loader: makes every batch itself and checks it as a consumer would. */
static int child_loader(const run_cfg *cfg, slot *s, int start_fd)
{
    batch b;
    if (batch_init(&b) != 0) {
        slot_err(s, "loader: out of memory");
        atomic_store(&s->ready, 1);
        return 1;
    }
    atomic_store(&s->ready, 1);
    wait_start(start_fd);
    double c0 = bench_cpu_self(), t_prev = 0;
    for (long k = 0; k < cfg->batches; k++) {
        batch_make(&b, k, 1);
        if (batch_check(b.image, b.index, b.hash, BATCH_ROWS, (uint64_t)k + 1, cfg->check_rows))
            slot_err(s, "loader: batch %ld failed its check", k);
        note_batch(s, (uint64_t)k + 1, &t_prev);
    }
    s->cpu = bench_cpu_self() - c0;
    batch_free(&b);
    s->done = 1;
    return s->errors ? 1 : 0;
}

/* A set of children of one run. */
typedef struct run {
    int n;
    pid_t pid[N_CONSUMERS + 2];
    slot *s;
    int start[2]; /* closing start[1] starts everyone */
    int late[2];  /* closing late[1] lets the late consumer join */
    double t_start;
    double tsd_cpu0;
} run;

static int run_spawn(run *r, const run_cfg *cfg, int idx, enum role role, const char *group,
                     int late)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* Only the parent holds the write ends: closing them is its start signal. */
        close(r->start[1]);
        close(r->late[1]);
        int rc = role == ROLE_PRODUCER ? child_producer(cfg, &r->s[idx], r->start[0])
                 : role == ROLE_LOADER
                     ? child_loader(cfg, &r->s[idx], r->start[0])
                     : child_consumer(cfg, &r->s[idx], group, r->start[0], late ? r->late[0] : -1);
        fflush(NULL);
        _exit(rc);
    }
    r->pid[idx] = pid;
    return 0;
}

static int run_init(run *r, int n)
{
    memset(r, 0, sizeof(*r));
    r->n = n;
    r->s = slots_new(n);
    if (r->s == NULL || pipe(r->start) != 0 || pipe(r->late) != 0)
        return -1;
    return 0;
}

/* Wait (bounded) until every child is ready, then start them all. 0 or -1. */
static int run_start(run *r, pid_t tsd)
{
    double end = bench_now() + 60;
    for (int i = 0; i < r->n; i++)
        while (!atomic_load(&r->s[i].ready)) {
            if (bench_now() > end)
                return -1;
            usleep(1000);
        }
    r->tsd_cpu0 = tsd > 0 ? bench_cpu_pid(tsd) : 0;
    r->t_start = bench_now();
    close(r->start[1]);
    r->start[1] = -1;
    return 0;
}

/* Reap every child (killing what is left after the deadline). Returns the failed count. */
static int run_wait(run *r)
{
    int failed = 0;
    double end = bench_now() + RUN_DEADLINE_S;
    for (int i = 0; i < r->n; i++) {
        if (r->pid[i] <= 0)
            continue;
        int st = 0;
        while (waitpid(r->pid[i], &st, WNOHANG) == 0) {
            if (bench_now() > end) {
                kill(r->pid[i], SIGKILL);
                waitpid(r->pid[i], &st, 0);
                fprintf(stderr, "stream_bench: a child ran past the deadline\n");
                break;
            }
            usleep(2000);
        }
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            failed++;
        r->pid[i] = 0;
    }
    return failed;
}

static void run_free(run *r)
{
    for (int i = 0; i < r->n; i++)
        if (r->pid[i] > 0) {
            kill(r->pid[i], SIGKILL);
            waitpid(r->pid[i], NULL, 0);
        }
    if (r->start[1] > 0)
        close(r->start[1]);
    if (r->start[0] > 0)
        close(r->start[0]);
    if (r->late[0] > 0)
        close(r->late[0]);
    if (r->late[1] > 0)
        close(r->late[1]);
    slots_free(r->s, r->n);
}

/* Create (or delete, when cfg is NULL) a stream through a short-lived client. 0 or -1. */
static int stream_admin(const char *addr, const char *name, const ts_stream_config_t *cfg)
{
    ts_client_t *c = open_client(addr);
    if (c == NULL)
        return -1;
    int rc = cfg != NULL ? ts_stream_create(c, name, cfg, NULL) : ts_delete(c, name, NULL);
    if (rc != 0)
        fprintf(stderr, "stream_bench: %s '%s': %s\n", cfg ? "create" : "delete", name,
                ts_last_error());
    ts_client_free(c);
    return rc == 0 ? 0 : -1;
}

/* ---------------------------------------------------------------------------------------------
 * Case share: one producer, four consumers, against four loaders and put+get
 */

typedef struct share_res {
    int ok;
    double rate;      /* batches/s per consumer (loader), the mean */
    double rate_min;  /* the slowest one's */
    double cpu_batch; /* s of CPU of every process per batch delivered */
    double cpu_prod;  /* s per batch produced: the producer's, tensord's, one consumer's */
    double cpu_tsd;
    double cpu_cons;
    uint64_t waits;
} share_res;

static share_res share_stream(const server *ts, int work)
{
    share_res res = {0};
    run_cfg cfg = {.batches = g.batches, .work = work, .check_rows = work};
    address_of(ts, cfg.addr, sizeof(cfg.addr));
    snprintf(cfg.stream, sizeof(cfg.stream), "share%d", ++g.seq);
    ts_stream_config_t sc;
    ts_stream_config_init(&sc);
    sc.max_entries = SHARE_KEEP;
    sc.window = SHARE_WINDOW;
    if (stream_admin(cfg.addr, cfg.stream, &sc) != 0)
        return res;
    run r;
    if (run_init(&r, N_CONSUMERS + 1) != 0) {
        run_free(&r);
        return res;
    }
    int bad = 0;
    for (int i = 0; i < N_CONSUMERS && !bad; i++) {
        char group[16];
        snprintf(group, sizeof(group), "c%d", i);
        bad = run_spawn(&r, &cfg, i, ROLE_CONSUMER, group, 0) != 0;
    }
    bad = bad || run_spawn(&r, &cfg, N_CONSUMERS, ROLE_PRODUCER, NULL, 0) != 0;
    bad = bad || run_start(&r, ts->pid) != 0;
    int failed = run_wait(&r);
    double tsd_cpu = bench_cpu_pid(ts->pid) - r.tsd_cpu0;
    if (!bad && failed == 0) {
        double sum = 0, mn = INFINITY, cpu = r.s[N_CONSUMERS].cpu + tsd_cpu;
        for (int i = 0; i < N_CONSUMERS; i++) {
            double rate = (double)g.batches / (r.s[i].t_last - r.t_start);
            sum += rate;
            mn = rate < mn ? rate : mn;
            cpu += r.s[i].cpu;
        }
        res.ok = 1;
        res.rate = sum / N_CONSUMERS;
        res.rate_min = mn;
        res.cpu_batch = cpu / ((double)g.batches * N_CONSUMERS);
        res.cpu_prod = r.s[N_CONSUMERS].cpu / (double)g.batches;
        res.cpu_tsd = tsd_cpu / (double)g.batches;
        res.cpu_cons = r.s[0].cpu / (double)g.batches;
        res.waits = r.s[N_CONSUMERS].waits;
    } else {
        for (int i = 0; i < r.n; i++)
            if (r.s[i].err[0] != '\0')
                fprintf(stderr, "stream_bench: %s\n", r.s[i].err);
    }
    run_free(&r);
    stream_admin(cfg.addr, cfg.stream, NULL);
    return res;
}

static share_res share_loaders(void)
{
    share_res res = {0};
    run_cfg cfg = {.batches = g.batches, .work = 1, .check_rows = 1};
    run r;
    if (run_init(&r, N_CONSUMERS) != 0) {
        run_free(&r);
        return res;
    }
    int bad = 0;
    for (int i = 0; i < N_CONSUMERS && !bad; i++)
        bad = run_spawn(&r, &cfg, i, ROLE_LOADER, NULL, 0) != 0;
    bad = bad || run_start(&r, 0) != 0;
    int failed = run_wait(&r);
    if (!bad && failed == 0) {
        double sum = 0, mn = INFINITY, cpu = 0;
        for (int i = 0; i < N_CONSUMERS; i++) {
            double rate = (double)g.batches / (r.s[i].t_last - r.t_start);
            sum += rate;
            mn = rate < mn ? rate : mn;
            cpu += r.s[i].cpu;
        }
        res.ok = 1;
        res.rate = sum / N_CONSUMERS;
        res.rate_min = mn;
        res.cpu_batch = cpu / ((double)g.batches * N_CONSUMERS);
    } else {
        for (int i = 0; i < r.n; i++)
            if (r.s[i].err[0] != '\0')
                fprintf(stderr, "stream_bench: %s\n", r.s[i].err);
    }
    run_free(&r);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Case fail: a consumer killed, one stopped, one late
 */

typedef struct fail_res {
    int ok;
    double stall_others;             /* s; the longest gap of the consumers that kept going */
    double pause_gap;                /* s; the stopped consumer's longest gap */
    uint64_t paused_at, paused_next; /* its id before the gap and after */
    uint64_t paused_batches;
    uint64_t killed_at;    /* batches the killed one had */
    uint64_t late_first;   /* the late consumer's first id */
    uint64_t late_batches; /* and its count */
    uint64_t late_at;      /* the producer's count when it joined */
    uint64_t total_ok;     /* consumers (of 3 that lived) with every batch, in order */
    int paused_ok;         /* the stopped one got every batch, in order, none twice */
} fail_res;

static void sleep_s(double s)
{
    uint64_t end = bench_now_ns() + (uint64_t)(s * 1e9);
    bench_sleep_until_ns(end);
}

/* Wait until slot s counts n batches (or the deadline). 0 or -1. */
static int wait_batches(const slot *s, uint64_t n, double deadline)
{
    while ((uint64_t)atomic_load(&((slot *)s)->batches) < n) {
        if (bench_now() > deadline)
            return -1;
        usleep(1000);
    }
    return 0;
}

static fail_res fail_case(const server *ts, int lease_ms, int pause_ms)
{
    fail_res res = {0};
    run_cfg cfg = {.batches = g.batches, .work = !g.smoke, .check_rows = !g.smoke};
    address_of(ts, cfg.addr, sizeof(cfg.addr));
    snprintf(cfg.stream, sizeof(cfg.stream), "fail%d", ++g.seq);
    ts_stream_config_t sc;
    ts_stream_config_init(&sc);
    /* Everything stays kept: the stopped and the late consumer must find all they missed. */
    sc.max_entries = (uint64_t)g.batches + 8;
    sc.window = SHARE_WINDOW;
    sc.lease_ms = (uint32_t)lease_ms;
    if (stream_admin(cfg.addr, cfg.stream, &sc) != 0)
        return res;
    run r;
    if (run_init(&r, N_CONSUMERS + 1) != 0) {
        run_free(&r);
        return res;
    }
    /* c0 keeps going, c1 is killed, c2 stopped for a while, c3 joins late. */
    const char *groups[N_CONSUMERS] = {"steady", "killed", "paused", "late"};
    int bad = 0;
    for (int i = 0; i < N_CONSUMERS && !bad; i++)
        bad = run_spawn(&r, &cfg, i, ROLE_CONSUMER, groups[i], i == 3) != 0;
    bad = bad || run_spawn(&r, &cfg, N_CONSUMERS, ROLE_PRODUCER, NULL, 0) != 0;
    bad = bad || run_start(&r, ts->pid) != 0;
    double deadline = bench_now() + RUN_DEADLINE_S;
    uint64_t n = (uint64_t)g.batches;
    if (!bad && wait_batches(&r.s[0], n / 5, deadline) == 0) {
        res.late_at = atomic_load(&r.s[N_CONSUMERS].batches);
    }
    /* Let the late consumer join (also when something failed, so that it ends). */
    close(r.late[1]);
    r.late[1] = -1;
    if (!bad && wait_batches(&r.s[0], n / 3, deadline) == 0) {
        res.killed_at = atomic_load(&r.s[1].batches);
        kill(r.pid[1], SIGKILL);
        waitpid(r.pid[1], NULL, 0);
        r.pid[1] = 0;
    }
    if (!bad && wait_batches(&r.s[0], n / 2, deadline) == 0) {
        kill(r.pid[2], SIGSTOP);
        sleep_s(pause_ms / 1000.0);
        kill(r.pid[2], SIGCONT);
    }
    int failed = run_wait(&r);
    if (!bad && failed == 0) {
        res.ok = 1;
        res.stall_others = fmax(r.s[0].max_gap, r.s[3].max_gap);
        res.pause_gap = r.s[2].max_gap;
        res.paused_next = r.s[2].gap_id;
        res.paused_at = r.s[2].gap_id - 1;
        res.paused_batches = atomic_load(&r.s[2].batches);
        res.paused_ok = r.s[2].errors == 0 && res.paused_batches == n;
        res.late_first = r.s[3].first_id;
        res.late_batches = atomic_load(&r.s[3].batches);
        for (int i = 0; i < N_CONSUMERS; i++)
            if (i != 1 && r.s[i].errors == 0 && atomic_load(&r.s[i].batches) == n)
                res.total_ok++;
    } else {
        for (int i = 0; i < r.n; i++)
            if (r.s[i].err[0] != '\0')
                fprintf(stderr, "stream_bench: %s\n", r.s[i].err);
    }
    run_free(&r);
    stream_admin(cfg.addr, cfg.stream, NULL);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Case latency: an append to a consumer blocked in a read; XADD to a reader blocked in XREAD
 */

typedef struct lat_job {
    const char *addr;      /* tensord */
    const bench_target *t; /* redis */
    const char *stream;
    int n;
    _Atomic uint64_t *t0;
    double *lat;
    int got;
    int ok;
    _Atomic int ready;
} lat_job;

static void *ts_reader(void *arg)
{
    lat_job *j = arg;
    bench_pin_self(1);
    ts_client_t *c = open_client(j->addr);
    if (c == NULL || ts_stream_join(c, j->stream, "g", "m", TS_STREAM_NEWEST, 0, NULL) != 0) {
        atomic_store(&j->ready, -1);
        ts_client_free(c);
        return NULL;
    }
    atomic_store(&j->ready, 1);
    uint64_t acked = 0;
    double end = bench_now() + 60;
    j->ok = 1;
    while (j->got < j->n && bench_now() < end) {
        ts_stream_batch_t *b = NULL;
        if (ts_stream_read(c, j->stream, "g", "m", acked, TS_STREAM_READ_MAX, 1000, &b) != 0) {
            j->ok = 0;
            break;
        }
        uint64_t now = bench_now_ns();
        size_t cnt = ts_stream_batch_count(b);
        for (size_t i = 0; i < cnt; i++) {
            uint64_t id = ts_stream_batch_id(b, i);
            if (id < 1 || id > (uint64_t)j->n || ts_stream_batch_value(b, i) == NULL) {
                j->ok = 0;
                continue;
            }
            j->lat[j->got++] = (double)(now - atomic_load(&j->t0[id - 1])) / 1e3;
            acked = id;
        }
        ts_stream_batch_free(b);
    }
    ts_client_free(c);
    return NULL;
}

static bench_result lat_stream(const char *addr, int n)
{
    bench_result res = {0};
    char name[64];
    snprintf(name, sizeof(name), "lat%d", ++g.seq);
    ts_stream_config_t sc;
    ts_stream_config_init(&sc);
    sc.max_entries = (uint64_t)n + 8;
    ts_client_t *c = open_client(addr);
    lat_job j = {.addr = addr, .stream = name, .n = n};
    j.t0 = calloc((size_t)n, sizeof(*j.t0));
    j.lat = calloc((size_t)n, sizeof(*j.lat));
    float rec[LAT_RECORD / sizeof(float)];
    bench_fill(rec, sizeof(rec), 0, 7);
    int64_t shape[1] = {(int64_t)(sizeof(rec) / sizeof(float))};
    ts_value_t *v = ts_tensor_new(TS_FLOAT32, 1, shape, rec, TS_BORROW);
    pthread_t th;
    int started = 0;
    if (c == NULL || j.t0 == NULL || j.lat == NULL || v == NULL ||
        ts_stream_create(c, name, &sc, NULL) != 0)
        goto out;
    if (pthread_create(&th, NULL, ts_reader, &j) != 0)
        goto out;
    started = 1;
    while (atomic_load(&j.ready) == 0)
        usleep(1000);
    if (atomic_load(&j.ready) < 0)
        goto out;
    uint64_t next = bench_now_ns();
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        next += (uint64_t)LAT_PERIOD_US * 1000u;
        bench_sleep_until_ns(next);
        atomic_store(&j.t0[i], bench_now_ns());
        ok = ts_stream_append(c, name, v, NULL) == 0;
    }
    pthread_join(th, NULL);
    started = 0;
    if (ok && j.ok && j.got == n) {
        res.ok = 1;
        res.value = bench_percentile(j.lat, (size_t)n, 50);
        res.value2 = bench_percentile(j.lat, (size_t)n, 99);
    }
out:
    if (started)
        pthread_join(th, NULL);
    if (c != NULL)
        ts_delete(c, name, NULL);
    ts_value_free(v);
    ts_client_free(c);
    free(j.t0);
    free(j.lat);
    return res;
}

/* A minimal RESP connection (the benchmark's own, as lean as bench_redis.c's). */
typedef struct rconn {
    int fd;
    uint8_t in[RBUF];
    size_t pos, len;
} rconn;

static int r_byte(rconn *r, uint8_t *ch)
{
    if (r->pos == r->len) {
        ssize_t k = read(r->fd, r->in, sizeof(r->in));
        if (k <= 0)
            return -1;
        r->pos = 0;
        r->len = (size_t)k;
    }
    *ch = r->in[r->pos++];
    return 0;
}

static int r_line(rconn *r, char *line, size_t cap)
{
    size_t n = 0;
    for (;;) {
        uint8_t ch;
        if (r_byte(r, &ch) != 0)
            return -1;
        if (ch == '\n') {
            if (n > 0 && line[n - 1] == '\r')
                n--;
            line[n] = '\0';
            return 0;
        }
        if (n + 1 >= cap)
            return -1;
        line[n++] = (char)ch;
    }
}

/*
 * Read one reply, dropping its contents; *bulks counts the bulk strings in it (nested arrays
 * included). Returns its type character, '0' for a nil array, or -1 (also for an error reply).
 */
static int r_reply(rconn *r, long *bulks)
{
    char line[128];
    if (r_line(r, line, sizeof(line)) != 0)
        return -1;
    long n = strtol(line + 1, NULL, 10);
    switch (line[0]) {
    case '+':
    case ':':
        return line[0];
    case '$':
        if (n >= 0) {
            (*bulks)++;
            for (long i = 0; i < n + 2; i++) {
                uint8_t ch;
                if (r_byte(r, &ch) != 0)
                    return -1;
            }
        }
        return '$';
    case '*':
        if (n < 0)
            return '0';
        for (long i = 0; i < n; i++)
            if (r_reply(r, bulks) < 0)
                return -1;
        return '*';
    default:
        fprintf(stderr, "stream_bench: redis: %s\n", line);
        return -1;
    }
}

/* Send a command of argc small arguments (binary-safe). 0 or -1. */
static int r_cmd(rconn *r, int argc, const char *const *argv, const size_t *lens)
{
    char buf[1024];
    size_t k = (size_t)snprintf(buf, sizeof(buf), "*%d\r\n", argc);
    for (int i = 0; i < argc; i++) {
        if (k + lens[i] + 32 > sizeof(buf))
            return -1;
        k += (size_t)snprintf(buf + k, sizeof(buf) - k, "$%zu\r\n", lens[i]);
        memcpy(buf + k, argv[i], lens[i]);
        k += lens[i];
        memcpy(buf + k, "\r\n", 2);
        k += 2;
    }
    return bench_write_all(r->fd, buf, k, 0);
}

static void *redis_reader(void *arg)
{
    lat_job *j = arg;
    bench_pin_self(1);
    rconn *r = calloc(1, sizeof(*r));
    if (r == NULL || (r->fd = bench_connect(j->t, g.use_unix)) < 0) {
        free(r);
        atomic_store(&j->ready, -1);
        return NULL;
    }
    atomic_store(&j->ready, 1);
    double end = bench_now() + 60;
    j->ok = 1;
    while (j->got < j->n && bench_now() < end) {
        /* Entries have the ids 0-1, 0-2, ...: read after the last one received. */
        char after[32];
        int al = snprintf(after, sizeof(after), "0-%d", j->got);
        const char *argv[6] = {"XREAD", "BLOCK", "1000", "STREAMS", j->stream, after};
        size_t lens[6] = {5, 5, 4, 7, strlen(j->stream), (size_t)al};
        long bulks = 0;
        int t;
        if (r_cmd(r, 6, argv, lens) != 0 || (t = r_reply(r, &bulks)) < 0) {
            j->ok = 0;
            break;
        }
        uint64_t now = bench_now_ns();
        /* A reply: the key, then per entry its id, the field and the value. */
        long cnt = t == '*' && bulks >= 4 ? (bulks - 1) / 3 : 0;
        for (long i = 0; i < cnt && j->got < j->n; i++) {
            j->lat[j->got] = (double)(now - atomic_load(&j->t0[j->got])) / 1e3;
            j->got++;
        }
    }
    close(r->fd);
    free(r);
    return NULL;
}

static bench_result lat_redis(const bench_target *t, int n)
{
    bench_result res = {0};
    char name[64];
    snprintf(name, sizeof(name), "lat%d", ++g.seq);
    lat_job j = {.t = t, .stream = name, .n = n};
    j.t0 = calloc((size_t)n, sizeof(*j.t0));
    j.lat = calloc((size_t)n, sizeof(*j.lat));
    rconn *w = calloc(1, sizeof(*w));
    pthread_t th;
    int started = 0;
    if (j.t0 == NULL || j.lat == NULL || w == NULL || (w->fd = bench_connect(t, g.use_unix)) < 0)
        goto out;
    if (pthread_create(&th, NULL, redis_reader, &j) != 0)
        goto out;
    started = 1;
    while (atomic_load(&j.ready) == 0)
        usleep(1000);
    if (atomic_load(&j.ready) < 0)
        goto out;
    /* Let the reader block in its first XREAD before the first entry. */
    usleep(20000);
    char val[LAT_RECORD];
    memset(val, 'v', sizeof(val));
    uint64_t next = bench_now_ns();
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        char id[32];
        int il = snprintf(id, sizeof(id), "0-%d", i + 1);
        const char *argv[5] = {"XADD", name, id, "v", val};
        size_t lens[5] = {4, strlen(name), (size_t)il, 1, sizeof(val)};
        next += (uint64_t)LAT_PERIOD_US * 1000u;
        bench_sleep_until_ns(next);
        atomic_store(&j.t0[i], bench_now_ns());
        long bulks = 0;
        ok = r_cmd(w, 5, argv, lens) == 0 && r_reply(w, &bulks) == '$';
    }
    pthread_join(th, NULL);
    started = 0;
    if (ok && j.ok && j.got == n) {
        res.ok = 1;
        res.value = bench_percentile(j.lat, (size_t)n, 50);
        res.value2 = bench_percentile(j.lat, (size_t)n, 99);
    }
    const char *dargv[2] = {"DEL", name};
    size_t dlens[2] = {3, strlen(name)};
    long bulks = 0;
    if (r_cmd(w, 2, dargv, dlens) != 0 || r_reply(w, &bulks) != ':')
        res.ok = 0;
out:
    if (started) {
        /* The reader gives up within its own bound (60 s) when the writer failed. */
        pthread_join(th, NULL);
    }
    if (w != NULL && w->fd > 0)
        close(w->fd);
    free(w);
    free(j.t0);
    free(j.lat);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * The table
 */

typedef struct runs {
    double v[MAX_REPEATS][6];
    int n;
} runs;

static void add(runs *r, int ok, const char *what, double a, double b, double c, double d, double e,
                double f)
{
    if (!ok) {
        fail_note("%s: a run failed", what);
        return;
    }
    if (r->n < MAX_REPEATS) {
        double *v = r->v[r->n++];
        v[0] = a, v[1] = b, v[2] = c, v[3] = d, v[4] = e, v[5] = f;
    }
    if (g.raw)
        fprintf(stderr, "raw: %-24s %.6g %.6g %.6g %.6g %.6g %.6g\n", what, a, b, c, d, e, f);
}

static double med(const runs *r, int k)
{
    if (r->n == 0)
        return NAN;
    double tmp[MAX_REPEATS];
    for (int i = 0; i < r->n; i++)
        tmp[i] = r->v[i][k];
    return bench_median(tmp, (size_t)r->n);
}

static double maxof(const runs *r, int k)
{
    double m = NAN;
    for (int i = 0; i < r->n; i++)
        m = isnan(m) || r->v[i][k] > m ? r->v[i][k] : m;
    return m;
}

static double minof(const runs *r, int k)
{
    double m = NAN;
    for (int i = 0; i < r->n; i++)
        m = isnan(m) || r->v[i][k] < m ? r->v[i][k] : m;
    return m;
}

static const char *verdict(double ratio, double min)
{
    if (isnan(ratio))
        return "-";
    return ratio >= min ? "pass" : "MISS";
}

static void machine_info(void)
{
    bench_print_machine();
    printf("tensord and redis pinned to cpu0, every client process to cpu1: %s; %s; %d repeats, "
           "medians; %ld batches of %d rows (%.2f MiB) per run, %ld decode passes\n",
           bench_pinning() ? "yes" : "no", g.use_unix ? "unix socket" : "tcp", g.repeats, g.batches,
           BATCH_ROWS, (double)BATCH_ROWS * IMG_ROW_FLOATS * 4 / 1048576.0, g.passes);
}

static const char *find_in_path(const char *name)
{
    static char found[512];
    const char *path = getenv("PATH");
    if (path == NULL)
        path = "/usr/bin:/bin";
    while (*path) {
        size_t n = strcspn(path, ":");
        snprintf(found, sizeof(found), "%.*s/%s", (int)n, path, name);
        if (access(found, X_OK) == 0)
            return found;
        path += n;
        if (*path == ':')
            path++;
    }
    snprintf(found, sizeof(found), "/usr/bin/%s", name);
    return access(found, X_OK) == 0 ? found : NULL;
}

static void usage(void)
{
    fprintf(stderr, "usage: stream_bench [--smoke] [--repeats N] [--tensord PATH] [--redis PATH | "
                    "--no-redis] [--no-pin] [--unix] [--batches N] [--passes N] "
                    "[--skip share,fail,latency] [--raw]\n");
}

static int parse_pos(const char *s, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    g.tensord = getenv("TS_TENSORD") != NULL ? getenv("TS_TENSORD") : TS_TENSORD_PATH;
    int no_redis = 0;
    long repeats = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--smoke") == 0) {
            g.smoke = 1;
            continue;
        } else if (strcmp(a, "--no-redis") == 0) {
            no_redis = 1;
            continue;
        } else if (strcmp(a, "--no-pin") == 0) {
            bench_set_pinning(0);
            continue;
        } else if (strcmp(a, "--unix") == 0) {
            g.use_unix = 1;
            continue;
        } else if (strcmp(a, "--raw") == 0) {
            g.raw = 1;
            continue;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage();
            return 0;
        }
        const char *val = i + 1 < argc ? argv[++i] : NULL;
        int bad = 0;
        if (val == NULL)
            bad = 1;
        else if (strcmp(a, "--repeats") == 0)
            bad = parse_pos(val, 1, MAX_REPEATS, &repeats) != 0;
        else if (strcmp(a, "--batches") == 0)
            bad = parse_pos(val, 10, 1000000, &g.batches) != 0;
        else if (strcmp(a, "--passes") == 0)
            bad = parse_pos(val, 0, 1000, &g.passes) != 0;
        else if (strcmp(a, "--tensord") == 0)
            g.tensord = val;
        else if (strcmp(a, "--redis") == 0)
            g.redis = val;
        else if (strcmp(a, "--skip") == 0)
            g.skip = val;
        else
            bad = 1;
        if (bad) {
            usage();
            return 2;
        }
    }
    g.repeats = repeats > 0 ? (int)repeats : g.smoke ? 1 : 5;
    if (g.batches == 0)
        g.batches = g.smoke ? 30 : 300;
    if (no_redis)
        g.redis = NULL;
    else if (g.redis == NULL)
        g.redis = find_in_path("redis-server");
    if (sysconf(_SC_NPROCESSORS_ONLN) < 2)
        bench_set_pinning(0);
    snprintf(g.dir, sizeof(g.dir), "/tmp/stream_bench.XXXXXX");
    if (mkdtemp(g.dir) == NULL) {
        perror("stream_bench: mkdtemp");
        return 1;
    }
    /* A consumer killed in the failure case must not take the parent with it via SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    machine_info();
    server ts = {0}, rd = {.pid = -1};
    if (start_tensord(&ts) != 0)
        return 1;
    if (!skipped("latency") && g.redis != NULL && start_redis(&rd) != 0 && !g.smoke)
        g.failures++;
    if (rd.pid <= 0)
        printf("redis: not measured%s\n", g.redis == NULL ? " (redis-server not found)" : "");
    bench_pin_self(1);
    fflush(stdout);
    char addr[300];
    address_of(&ts, addr, sizeof(addr));

    runs share = {0}, load = {0}, ceil_s = {0}, ceil_pg = {0}, fail = {0}, lat_s = {0}, lat_r = {0};
    int lat_n = g.smoke ? 50 : 2000;
    for (int r = 0; r < g.repeats; r++) {
        if (!skipped("share")) {
            /* Alternate which system goes first. */
            for (int k = 0; k < 2; k++) {
                if ((k == 0) == (r % 2 == 0)) {
                    share_res s = share_stream(&ts, 1);
                    add(&share, s.ok, "share stream", s.rate, s.rate_min, s.cpu_batch, s.cpu_prod,
                        s.cpu_tsd, s.cpu_cons);
                } else {
                    share_res s = share_loaders();
                    add(&load, s.ok, "share loaders", s.rate, s.rate_min, s.cpu_batch, 0, 0, 0);
                }
            }
            for (int k = 0; k < 2; k++) {
                if ((k == 0) == (r % 2 == 0)) {
                    share_res s = share_stream(&ts, 0);
                    add(&ceil_s, s.ok, "transport stream", s.rate, s.rate_min, s.cpu_batch,
                        s.cpu_prod, s.cpu_tsd, s.cpu_cons);
                } else {
                    size_t size = (size_t)BATCH_ROWS * IMG_ROW_FLOATS * sizeof(float);
                    int it = g.smoke ? 10 : 200;
                    bench_result p = ts_bench_putget(&ts.t, g.use_unix, size, it, 0, 0);
                    add(&ceil_pg, p.ok, "transport put+get", 1.0 / p.value, 0, 0, 0, 0, 0);
                }
            }
        }
        if (!skipped("fail")) {
            int lease = g.smoke ? 300 : FAIL_LEASE_MS, pause = g.smoke ? 600 : FAIL_PAUSE_MS;
            fail_res f = fail_case(&ts, lease, pause);
            add(&fail, f.ok, "fail", f.stall_others, f.pause_gap, (double)f.total_ok,
                (double)f.killed_at, (double)f.late_first, (double)f.paused_ok);
            if (f.ok)
                printf("fail run %d: killed after %" PRIu64 " batches; paused at id %" PRIu64
                       " for %.2f s, next id %" PRIu64 ", %" PRIu64
                       " batches in all; late joined when %" PRIu64
                       " were produced, first id %" PRIu64 ", %" PRIu64
                       " batches; longest stall of the others %.0f ms (lease %d ms); %" PRIu64
                       "/3 consumers with every batch in order\n",
                       r, f.killed_at, f.paused_at, f.pause_gap, f.paused_next, f.paused_batches,
                       f.late_at, f.late_first, f.late_batches, f.stall_others * 1e3, lease,
                       f.total_ok);
            if (f.ok && f.total_ok != 3)
                fail_note("fail: %" PRIu64 " of 3 consumers got every batch in order", f.total_ok);
        }
        if (!skipped("latency")) {
            for (int k = 0; k < 2; k++) {
                if ((k == 0) == (r % 2 == 0)) {
                    bench_result b = lat_stream(addr, lat_n);
                    add(&lat_s, b.ok, "latency stream", b.value, b.value2, 0, 0, 0, 0);
                } else if (rd.pid > 0) {
                    bench_result b = lat_redis(&rd.t, lat_n);
                    add(&lat_r, b.ok, "latency redis", b.value, b.value2, 0, 0, 0, 0);
                }
            }
        }
        fflush(stdout);
    }
    bench_stop(ts.pid);
    if (rd.pid > 0)
        bench_stop(rd.pid);

    char s[8][64];
    printf("\n");
    if (!skipped("share")) {
        double sr = med(&share, 0), lr = med(&load, 0);
        printf("#### One producer, four consumers, %.2f MiB batches of images (medians)\n\n",
               (double)BATCH_ROWS * IMG_ROW_FLOATS * 4 / 1048576.0);
        printf("| case | stream | reference | ratio | target |\n|---|---|---|---|---|\n");
        snprintf(s[0], 64, "%.1f (slowest %.1f)", sr, med(&share, 1));
        snprintf(s[1], 64, "%.1f (slowest %.1f)", lr, med(&load, 1));
        printf("| batches/s per consumer | %s | 4 independent loaders: %s | %.2fx | %s (>= 1.8x) "
               "|\n",
               s[0], s[1], sr / lr, verdict(sr / lr, 1.8));
        double sc = med(&share, 2), lc = med(&load, 2);
        printf("| CPU per batch delivered, all processes | %.2f ms | %.2f ms | %.2fx less | %s "
               "(>= 2x) |\n",
               sc * 1e3, lc * 1e3, lc / sc, verdict(lc / sc, 2.0));
        printf("| of which per batch produced: producer, tensord, one consumer | %.2f, %.2f, %.2f "
               "ms | - | - | - |\n",
               med(&share, 3) * 1e3, med(&share, 4) * 1e3, med(&share, 5) * 1e3);
        double tr = med(&ceil_s, 0), pg = med(&ceil_pg, 0);
        double mib = (double)BATCH_ROWS * IMG_ROW_FLOATS * 4 / 1048576.0;
        snprintf(s[2], 64, "%.0f entries/s each (%.0f MiB/s through tensord)", tr,
                 tr * mib * (N_CONSUMERS + 1));
        snprintf(s[3], 64, "put+get: %.0f rounds/s (%.0f MiB/s)", pg, pg * mib * 2);
        printf("| transport, no work: 1 in, 4 out per entry | %s | %s | %.2fx | - |\n", s[2], s[3],
               tr * (N_CONSUMERS + 1) / (pg * 2));
        printf("| every batch once, in order, rows hashed | %d of %d runs, 4 of 4 consumers | - | "
               "- | %s |\n\n",
               share.n, g.repeats, share.n == g.repeats ? "pass" : "MISS");
    }
    if (!skipped("fail")) {
        int lease = g.smoke ? 300 : FAIL_LEASE_MS;
        printf("#### Failures: one consumer killed, one stopped %.1f s, one joining late "
               "(lease %d ms)\n\n",
               (g.smoke ? 600 : FAIL_PAUSE_MS) / 1000.0, lease);
        printf("| measurement | median | worst |\n|---|---|---|\n");
        printf("| longest wait of the others between two batches | %.0f ms | %.0f ms |\n",
               med(&fail, 0) * 1e3, maxof(&fail, 0) * 1e3);
        printf("| the stopped one's longest gap; then on with the next id | %.0f ms | %s |\n",
               med(&fail, 1) * 1e3,
               minof(&fail, 5) == 1 ? "no gap in ids in any run" : "a GAP in ids");
        printf("| consumers that lived with every batch in order (of 3) | %.0f | - |\n\n",
               med(&fail, 2));
    }
    if (!skipped("latency")) {
        printf("#### Append to a blocked reader, %d B records, paced 1 per ms (Redis: XADD to "
               "XREAD BLOCK)\n\n",
               LAT_RECORD);
        printf("| case | stream | redis | vs redis | target |\n|---|---|---|---|---|\n");
        double a = med(&lat_s, 0), b = med(&lat_r, 0), a9 = med(&lat_s, 1), b9 = med(&lat_r, 1);
        printf("| p50 | %.1f us | %.1f us | %.2fx | %s |\n", a, b, b / a, verdict(b / a, 1.0));
        printf("| p99 | %.1f us | %.1f us | %.2fx | - |\n\n", a9, b9, b9 / a9);
    }
    char cmd[300];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g.dir);
    if (system(cmd) != 0)
        fprintf(stderr, "stream_bench: could not remove %s\n", g.dir);
    if (g.failures > 0) {
        fprintf(stderr, "stream_bench: %d failures\n", g.failures);
        return 1;
    }
    return 0;
}
