/* The RL trainer (include/tensorshare/rl.h): publishes parameters, collects experience. */
#include "rl_internal.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Trainer
 */

struct ts_rl_trainer_s {
    ts_client_t *client; /* borrowed */
    char params_bin[TS_MAX_NAME_LEN + 1];
    char data_bin[TS_MAX_NAME_LEN + 1];
    int tolerance;
    int timeout_ms; /* what TS_TIMEOUT_DEFAULT means; >= 0 ms or -1 for no limit */
    int replay;     /* the data bin is a replay table (options' replay) */

    /* Serializes publishes so versions reach the daemon in the order they were given. */
    pthread_mutex_t publish_mu;
    /* Protects everything below. Never held across a client call. */
    pthread_mutex_t mu;
    int64_t version;      /* newest successfully published (or resumed) version */
    int64_t next_version; /* next number to hand out; failed publishes use numbers up too */
    ts_rl_trainer_stats_t stats;
};

struct ts_rl_batch_s {
    ts_items_t *items;         /* owns the memory every entry points into (a bin's), or */
    ts_table_sample_t *sample; /* (a replay table's) */
    size_t count;
    size_t dropped;
    struct rl_batch_entry {
        const ts_value_t *data;
        int64_t version;
        uint64_t key; /* replay tables only */
    } e[];
};

/*
 * Read the version stored in the parameters bin. Returns 0 with *version (-1 when the bin does
 * not exist), TS_EBADRECORD when its newest item is not {params, version}, or a client error.
 */
static int rl_trainer_read_version(ts_rl_trainer_t *t, int64_t *version)
{
    ts_items_t *items = NULL;
    int rc = ts_peek(t->client, t->params_bin, 0, &items);
    if (rc == TS_ENOENT) {
        *version = -1;
        return 0;
    }
    if (rc != 0)
        return rc;
    size_t n = ts_items_count(items);
    const ts_value_t *params;
    int64_t v = -1;
    rc = n == 0 ? TS_EBADRECORD : ts__rl_unwrap(ts_items_at(items, n - 1), "params", &params, &v);
    ts_items_free(items);
    if (rc == TS_EBADRECORD)
        ts__set_errorf("the parameters bin '%s' holds something other than {params, version}",
                       t->params_bin);
    if (rc == 0)
        *version = v;
    return rc;
}

static int rl_trainer_new(ts_rl_trainer_t **out, ts_client_t *c, const ts_rl_options_t *opts)
{
    assert(out != NULL && c != NULL);
    ts_rl_options_t defaults;
    if (opts == NULL) {
        ts_rl_options_init(&defaults);
        opts = &defaults;
    }
    if (opts->staleness_tolerance < TS_RL_NO_FILTER)
        return ts__fail(TS_EINVAL, "staleness_tolerance %d: expected >= 0 or TS_RL_NO_FILTER",
                        opts->staleness_tolerance);
    int timeout_ms;
    int rc = ts__rl_timeout(opts->timeout_ms, RL_DEFAULT_TIMEOUT_MS, &timeout_ms);
    if (rc != 0)
        return rc;
    ts_rl_trainer_t *t = ts__calloc(1, sizeof(*t));
    if (t == NULL)
        return TS_ENOMEM;
    t->client = c;
    t->tolerance = opts->staleness_tolerance;
    t->timeout_ms = timeout_ms;
    rc = ts__rl_bin_name(t->params_bin, opts->prefix, opts->params_bin);
    if (rc == 0)
        rc = ts__rl_bin_name(t->data_bin, opts->prefix, opts->data_bin);
    if (rc != 0) {
        ts__free(t);
        return ts__fail(rc, "bin names: prefix plus name must be 1..%d bytes", TS_MAX_NAME_LEN);
    }
    if (opts->replay != NULL) {
        /* The table may exist already (another trainer's, a restart): then it is used as is. */
        t->replay = 1;
        rc = ts_table_create(c, t->data_bin, opts->replay, NULL);
        if (rc == TS_EINVAL) {
            ts_value_t *info = NULL;
            if (ts_table_info(c, t->data_bin, &info) == 0)
                rc = 0;
            ts_value_free(info);
        }
        if (rc != 0) {
            ts__free(t);
            return rc;
        }
    }
    int64_t resumed = -1;
    rc = rl_trainer_read_version(t, &resumed);
    if (rc != 0) {
        ts__free(t);
        return rc;
    }
    if (pthread_mutex_init(&t->mu, NULL) != 0) {
        ts__free(t);
        return TS_ENOMEM;
    }
    if (pthread_mutex_init(&t->publish_mu, NULL) != 0) {
        pthread_mutex_destroy(&t->mu);
        ts__free(t);
        return TS_ENOMEM;
    }
    t->version = resumed;
    t->next_version = resumed + 1;
    t->stats.version = resumed;
    t->stats.resumed_from = resumed;
    t->stats.newest_seen = -1;
    *out = t;
    return 0;
}

int ts_rl_trainer_new(ts_rl_trainer_t **out, ts_client_t *c, const ts_rl_options_t *opts)
{
    ts_set_last_error(NULL);
    return ts__rl_done(rl_trainer_new(out, c, opts), "ts_rl_trainer_new");
}

