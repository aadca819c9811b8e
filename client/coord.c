/*
 * Coordination primitives on the client (include/tensorshare/coord.h): one blocking request
 * each. ADD's, TAKE's, MGET's and BARRIER's bodies are encoded by src/msg_coord.c into the
 * request's flat buffer; PUT_IF is an
 * upload like PUT (the name and the expected version in the request's head, the record sent
 * from the caller's memory); reply.c parses the replies (ADD STATE into ts__req.stream.add, a
 * VERSION_MISMATCH's bin state into res, as WAIT's TIMEOUT).
 *
 * Threads: blocking calls of a client like any other (any thread, never from a callback).
 */
#include "tensorshare/coord.h"

#include "internal.h"

#include "msg.h"

/* Check a bin name: at most 255 bytes. 0 and *len, or the error. */
static int check_name(const char *s, size_t *len)
{
    if (s == NULL)
        return ts__fail(TS_EINVAL, "no bin name");
    size_t n = strlen(s);
    if (n > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENAMETOOLONG, "bin name of %zu bytes (at most %d)", n, TS_MAX_NAME_LEN);
    *len = n;
    return 0;
}

int ts_add(ts_client_t *c, const char *name, int64_t delta, int64_t *value, uint64_t *version)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_coord_req m = {.name = (const uint8_t *)name, .delta = delta};
    if ((rc = check_name(name, &m.name_len)) != 0)
        return rc;
    size_t len = ts__msg_add_req_size(m.name_len), n;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_ADD, len, NULL, NULL, 0, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_add_req_encode(r->flat, len, &m, &n); /* the name was checked, room is exact */
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    if (value != NULL)
        *value = done->stream.add.value;
    if (version != NULL)
        *version = done->stream.add.version;
    ts__req_free(done);
    return 0;
}

int ts_put_if(ts_client_t *c, const char *name, uint64_t expected_version, const ts_value_t *item,
              uint64_t *version)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t nl;
    if ((rc = check_name(name, &nl)) != 0)
        return rc;
    if (item == NULL)
        return ts__fail(TS_EINVAL, "no item to put");
    /* The head (name, then the expected version) is the request's; the record is the caller's. */
    ts__req *r = ts__api_req_new(c, TS__K_BLOCK, TS_OP_PUT_IF, name, &rc);
    if (r == NULL)
        return rc;
    ts__put_u64le(ts__req_upload_fixed(r), expected_version);
    /* As ts_put: from the caller's memory, or compressed whole (head included) when agreed. */
    rc = ts__api_attach_record(c, r, item, TS_BORROW);
    if (rc != 0) {
        ts__req_free(r);
        return ts__fail(rc, "the item cannot be encoded: %s", ts__record_plan_why(rc));
    }
    ts__req *done;
    rc = ts__api_run_blocking(c, r, &done);
    if (done == NULL)
        return rc;
    /* Success, or VERSION_MISMATCH with the bin's current state (its body has no message). */
    uint64_t cur = done->res.version;
    ts__req_free(done);
    if (version != NULL)
        *version = cur;
    if (rc == TS_ECONFLICT)
        ts__fail(rc, "bin '%s' is at version %llu, not %llu", name, (unsigned long long)cur,
                 (unsigned long long)expected_version);
    return rc;
}

int ts_take(ts_client_t *c, const char *name, size_t max_items, int timeout_ms, ts_items_t **out)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_coord_req m = {.name = (const uint8_t *)name,
                           .count = max_items > UINT32_MAX ? UINT32_MAX : (uint32_t)max_items};
    if ((rc = check_name(name, &m.name_len)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &m.timeout_ms)) != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no place for the items");
    size_t len = ts__msg_take_req_size(m.name_len), n;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_TAKE, len, NULL, NULL, m.timeout_ms, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_take_req_encode(r->flat, len, &m, &n);
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    *out = done->res.items;
    done->res.items = NULL;
    ts__req_free(done);
    return 0;
}

