/*
 * Coordination primitives on the client (include/tensorshare/coord.h): one blocking request
 * each. ADD's body is encoded by src/msg_coord.c into the request's flat buffer; PUT_IF is an
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

/*
 * A blocking request for op whose whole body is the len bytes encode wrote into a fresh buffer
 * (the caller encodes into r->flat). A request the server may hold for wait_ms gets that much
 * more time on top of the request timeout. NULL and *rc on failure (the message set).
 */
static ts__req *flat_req(ts_client_t *c, uint8_t op, size_t len, uint32_t wait_ms, int *rc)
{
    ts__req *r = ts__api_req_new(c, TS__K_BLOCK, TS_OP_PING, NULL, rc);
    if (r == NULL)
        return NULL;
    r->op = op;
    r->flat = ts__malloc_aligned(len);
    if (r->flat == NULL) {
        ts__req_free(r);
        *rc = ts__fail(TS_ENOMEM, NULL);
        return NULL;
    }
    r->flat_cap = len;
    r->flat_len = len;
    r->small_len = 0;
    r->body_len = len;
    if (wait_ms > 0)
        r->deadline_ns =
            ts__now_ns() + ((uint64_t)wait_ms + (uint64_t)c->opts.request_timeout_ms) * 1000000u;
    return r;
}

int ts_add(ts_client_t *c, const char *name, int64_t delta, int64_t *value, uint64_t *version)
{
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_coord_req m = {.name = (const uint8_t *)name, .delta = delta};
    if ((rc = check_name(name, &m.name_len)) != 0)
        return rc;
    size_t len = ts__msg_add_req_size(m.name_len), n;
    ts__req *r = flat_req(c, TS_OP_ADD, len, 0, &rc);
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
    ts__enc e;
    rc = ts__record_plan(item, &e);
    if (rc != 0) {
        ts__req_free(r);
        return ts__fail(rc, "the item cannot be encoded: %s", ts_strerror(rc));
    }
    r->body_len = r->small_len + e.total;
    r->enc = e;
    r->borrowed = 1;
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