void ts_rl_trainer_free(ts_rl_trainer_t *t)
{
    if (t == NULL)
        return;
    pthread_mutex_destroy(&t->publish_mu);
    pthread_mutex_destroy(&t->mu);
    ts__free(t);
}

int ts_rl_trainer_publish(ts_rl_trainer_t *t, const ts_value_t *params, int64_t *version)
{
    assert(t != NULL && params != NULL);
    ts_set_last_error(NULL);
    pthread_mutex_lock(&t->publish_mu);
    pthread_mutex_lock(&t->mu);
    /*
     * Experience tagged with a version above ours means versions went further before (a
     * daemon restarted without its snapshot lost the parameters bin while workers kept their
     * numbers); jump past them so workers, which ignore older versions, accept the next one.
     */
    int64_t v = t->next_version;
    if (t->stats.newest_seen >= v)
        v = t->stats.newest_seen + 1;
    t->next_version = v + 1;
    pthread_mutex_unlock(&t->mu);

    int rc = TS_ENOMEM;
    ts_value_t *rec = ts__rl_wrap("params", params, v);
    if (rec != NULL) {
        rc = ts_put(t->client, t->params_bin, rec, NULL);
        ts_value_free(rec);
    }

    pthread_mutex_lock(&t->mu);
    if (rc == 0) {
        if (v > t->version)
            t->version = v;
        t->stats.version = t->version;
        t->stats.published++;
    } else {
        t->stats.publish_failed++;
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->publish_mu);
    if (rc == 0 && version != NULL)
        *version = v;
    return ts__rl_done(rc, "ts_rl_trainer_publish");
}

int64_t ts_rl_trainer_version(ts_rl_trainer_t *t)
{
    assert(t != NULL);
    pthread_mutex_lock(&t->mu);
    int64_t v = t->version;
    pthread_mutex_unlock(&t->mu);
    return v;
}

void ts_rl_trainer_stats(ts_rl_trainer_t *t, ts_rl_trainer_stats_t *out)
{
    assert(t != NULL && out != NULL);
    pthread_mutex_lock(&t->mu);
    *out = t->stats;
    pthread_mutex_unlock(&t->mu);
}

/*
 * Sort the items of one get into a batch: keep the well-formed, fresh enough ones, count the
 * rest. Takes ownership of items (they end up in the batch or are freed). Returns 0 with *out
 * (which may hold 0 items; the caller frees it), or TS_ENOMEM (items freed).
 */
static int rl_trainer_filter(ts_rl_trainer_t *t, ts_items_t *items, ts_table_sample_t *sample,
                             ts_rl_batch_t **out)
{
    size_t n = sample != NULL ? ts_table_sample_count(sample) : ts_items_count(items);
    ts_rl_batch_t *b = ts__malloc(sizeof(*b) + n * sizeof(b->e[0]));
    if (b == NULL) {
        ts_items_free(items);
        ts_table_sample_free(sample);
        return TS_ENOMEM;
    }
    b->items = items;
    b->sample = sample;
    b->count = 0;
    b->dropped = 0;

    pthread_mutex_lock(&t->mu);
    /* Filtering happens at read time against the newest version, as in the original. */
    int64_t oldest_ok = INT64_MIN;
    if (t->tolerance != TS_RL_NO_FILTER && t->version >= 0)
        oldest_ok = t->version - t->tolerance;
    size_t stale = 0, malformed = 0;
    for (size_t i = 0; i < n; i++) {
        const ts_value_t *data;
        int64_t v;
        const ts_value_t *rec =
            sample != NULL ? ts_table_sample_value(sample, i) : ts_items_at(items, i);
        if (ts__rl_unwrap(rec, "data", &data, &v) != 0) {
            malformed++;
            continue;
        }
        if (v > t->stats.newest_seen)
            t->stats.newest_seen = v;
        if (v < oldest_ok) {
            stale++;
            continue;
        }
        b->e[b->count].data = data;
        b->e[b->count].version = v;
        b->e[b->count].key = sample != NULL ? ts_table_sample_key(sample, i) : 0;
        b->count++;
    }
    t->stats.dropped_stale += stale;
    t->stats.dropped_malformed += malformed;
    t->stats.received += b->count;
    pthread_mutex_unlock(&t->mu);
    b->dropped = stale + malformed;
    *out = b;
    return 0;
}

/*
 * collect from a replay table: draws by its sampler, waiting on the server (in slices of
 * RL_WAIT_SLICE_MS) while its rate limiter holds samples back.
 */
