/*
 * The tensord side of every case, through the public libtensorshare API only, as a user would
 * write it: tensors sent from the caller's memory (TS_BORROW), items received zero-copy.
 */
#define _GNU_SOURCE
#include "bench.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorshare/tensorshare.h"

/* Open a client to t over TCP or its unix socket; NULL on failure (reason on stderr). */
static ts_client_t *open_client(const bench_target *t, int use_unix, size_t compress_min)
{
    char addr[300];
    if (use_unix)
        snprintf(addr, sizeof(addr), "unix:%s", t->unix_path);
    else
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", t->port);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.compress_min = compress_min;
    o.request_timeout_ms = 120000;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, &o);
    if (rc != 0) {
        fprintf(stderr, "tsbench: connecting to %s: %s (%s)\n", addr, ts_strerror(rc),
                ts_last_error());
        return NULL;
    }
    return c;
}

/* A one-dimensional float32 tensor over data (borrowed). */
static ts_value_t *tensor_over(void *data, size_t size)
{
    int64_t shape[1] = {(int64_t)(size / sizeof(float))};
    return ts_tensor_new(TS_FLOAT32, 1, shape, data, TS_BORROW);
}

/* One put then get; when check is set, the received tensor must equal src. 0 or -1. */
static int putget_round(ts_client_t *c, const ts_value_t *v, const void *src, size_t size,
                        int check)
{
    ts_items_t *items = NULL;
    if (ts_put(c, "bench:big", v, NULL) != 0 || ts_get(c, "bench:big", 0, &items) != 0)
        return -1;
    int rc = 0;
    if (ts_items_count(items) != 1) {
        rc = -1;
    } else if (check) {
        const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
        rc = t != NULL && ts_tensor_nbytes(t) == size && memcmp(t->data, src, size) == 0 ? 0 : -1;
    }
    ts_items_free(items);
    return rc;
}

