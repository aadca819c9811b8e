/*
 * Replay tables on the client (include/tensorshare/replay.h): one blocking request per call,
 * bodies encoded by src/msg_table.c (TABLE_INSERT is an upload with fixed fields, its record sent
 * from the caller's memory like a PUT's), replies parsed by reply.c (TABLE STATE into
 * ts__req.stream.table, SAMPLES into items with a ts__table_tail).
 *
 * Threads: blocking calls of a client like any other (any thread, never from a callback).
 */
#include "tensorshare/replay.h"

#include "internal.h"

#include "msg.h"

#include <math.h>

/* The settings ts_table_config_init gives: a table for a small RL run. */
#define TS__TABLE_DEFAULT_CAPACITY 100000

_Static_assert(TS_TABLE_CAPACITY_MAX == TS_TABLE_MAX_CAPACITY, "public and wire limits agree");
_Static_assert(TS_TABLE_SAMPLE_MAX == TS_TABLE_MAX_SAMPLE, "public and wire limits agree");
_Static_assert(TS_TABLE_UNIFORM == TS_TABLE_SAMPLER_UNIFORM &&
                   TS_TABLE_PRIORITIZED == TS_TABLE_SAMPLER_PRIORITIZED &&
                   TS_TABLE_FIFO == TS_TABLE_SAMPLER_FIFO && TS_TABLE_LIFO == TS_TABLE_SAMPLER_LIFO,
               "sampler values are the wire's");
_Static_assert(TS_TABLE_REMOVE_FIFO == TS_TABLE_REMOVER_FIFO &&
                   TS_TABLE_REMOVE_LIFO == TS_TABLE_REMOVER_LIFO &&
                   TS_TABLE_REMOVE_LOWEST_PRIORITY == TS_TABLE_REMOVER_LOWEST,
               "remover values are the wire's");

struct ts_table_sample_s {
    ts_items_t *items; /* the records, and the heads after them (internal.h) */
};

static void state_out(const ts__msg_table_state *m, ts_table_state_t *st)
{
    if (st == NULL)
        return;
    st->key = m->key;
    st->size = m->size;
    st->inserts = m->inserts;
    st->samples = m->samples;
    st->done = m->done;
    st->skipped = m->skipped;
}

void ts_table_config_init(ts_table_config_t *cfg)
{
    if (cfg == NULL)
        return;
    memset(cfg, 0, sizeof(*cfg));
    cfg->capacity = TS__TABLE_DEFAULT_CAPACITY;
    cfg->sampler = TS_TABLE_UNIFORM;
    cfg->remover = TS_TABLE_REMOVE_FIFO;
    cfg->priority_exponent = 1.0;
    cfg->min_size_to_sample = 1;
    cfg->samples_per_insert = 1.0;
}

int ts_table_create(ts_client_t *c, const char *name, const ts_table_config_t *cfg,
                    ts_table_state_t *st)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts_table_config_t def;
    if (cfg == NULL) {
        ts_table_config_init(&def);
        cfg = &def;
    }
    ts__msg_table_create_req m = {.name = (const uint8_t *)name,
                                  .capacity = cfg->capacity,
                                  .min_size_to_sample = cfg->min_size_to_sample,
                                  .samples_per_insert = cfg->samples_per_insert,
                                  .error_buffer = cfg->error_buffer,
                                  .priority_exponent = cfg->priority_exponent,
                                  .max_times_sampled = cfg->max_times_sampled,
                                  .remover = (uint8_t)cfg->remover,
                                  .sampler = (uint8_t)cfg->sampler};
    if ((rc = ts__api_check_id("table", name, &m.name_len)) != 0)
        return rc;
    /* The server checks every value (INVALID); only what cannot travel is refused here. */
    if ((unsigned)cfg->sampler > 255u || (unsigned)cfg->remover > 255u)
        return ts__fail(TS_EINVAL, "unknown sampler or remover");
    size_t len = ts__msg_table_create_req_size(m.name_len), n;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_TABLE_CREATE, len, NULL, NULL, 0, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_table_create_req_encode(r->flat, len, &m, &n); /* the name was checked */
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    state_out(&done->stream.table, st);
    ts__req_free(done);
    return 0;
}

int ts_table_insert(ts_client_t *c, const char *name, const ts_value_t *item, double priority,
                    int timeout_ms, uint64_t *key)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t len;
    uint32_t wait_ms = 0;
    if ((rc = ts__api_check_id("table", name, &len)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &wait_ms)) != 0)
        return rc;
    if (item == NULL)
        return ts__fail(TS_EINVAL, "no item to insert");
    if (!isfinite(priority) || priority < 0.0)
        return ts__fail(TS_EINVAL, "priority %g: expected a finite value >= 0", priority);
    /* The body: the name, the fixed fields, then the record sent from the caller's memory. */
    ts__req *r = ts__api_req_new(c, TS__K_BLOCK, TS_OP_TABLE_INSERT, name, &rc);
    if (r == NULL)
        return rc;
    ts__msg_table_insert_fixed f = {.priority = priority, .timeout_ms = wait_ms};
    ts__msg_table_insert_fixed_encode(ts__req_upload_fixed(r), &f);
    if ((rc = ts__api_borrow_record(r, item)) != 0)
        return rc;
    ts__req_hold_for(c, r, wait_ms);
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    if (key != NULL)
        *key = done->stream.table.key;
    ts__req_free(done);
    return 0;
}