static int rl_trainer_sample(ts_rl_trainer_t *t, size_t max_items, int64_t deadline,
                             ts_rl_batch_t **out)
{
    size_t n = max_items == 0 ? 1 : max_items;
    if (n > TS_TABLE_SAMPLE_MAX)
        return ts__fail(TS_EINVAL, "max_items %zu: a replay table draws 1..%d at once", n,
                        TS_TABLE_SAMPLE_MAX);
    size_t dropped = 0;
    for (;;) {
        int64_t left = deadline < 0 ? RL_WAIT_SLICE_MS : deadline - ts__rl_now_ms();
        if (left < 0)
            left = 0;
        if (left > RL_WAIT_SLICE_MS)
            left = RL_WAIT_SLICE_MS;
        ts_table_sample_t *s = NULL;
        int rc = ts_table_sample(t->client, t->data_bin, n, (int)left, &s);
        if (rc == TS_ETIMEDOUT && !ts_last_error_no_reply() &&
            (deadline < 0 || ts__rl_now_ms() < deadline))
            continue;
        if (rc != 0)
            return rc;
        ts_rl_batch_t *b;
        if ((rc = rl_trainer_filter(t, NULL, s, &b)) != 0)
            return rc;
        dropped += b->dropped;
        if (b->count > 0) {
            b->dropped = dropped;
            *out = b;
            return 0;
        }
        ts_rl_batch_free(b);
        if (deadline >= 0 && ts__rl_now_ms() >= deadline)
            return TS_ETIMEDOUT;
    }
}

static int rl_trainer_collect(ts_rl_trainer_t *t, size_t max_items, int timeout_ms,
                              ts_rl_batch_t **out)
{
    int rc = ts__rl_timeout(timeout_ms, t->timeout_ms, &timeout_ms);
    if (rc != 0)
        return rc;
    int64_t deadline = ts__rl_deadline(timeout_ms);
    if (t->replay)
        return rl_trainer_sample(t, max_items, deadline, out);
    size_t dropped = 0;
    for (;;) {
        /*
         * A request is made only before the deadline, except the first get (timeout 0 checks
         * once) and the gets that go on taking what is already in the bin after everything taken
         * was dropped; and a request tensord does not answer ends the call with the client's own
         * TS_ETIMEDOUT. So the call returns within timeout_ms plus one request timeout (plus
         * that draining). ts_get has no server-side wait: its TS_ETIMEDOUT is the client's own.
         */
        ts_items_t *items = NULL;
        rc = ts_get(t->client, t->data_bin, max_items, &items);
        uint32_t remaining = 0;
        if (rc == 0) {
            remaining = ts_items_remaining(items);
            ts_rl_batch_t *b;
            rc = rl_trainer_filter(t, items, NULL, &b);
            if (rc != 0)
                return rc;
            dropped += b->dropped;
            if (b->count > 0) {
                b->dropped = dropped;
                *out = b;
                return 0;
            }
            ts_rl_batch_free(b);
        } else if (rc != TS_ENOENT) {
            return rc;
        }

        if (remaining > 0)
            continue; /* everything we took was dropped, but more is there already */
        int64_t left = deadline < 0 ? RL_WAIT_SLICE_MS : deadline - ts__rl_now_ms();
        if (left <= 0)
            return TS_ETIMEDOUT;
        if (left > RL_WAIT_SLICE_MS)
            left = RL_WAIT_SLICE_MS;
        /*
         * The bin is gone once emptied, and a missing bin has version 0, so waiting for a
         * version above 0 wakes on the first append after our get, including one that slipped
         * in between the get and this wait (the bin then already exists).
         */
        rc = ts_wait(t->client, t->data_bin, 0, (int)left, NULL, NULL);
        if (rc == TS_ETIMEDOUT && !ts_last_error_no_reply()) {
            /* tensord's answer: nothing came in the slice; at the deadline nothing more will. */
            if (deadline >= 0 && ts__rl_now_ms() >= deadline)
                return TS_ETIMEDOUT;
        } else if (rc != 0) {
            return rc;
        }
    }
}

int ts_rl_trainer_collect(ts_rl_trainer_t *t, size_t max_items, int timeout_ms, ts_rl_batch_t **out)
{
    assert(t != NULL && out != NULL);
    ts_set_last_error(NULL);
    int rc = rl_trainer_collect(t, max_items, timeout_ms, out);
    /* A request tensord did not answer keeps the client's message ("no reply within ..."). */
    if (rc == TS_ETIMEDOUT && !ts_last_error_no_reply())
        ts__set_errorf("no experience kept in '%s' within the timeout", t->data_bin);
    return ts__rl_done(rc, "ts_rl_trainer_collect");
}

size_t ts_rl_batch_count(const ts_rl_batch_t *b)
{
    assert(b != NULL);
    return b->count;
}

const ts_value_t *ts_rl_batch_data(const ts_rl_batch_t *b, size_t i)
{
    assert(b != NULL);
    return i < b->count ? b->e[i].data : NULL;
}

int64_t ts_rl_batch_version(const ts_rl_batch_t *b, size_t i)
{
    assert(b != NULL);
    return i < b->count ? b->e[i].version : -1;
}

uint64_t ts_rl_batch_key(const ts_rl_batch_t *b, size_t i)
{
    assert(b != NULL);
    return i < b->count ? b->e[i].key : 0;
}

size_t ts_rl_batch_dropped(const ts_rl_batch_t *b)
{
    assert(b != NULL);
    return b->dropped;
}

void ts_rl_batch_free(ts_rl_batch_t *b)
{
    if (b == NULL)
        return;
    ts_items_free(b->items);
    ts_table_sample_free(b->sample);
    ts__free(b);
}