bench_result ts_bench_putget(const bench_target *t, int use_unix, size_t size, int iters,
                             size_t compress_min, int compressible)
{
    bench_result res = {0};
    ts_client_t *c = open_client(t, use_unix, compress_min);
    uint8_t *src = bench_alloc(size);
    ts_value_t *v = src != NULL ? tensor_over(src, size) : NULL;
    if (c == NULL || v == NULL)
        goto out;
    bench_fill(src, size, compressible, 5);
    if (putget_round(c, v, src, size, 1) != 0)
        goto out;
    double t0 = bench_now();
    for (int i = 0; i < iters; i++)
        if (putget_round(c, v, src, size, 0) != 0)
            goto out;
    res.value = (bench_now() - t0) / iters;
    res.ok = putget_round(c, v, src, size, 1) == 0;
out:
    if (!res.ok)
        fprintf(stderr, "tsbench: tensord put/get of %zu bytes failed: %s\n", size,
                ts_last_error());
    ts_value_free(v);
    ts_client_free(c);
    bench_free(src);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Small operations
 */
typedef struct small_cli small_cli;

/* One pipeline slot: its own bin, alternating put and get. */
typedef struct small_slot {
    small_cli *cli;
    char bin[32];
    int next_is_get;
} small_slot;

struct small_cli {
    ts_client_t *c;
    ts_value_t *item;
    float data[16]; /* 64 bytes */
    small_slot slots[64];
    int depth;
    double end;
    long long ops;
    int in_flight;
    int failed;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

static void slot_issue(small_slot *s);

/* Completion of one put or get; issues the slot's next request until the deadline. */
static void slot_done(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    small_slot *s = arg;
    small_cli *k = s->cli;
    (void)c;
    (void)res;
    k->ops++;
    if (status != 0)
        k->failed = 1;
    if (!k->failed && bench_now() < k->end) {
        slot_issue(s);
        return;
    }
    pthread_mutex_lock(&k->mu);
    if (--k->in_flight == 0)
        pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
}

static void slot_issue(small_slot *s)
{
    small_cli *k = s->cli;
    int get = s->next_is_get;
    s->next_is_get = !get;
    int rc = get ? ts_get_async(k->c, s->bin, 0, slot_done, s)
                 : ts_put_async(k->c, s->bin, k->item, 0, slot_done, s);
    if (rc != 0) {
        k->failed = 1;
        pthread_mutex_lock(&k->mu);
        if (--k->in_flight == 0)
            pthread_cond_signal(&k->cv);
        pthread_mutex_unlock(&k->mu);
    }
}

typedef struct small_job {
    small_cli *k;
    int idx;
    double secs;
    pthread_barrier_t *start;
} small_job;

static void *small_thread(void *arg)
{
    small_job *j = arg;
    small_cli *k = j->k;
    bench_pin_self(1);
    pthread_barrier_wait(j->start);
    if (k->c == NULL || k->item == NULL) {
        k->failed = 1;
        return NULL;
    }
    k->end = bench_now() + j->secs;
    if (k->depth == 1) {
        /* Blocking: one put, then one get, on the caller's thread. */
        const char *bin = k->slots[0].bin;
        while (bench_now() < k->end) {
            ts_items_t *items = NULL;
            if (ts_put(k->c, bin, k->item, NULL) != 0 || ts_get(k->c, bin, 0, &items) != 0) {
                k->failed = 1;
                break;
            }
            ts_items_free(items);
            k->ops += 2;
        }
        return NULL;
    }
    pthread_mutex_lock(&k->mu);
    k->in_flight = k->depth;
    pthread_mutex_unlock(&k->mu);
    for (int i = 0; i < k->depth; i++)
        slot_issue(&k->slots[i]);
    pthread_mutex_lock(&k->mu);
    while (k->in_flight > 0)
        pthread_cond_wait(&k->cv, &k->mu);
    pthread_mutex_unlock(&k->mu);
    return NULL;
}

bench_result ts_bench_small(const bench_target *t, int use_unix, int nclients, int depth,
                            double secs)
{
    bench_result res = {0};
    if (nclients > 64 || depth > 64)
        return res;
    small_cli *ks = calloc((size_t)nclients, sizeof(*ks));
    small_job jobs[64];
    pthread_t th[64];
    if (ks == NULL)
        return res;
    for (int i = 0; i < nclients; i++) {
        small_cli *k = &ks[i];
        k->c = open_client(t, use_unix, 0);
        k->item = tensor_over(k->data, sizeof(k->data));
        k->depth = depth;
        pthread_mutex_init(&k->mu, NULL);
        pthread_cond_init(&k->cv, NULL);
        for (int s = 0; s < depth; s++) {
            k->slots[s].cli = k;
            snprintf(k->slots[s].bin, sizeof(k->slots[s].bin), "bench:s%d.%d", i, s);
        }
    }
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)nclients + 1);
    for (int i = 0; i < nclients; i++) {
        jobs[i] = (small_job){.k = &ks[i], .idx = i, .secs = secs, .start = &start};
        pthread_create(&th[i], NULL, small_thread, &jobs[i]);
    }
    pthread_barrier_wait(&start);
    double t0 = bench_now();
    for (int i = 0; i < nclients; i++)
        pthread_join(th[i], NULL);
    double el = bench_now() - t0;
    long long ops = 0;
    int ok = 1;
    for (int i = 0; i < nclients; i++) {
        ops += ks[i].ops;
        ok &= !ks[i].failed;
        ts_client_free(ks[i].c);
        ts_value_free(ks[i].item);
        pthread_mutex_destroy(&ks[i].mu);
        pthread_cond_destroy(&ks[i].cv);
    }
    pthread_barrier_destroy(&start);
    free(ks);
    res.ok = ok;
    res.value = (double)ops / el;
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Notification latency
 */
typedef struct note_job {
    int n;
    _Atomic uint64_t *t0;
    double *lat;
    atomic_int got;
    atomic_int bad;
} note_job;

static void on_note(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    note_job *j = arg;
    uint64_t now = bench_now_ns();
    (void)c;
    if (status != 0 || n == NULL)
        return;
    if (n->event != TS_EV_PUT) {
        atomic_store(&j->bad, 1);
        return;
    }
    int i = atomic_load(&j->got);
    if (i < j->n) {
        j->lat[i] = (double)(now - atomic_load(&j->t0[i])) / 1e3;
        atomic_store(&j->got, i + 1);
    }
}

bench_result ts_bench_notify(const bench_target *t, int use_unix, int n, int period_us)
{
    bench_result res = {0};
    note_job j = {.n = n};
    j.t0 = calloc((size_t)n, sizeof(*j.t0));
    j.lat = calloc((size_t)n, sizeof(*j.lat));
    ts_client_t *pub = open_client(t, use_unix, 0);
    ts_client_t *sub = open_client(t, use_unix, 0);
    float data[16] = {0};
    ts_value_t *v = tensor_over(data, sizeof(data));
    int listening = 0;
    if (pub == NULL || sub == NULL || v == NULL || j.t0 == NULL || j.lat == NULL)
        goto out;
    if (ts_listen(sub, "bench:n", on_note, &j) != 0)
        goto out;
    listening = 1;
    uint64_t next = bench_now_ns();
    int ok = 1;
    for (int i = 0; i < n && ok; i++) {
        atomic_store(&j.t0[i], bench_now_ns());
        if (ts_put(pub, "bench:n", v, NULL) != 0)
            ok = 0;
        next += (uint64_t)period_us * 1000u;
        bench_sleep_until_ns(next);
    }
    /* The last notification may still be on its way. */
    for (int w = 0; w < 2000 && atomic_load(&j.got) < n; w++)
        bench_sleep_until_ns(bench_now_ns() + 1000000);
    if (ok && atomic_load(&j.got) == n && !atomic_load(&j.bad)) {
        res.ok = 1;
        res.value = bench_percentile(j.lat, (size_t)n, 50);
        res.value2 = bench_percentile(j.lat, (size_t)n, 99);
    }
out:
    if (listening)
        (void)ts_unlisten(sub, "bench:n");
    if (pub != NULL)
        (void)ts_delete(pub, "bench:n", NULL);
    /* Freeing the client delivers the final callback before it returns the memory of j. */
    ts_client_free(sub);
    ts_client_free(pub);
    ts_value_free(v);
    free(j.t0);
    free(j.lat);
    return res;
}

/* ---------------------------------------------------------------------------------------------
 * Memory
 */
typedef struct store_win {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int in_flight;
    int failed;
} store_win;

static void store_done(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    store_win *w = arg;
    (void)c;
    (void)res;
    pthread_mutex_lock(&w->mu);
    if (status != 0)
        w->failed = 1;
    w->in_flight--;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int ts_bench_store(const bench_target *t, size_t size, size_t total, size_t per_bin)
{
    ts_client_t *c = open_client(t, 0, 0);
    uint8_t *src = bench_alloc(size);
    ts_value_t *v = src != NULL ? tensor_over(src, size) : NULL;
    int rc = -1;
    if (c == NULL || v == NULL)
        goto out;
    bench_fill(src, size, 0, 6);
    store_win w = {.in_flight = 0};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    /* Up to 64 small puts in flight; large ones one at a time (they fill the socket anyway). */
    int window = size >= ((size_t)1 << 20) ? 1 : 64;
    size_t n = total / size;
    rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        char bin[32];
        snprintf(bin, sizeof(bin), "m:%zu", per_bin > 1 ? i / per_bin : i);
        pthread_mutex_lock(&w.mu);
        while (w.in_flight >= window)
            pthread_cond_wait(&w.cv, &w.mu);
        w.in_flight++;
        rc = w.failed ? -1 : 0;
        pthread_mutex_unlock(&w.mu);
        if (rc == 0 && (per_bin > 1 ? ts_append_async(c, bin, v, 0, store_done, &w)
                                    : ts_put_async(c, bin, v, 0, store_done, &w)) != 0) {
            pthread_mutex_lock(&w.mu);
            w.in_flight--;
            pthread_mutex_unlock(&w.mu);
            rc = -1;
        }
    }
    pthread_mutex_lock(&w.mu);
    while (w.in_flight > 0)
        pthread_cond_wait(&w.cv, &w.mu);
    if (w.failed)
        rc = -1;
    pthread_mutex_unlock(&w.mu);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
out:
    ts_client_free(c);
    ts_value_free(v);
    bench_free(src);
    return rc;
}

double ts_bench_held_records(const bench_target *t)
{
    ts_client_t *c = open_client(t, 0, 0);
    ts_bin_list_t *l = NULL;
    double bytes = -1;
    if (c != NULL && ts_list(c, &l) == 0) {
        bytes = 0;
        for (size_t i = 0; i < l->count; i++)
            bytes += (double)l->bins[i].bytes;
        ts_bin_list_free(l);
    }
    ts_client_free(c);
    return bytes;
}

int ts_bench_put_one(const bench_target *t, const char *name, size_t size)
{
    ts_client_t *c = open_client(t, 0, 0);
    uint8_t *src = bench_alloc(size);
    ts_value_t *v = src != NULL ? tensor_over(src, size) : NULL;
    int rc = -1;
    if (c != NULL && v != NULL) {
        bench_fill(src, size, 0, 7);
        rc = ts_put(c, name, v, NULL) == 0 ? 0 : -1;
    }
    ts_client_free(c);
    ts_value_free(v);
    bench_free(src);
    return rc;
}
