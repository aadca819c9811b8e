/*
 * The batcher integration tests' shared scaffolding (see batcher_test_util.h): a tensord with
 * two clients, the toy model {x: float32[3]} -> {y = 2 x + offset}, its schema and batcher
 * options, request builders, the answer checker and the tally of asynchronous answers. It is kept
 * apart from the tests so that each test file holds only what it checks.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <time.h>

#include "batcher_test_util.h"
#include "common.h"

/* Polling period of tb_tally_wait, in microseconds: short next to any wait a test bounds. */
#define TB_POLL_US 2000

atomic_int tb_delay_us;

void tb_sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

uint64_t tb_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void tb_world_open(tb_world *w)
{
    memset(w, 0, sizeof(*w));
    assert_int_equal(tsh_server_start(&w->srv, NULL), 0);
    assert_int_equal(ts_client_open(&w->sc, w->srv.addr, NULL), 0);
    assert_int_equal(ts_client_open(&w->c, w->srv.addr, NULL), 0);
}

void tb_world_close(tb_world *w)
{
    ts_client_free(w->c);
    ts_client_free(w->sc);
    assert_int_equal(tsh_server_stop(&w->srv), 0);
    tsh_server_cleanup(&w->srv);
}

/* A replica of the toy model: the offset its forward adds after doubling. */
typedef struct tb_model {
    ts_model_t base;
    float offset;
} tb_model;

static int tb_forward(ts_model_t *m, const ts_value_t *in, int64_t rows, ts_value_t **out)
{
    if (atomic_load(&tb_delay_us) > 0)
        tb_sleep_us(atomic_load(&tb_delay_us));
    const ts_tensor_t *x = ts_map_get_tensor(in, "x");
    ts_value_t *y = ts_tensor_new(TS_FLOAT32, 2, x->shape, x->data, TS_COPY);
    ts_value_t *o = ts_map_new();
    if (y == NULL || o == NULL || ts_map_set(o, "y", y) != 0) {
        ts_value_free(o);
        return TS_ENOMEM;
    }
    float offset = ((tb_model *)m)->offset;
    float *d = ts_value_tensor(y)->data;
    for (int64_t i = 0; i < rows * 3; i++)
        d[i] = 2.0f * d[i] + offset;
    *out = o;
    return 0;
}

static void tb_free(ts_model_t *m)
{
    ts__free(m);
}

static const ts_model_ops_t tb_ops = {tb_forward, NULL, tb_free};

int tb_model_create(const char *device, int replica, ts_model_t **out, void *arg)
{
    (void)device;
    (void)replica;
    tb_model *m = ts__calloc(1, sizeof(*m));
    if (m == NULL)
        return TS_ENOMEM;
    m->base.ops = &tb_ops;
    m->offset = arg != NULL ? *(const float *)arg : 0.0f;
    *out = &m->base;
    return 0;
}

const ts_field_t tb_schema[1] = {{"x", TS_FLOAT32, 1, {3}}};

void tb_options(ts_batcher_options_t *cfg, int max_batch, int64_t max_delay_us,
                const char *placement)
{
    ts_batcher_options_init(cfg);
    cfg->inputs = tb_schema;
    cfg->n_inputs = 1;
    cfg->max_batch = max_batch;
    cfg->max_delay_us = max_delay_us;
    if (placement != NULL)
        cfg->placement = placement;
    cfg->create = tb_model_create;
}

ts_batcher_t *tb_batcher(const ts_batcher_options_t *cfg)
{
    ts_batcher_t *b = NULL;
    int rc = ts_batcher_new(&b, cfg);
    if (rc != 0) {
        fprintf(stderr, "ts_batcher_new: %s (%s)\n", ts_err_name(rc), ts_last_error());
        return NULL;
    }
    return b;
}

ts_batcher_t *tb_new_batcher(int max_batch, int64_t max_delay_us, const char *placement)
{
    ts_batcher_options_t cfg;
    tb_options(&cfg, max_batch, max_delay_us, placement);
    return tb_batcher(&cfg);
}

ts_value_t *tb_request_try(int64_t rows, int64_t base)
{
    int64_t shape[2] = {rows, 3};
    ts_value_t *x = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    if (x == NULL)
        return NULL;
    float *d = ts_value_tensor(x)->data;
    for (int64_t i = 0; i < rows * 3; i++)
        d[i] = (float)(base + i);
    ts_value_t *m = ts_map_new();
    /* ts_map_set frees x when it fails, and fails on a NULL map. */
    if (ts_map_set(m, "x", x) != 0) {
        ts_value_free(m);
        return NULL;
    }
    return m;
}

ts_value_t *tb_request(int64_t rows, int64_t base)
{
    ts_value_t *m = tb_request_try(rows, base);
    assert_non_null(m);
    return m;
}

int tb_check(const ts_value_t *out, int64_t rows, int64_t base, float scale)
{
    const ts_tensor_t *y = ts_map_get_tensor(out, "y");
    if (y == NULL || y->ndim != 2 || y->shape[0] != rows || y->shape[1] != 3)
        return 0;
    for (int64_t i = 0; i < rows * 3; i++)
        if (((const float *)y->data)[i] != (float)(base + i) * scale)
            return 0;
    return 1;
}

void tb_tally_init(tb_tally *t)
{
    memset(t, 0, sizeof(*t));
    pthread_mutex_init(&t->mu, NULL);
}

void tb_tally_destroy(tb_tally *t)
{
    pthread_mutex_destroy(&t->mu);
}

void tb_tally_add(tb_tally *t, int status, int good)
{
    pthread_mutex_lock(&t->mu);
    if (t->done < TB_TALLY_STATUSES)
        t->statuses[t->done] = status;
    t->done++;
    t->ok += good != 0;
    if (status != 0) {
        t->last_status = status;
        snprintf(t->last_msg, sizeof(t->last_msg), "%s", ts_last_error());
    }
    pthread_mutex_unlock(&t->mu);
}

int tb_tally_wait(tb_tally *t, int n, int max_ms)
{
    uint64_t end = tb_now_ms() + (uint64_t)max_ms;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        int d = t->done;
        pthread_mutex_unlock(&t->mu);
        if (d >= n)
            return 1;
        if (tb_now_ms() > end)
            return 0;
        tb_sleep_us(TB_POLL_US);
    }
}
