/*
 * RL helpers (include/tensorshare/rl.h): a trainer and workers built on the public client API.
 * This file holds the options and the helpers both sides use (rl_internal.h).
 *
 * Only the allocation hooks come from the shared core (hooks.h), so that tests can count and
 * fail every allocation; everything else goes through tensorshare.h like any user program.
 */
#include "rl_internal.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Shared helpers
 */

void ts_rl_options_init(ts_rl_options_t *opts)
{
    assert(opts != NULL);
    memset(opts, 0, sizeof(*opts));
    opts->params_bin = "parameters";
    opts->data_bin = "data";
    opts->staleness_tolerance = 0;
    opts->max_in_flight = RL_DEFAULT_IN_FLIGHT;
    opts->max_in_flight_bytes = RL_DEFAULT_IN_FLIGHT_BYTES;
    opts->timeout_ms = RL_DEFAULT_TIMEOUT_MS;
    opts->replay_priority = 1.0;
}

int ts__rl_timeout(int timeout_ms, int dflt, int *out)
{
    if (timeout_ms == TS_TIMEOUT_DEFAULT)
        timeout_ms = dflt;
    if (timeout_ms == TS_TIMEOUT_INFINITE) {
        *out = -1;
        return 0;
    }
    if (timeout_ms < 0)
        return ts__fail(TS_EINVAL,
                        "timeout_ms %d: expected milliseconds >= 0, TS_TIMEOUT_DEFAULT or "
                        "TS_TIMEOUT_INFINITE",
                        timeout_ms);
    *out = timeout_ms;
    return 0;
}

int ts__rl_done(int rc, const char *what)
{
    if (rc < 0 && ts_last_error()[0] == '\0')
        ts__set_errorf("%s: %s", what, ts_strerror(rc));
    return rc;
}

/*
 * Write prefix + name into out (TS_MAX_NAME_LEN + 1 bytes). Returns 0, TS_EINVAL for an empty name,
 * or TS_ENAMETOOLONG.
 */
int ts__rl_bin_name(char *out, const char *prefix, const char *name)
{
    size_t lp = prefix != NULL ? strlen(prefix) : 0;
    size_t ln = name != NULL ? strlen(name) : 0;
    if (lp + ln == 0)
        return TS_EINVAL;
    if (lp + ln > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    if (lp > 0)
        memcpy(out, prefix, lp);
    if (ln > 0)
        memcpy(out + lp, name, ln);
    out[lp + ln] = '\0';
    return 0;
}

/* Monotonic milliseconds; deadlines are computed on this clock. */
int64_t ts__rl_now_ms(void)
{
    return (int64_t)(ts__now_ns() / 1000000u);
}

/* Wait on cond (monotonic) until woken or until deadline_ms (< 0: none). 0 or ETIMEDOUT. */
int ts__rl_cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t deadline_ms)
{
    return ts__cond_wait_until(cond, mu,
                               deadline_ms < 0 ? UINT64_MAX : (uint64_t)deadline_ms * 1000000u);
}

/* The deadline for a timeout in ms: -1 for "no limit" (timeout_ms < 0). */
int64_t ts__rl_deadline(int timeout_ms)
{
    if (timeout_ms < 0)
        return -1;
    return ts__rl_now_ms() + timeout_ms;
}

/*
 * Build {key: <borrowed view of payload>, "version": version}, the record layout of both bins.
 * Returns NULL on allocation failure (or when payload cannot be wrapped).
 */
ts_value_t *ts__rl_wrap(const char *key, const ts_value_t *payload, int64_t version)
{
    ts_value_t *rec = ts_map_new();
    if (rec == NULL)
        return NULL;
    if (ts_map_set(rec, key, ts_value_borrow(payload)) != 0 ||
        ts_map_set(rec, "version", ts_int_new(version)) != 0) {
        ts_value_free(rec);
        return NULL;
    }
    return rec;
}

/*
 * Read {key: <value>, "version": int} from a received record. Returns 0 with *payload and
 * *version set, or TS_EBADRECORD when the record does not have that shape.
 */
int ts__rl_unwrap(const ts_value_t *rec, const char *key, const ts_value_t **payload,
                  int64_t *version)
{
    if (rec == NULL || ts_value_type(rec) != TS_TYPE_MAP)
        return TS_EBADRECORD;
    const ts_value_t *p = ts_map_get(rec, key);
    int64_t v;
    if (p == NULL || ts_map_get_int(rec, "version", &v) != 0)
        return TS_EBADRECORD;
    *payload = p;
    *version = v;
    return 0;
}