/* A ts_items_t of n values moved out of all (from index first), with version and remaining. */
static ts_items_t *items_slice(ts_items_t *all, size_t first, uint32_t n, uint64_t version,
                               uint32_t remaining)
{
    ts_items_t *it = ts__calloc(1, sizeof(*it) + (size_t)n * sizeof(ts_value_t *));
    if (it == NULL)
        return NULL;
    for (uint32_t i = 0; i < n; i++) {
        it->items[i] = all->items[first + i];
        all->items[first + i] = NULL;
    }
    it->count = n;
    it->version = version;
    it->remaining = remaining;
    return it;
}

int ts_mget(ts_client_t *c, const char *const *names, size_t n, size_t max_items, ts_items_t **out)
{
    if (c != NULL && c->cl != NULL)
        return ts__cluster_mget(c, names, n, max_items, out); /* split by shard, merged in order */
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if (n == 0 || n > TS_MGET_MAX)
        return ts__fail(TS_EINVAL, "MGET of %zu names: expected 1 to %d", n, TS_MGET_MAX);
    if (names == NULL || out == NULL)
        return ts__fail(TS_EINVAL, "MGET needs %s (got NULL)",
                        names == NULL ? "the names" : "an out pointer");
    const uint8_t *ptrs[TS_MGET_MAX];
    size_t lens[TS_MGET_MAX];
    for (size_t i = 0; i < n; i++) {
        if ((rc = check_name(names[i], &lens[i])) != 0)
            return rc;
        ptrs[i] = (const uint8_t *)names[i];
    }
    size_t len = ts__msg_mget_req_size((uint32_t)n, lens), wrote;
    if (len > TS_MAX_CTRL_BODY)
        return ts__fail(TS_EMSGSIZE, "MGET body of %zu bytes exceeds the control limit (%d)", len,
                        TS_MAX_CTRL_BODY);
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_MGET, len, NULL, NULL, 0, &rc);
    if (r == NULL)
        return rc;
    uint32_t mi = max_items > UINT32_MAX ? UINT32_MAX : (uint32_t)max_items;
    (void)ts__msg_mget_req_encode(r->flat, len, (uint32_t)n, mi, ptrs, lens, &wrote);
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    ts_items_t *all = done->res.items;
    if (all->remaining != n) {
        ts__req_free(done);
        return ts__fail(TS_EPROTO, "MGET reply for %u bins, not %zu", all->remaining, n);
    }
    /* Split the records into one ts_items_t per found bin; nothing is written until all are. */
    ts__mget_head *heads = ts__items_mget_heads(all);
    ts_items_t *res[TS_MGET_MAX];
    size_t first = 0;
    for (size_t i = 0; i < n; i++) {
        res[i] = NULL;
        if (!heads[i].found)
            continue;
        res[i] = items_slice(all, first, heads[i].n_items, heads[i].version, heads[i].remaining);
        first += heads[i].n_items;
        if (res[i] == NULL) {
            for (size_t k = 0; k < i; k++)
                ts_items_free(res[k]);
            ts__req_free(done);
            return ts__fail(TS_ENOMEM, NULL);
        }
    }
    /* The moved-out slots are NULL: freeing the container frees only what is left. */
    ts__req_free(done);
    for (size_t i = 0; i < n; i++)
        out[i] = res[i];
    return 0;
}

int ts_barrier(ts_client_t *c, const char *name, uint32_t parties, int timeout_ms,
               uint64_t *generation)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_coord_req m = {.name = (const uint8_t *)name, .count = parties};
    if ((rc = check_name(name, &m.name_len)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &m.timeout_ms)) != 0)
        return rc;
    size_t len = ts__msg_barrier_req_size(m.name_len), n;
    ts__req *r =
        ts__api_flat_req(c, TS__K_BLOCK, TS_OP_BARRIER, len, NULL, NULL, m.timeout_ms, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_barrier_req_encode(r->flat, len, &m, &n);
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    if (generation != NULL)
        *generation = done->stream.barrier.generation;
    ts__req_free(done);
    return 0;
}