int ts_table_sample(ts_client_t *c, const char *name, size_t n, int timeout_ms,
                    ts_table_sample_t **out)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_table_sample_req m = {.name = (const uint8_t *)name};
    if ((rc = ts__api_check_id("table", name, &m.name_len)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &m.timeout_ms)) != 0)
        return rc;
    if (n < 1 || n > TS_TABLE_SAMPLE_MAX)
        return ts__fail(TS_EINVAL, "n %zu: expected 1 to %d", n, TS_TABLE_SAMPLE_MAX);
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    m.n = (uint32_t)n;
    size_t len = ts__msg_table_sample_req_size(m.name_len), blen;
    ts__req *r =
        ts__api_flat_req(c, TS__K_BLOCK, TS_OP_TABLE_SAMPLE, len, NULL, NULL, m.timeout_ms, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_table_sample_req_encode(r->flat, len, &m, &blen);
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    ts_table_sample_t *s = ts__calloc(1, sizeof(*s));
    if (s == NULL) {
        ts__req_free(done);
        return ts__fail(TS_ENOMEM, NULL);
    }
    s->items = done->res.items;
    done->res.items = NULL;
    ts__req_free(done);
    *out = s;
    return 0;
}

static const ts__table_head *head_at(const ts_table_sample_t *s, size_t i)
{
    if (s == NULL || i >= s->items->count)
        return NULL;
    return &ts__items_table_tail(s->items)->e[i];
}

size_t ts_table_sample_count(const ts_table_sample_t *s)
{
    return s == NULL ? 0 : s->items->count;
}

const ts_value_t *ts_table_sample_value(const ts_table_sample_t *s, size_t i)
{
    return head_at(s, i) == NULL ? NULL : s->items->items[i];
}

uint64_t ts_table_sample_key(const ts_table_sample_t *s, size_t i)
{
    const ts__table_head *h = head_at(s, i);
    return h == NULL ? 0 : h->key;
}

double ts_table_sample_probability(const ts_table_sample_t *s, size_t i)
{
    const ts__table_head *h = head_at(s, i);
    return h == NULL ? 0.0 : h->probability;
}

uint32_t ts_table_sample_times_sampled(const ts_table_sample_t *s, size_t i)
{
    const ts__table_head *h = head_at(s, i);
    return h == NULL ? 0 : h->times_sampled;
}

uint64_t ts_table_sample_age_ms(const ts_table_sample_t *s, size_t i)
{
    const ts__table_head *h = head_at(s, i);
    return h == NULL ? 0 : h->age_ms;
}

uint64_t ts_table_sample_table_size(const ts_table_sample_t *s)
{
    return s == NULL ? 0 : ts__items_table_tail(s->items)->size;
}

void ts_table_sample_free(ts_table_sample_t *s)
{
    if (s == NULL)
        return;
    ts_items_free(s->items);
    ts__free(s);
}

/* UPDATE (priorities) or REMOVE (NULL), in batches of TS_TABLE_MAX_KEYS. */
static int keys_call(ts_client_t *c, uint8_t op, const char *name, size_t n, const uint64_t *keys,
                     const double *priorities, ts_table_state_t *st)
{
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t len = 0;
    if ((rc = ts__api_check_id("table", name, &len)) != 0)
        return rc;
    if (n > 0 && keys == NULL)
        return ts__fail(TS_EINVAL, "no keys");
    for (size_t i = 0; priorities != NULL && i < n; i++)
        if (!isfinite(priorities[i]) || priorities[i] < 0.0)
            return ts__fail(TS_EINVAL, "priority %zu (%g): expected a finite value >= 0", i,
                            priorities[i]);
    ts_table_state_t sum = {0};
    size_t off = 0;
    do {
        size_t k = n - off < TS_TABLE_MAX_KEYS ? n - off : TS_TABLE_MAX_KEYS;
        size_t blen = ts__msg_table_keys_req_size(len, (uint32_t)k, priorities != NULL), wrote;
        ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, op, blen, NULL, NULL, 0, &rc);
        if (r == NULL)
            return rc;
        /* The name was checked and k is at most TS_TABLE_MAX_KEYS: room is exact. */
        (void)ts__msg_table_keys_req_encode(r->flat, blen, (const uint8_t *)name, len, (uint32_t)k,
                                            keys + off,
                                            priorities != NULL ? priorities + off : NULL, &wrote);
        ts__req *done;
        if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
            return rc;
        uint32_t d = sum.done, s = sum.skipped;
        state_out(&done->stream.table, &sum);
        sum.done += d;
        sum.skipped += s;
        ts__req_free(done);
        off += k;
    } while (off < n);
    if (st != NULL)
        *st = sum;
    return 0;
}

int ts_table_update(ts_client_t *c, const char *name, size_t n, const uint64_t *keys,
                    const double *priorities, ts_table_state_t *st)
{
    c = ts__route(c, name);
    if (n > 0 && priorities == NULL)
        return ts__fail(TS_EINVAL, "no priorities");
    static const double none = 0.0;
    return keys_call(c, TS_OP_TABLE_UPDATE, name, n, keys, priorities != NULL ? priorities : &none,
                     st);
}

int ts_table_remove(ts_client_t *c, const char *name, size_t n, const uint64_t *keys,
                    ts_table_state_t *st)
{
    c = ts__route(c, name);
    return keys_call(c, TS_OP_TABLE_REMOVE, name, n, keys, NULL, st);
}

int ts_table_info(ts_client_t *c, const char *name, ts_value_t **out)
{
    return ts__api_info(c, TS_OP_TABLE_INFO, "table", name, out);
}
