/*
 * The bodies of the coordination primitives (msg_coord.h): ADD, TAKE and BARRIER requests, the
 * ADD and BARRIER states, and MGET's request and reply. PUT_IF is an upload with fixed fields
 * (msg.c, ts__msg_upload_*). Written field by field, read through the bounded reader.
 */
#include "msg.h"

#include <assert.h>

_Static_assert(TS_MSG_ADD_STATE_SIZE == 8 + 8, "ADD STATE layout");
_Static_assert(TS_MSG_BARRIER_STATE_SIZE == 8 + 4 + 4, "BARRIER STATE layout");
_Static_assert(TS_MSG_MGET_ENTRY == 1 + 1 + 2 + 4 + 8, "MGET entry layout");
_Static_assert(TS_MSG_PUT_IF_FIXED <= TS_MSG_MAX_UPLOAD_FIXED, "PUT_IF's fixed part fits");
_Static_assert(TS_MAX_CTRL_BODY >= 1 + TS_MAX_NAME_LEN + TS_MSG_BARRIER_FIXED,
               "the coordination requests fit the control body limit");

/* The fixed layouts after the name, by request. */
enum { COORD_ADD, COORD_TAKE, COORD_BARRIER };

static int coord_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len,
                        int which)
{
    /* ADD's delta and TAKE's or BARRIER's two u32 take the same 8 bytes. */
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, 8, &p);
    if (rc != 0)
        return rc;
    if (which == COORD_ADD) {
        ts__put_u64le(p, (uint64_t)m->delta);
    } else {
        ts__put_u32le(p, m->count);
        ts__put_u32le(p + 4, m->timeout_ms);
    }
    *len = 1 + m->name_len + 8;
    return 0;
}

static int coord_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m, int which)
{
    ts__rd r;
    const char *name = NULL;
    size_t name_len = 0;
    uint64_t delta = 0;
    uint32_t count = 0, timeout_ms = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &name, &name_len);
    if (which == COORD_ADD) {
        ts__rd_u64(&r, &delta);
    } else {
        ts__rd_u32(&r, &count);
        ts__rd_u32(&r, &timeout_ms);
    }
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    m->delta = (int64_t)delta;
    m->count = count;
    m->timeout_ms = timeout_ms;
    return 0;
}

size_t ts__msg_add_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_ADD_FIXED;
}

int ts__msg_add_req_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len)
{
    return coord_encode(out, cap, m, len, COORD_ADD);
}

int ts__msg_add_req_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m)
{
    return coord_decode(body, len, m, COORD_ADD);
}

size_t ts__msg_take_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_TAKE_FIXED;
}

int ts__msg_take_req_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len)
{
    return coord_encode(out, cap, m, len, COORD_TAKE);
}

int ts__msg_take_req_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m)
{
    return coord_decode(body, len, m, COORD_TAKE);
}

size_t ts__msg_barrier_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_BARRIER_FIXED;
}

int ts__msg_barrier_req_encode(uint8_t *out, size_t cap, const ts__msg_coord_req *m, size_t *len)
{
    return coord_encode(out, cap, m, len, COORD_BARRIER);
}

int ts__msg_barrier_req_decode(const uint8_t *body, size_t len, ts__msg_coord_req *m)
{
    return coord_decode(body, len, m, COORD_BARRIER);
}

int ts__msg_add_state_encode(uint8_t *out, size_t cap, const ts__msg_add_state *m, size_t *len)
{
    if (cap < TS_MSG_ADD_STATE_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, (uint64_t)m->value);
    ts__put_u64le(out + 8, m->version);
    *len = TS_MSG_ADD_STATE_SIZE;
    return 0;
}

int ts__msg_add_state_decode(const uint8_t *body, size_t len, ts__msg_add_state *m)
{
    if (len != TS_MSG_ADD_STATE_SIZE)
        return TS_EPROTO;
    m->value = (int64_t)ts__get_u64le(body);
    m->version = ts__get_u64le(body + 8);
    return 0;
}

int ts__msg_barrier_state_encode(uint8_t *out, size_t cap, const ts__msg_barrier_state *m,
                                 size_t *len)
{
    if (cap < TS_MSG_BARRIER_STATE_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->generation);
    ts__put_u32le(out + 8, m->parties);
    ts__put_u32le(out + 12, 0);
    *len = TS_MSG_BARRIER_STATE_SIZE;
    return 0;
}

int ts__msg_barrier_state_decode(const uint8_t *body, size_t len, ts__msg_barrier_state *m)
{
    if (len != TS_MSG_BARRIER_STATE_SIZE || ts__get_u32le(body + 12) != 0)
        return TS_EPROTO;
    m->generation = ts__get_u64le(body);
    m->parties = ts__get_u32le(body + 8);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * MGET
 */

size_t ts__msg_mget_req_size(uint32_t n, const size_t *name_lens)
{
    size_t size = TS_MSG_MGET_FIXED;
    for (uint32_t i = 0; i < n; i++)
        size += 1 + name_lens[i];
    return size;
}

int ts__msg_mget_req_encode(uint8_t *out, size_t cap, uint32_t n, uint32_t max_items,
                            const uint8_t *const *names, const size_t *name_lens, size_t *len)
{
    if (n == 0 || n > TS_MGET_MAX_NAMES)
        return TS_EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (name_lens[i] > TS_MAX_NAME_LEN)
            return TS_ENAMETOOLONG;
    /* n <= 256 names of <= 256 bytes each: the sum cannot overflow. */
    size_t need = ts__msg_mget_req_size(n, name_lens);
    if (need > cap)
        return TS_EMSGSIZE;
    ts__put_u32le(out, n);
    ts__put_u32le(out + 4, max_items);
    size_t off = TS_MSG_MGET_FIXED;
    for (uint32_t i = 0; i < n; i++) {
        out[off] = (uint8_t)name_lens[i];
        if (name_lens[i] > 0)
            memcpy(out + off + 1, names[i], name_lens[i]);
        off += 1 + name_lens[i];
    }
    *len = need;
    return 0;
}

int ts__msg_mget_req_decode(const uint8_t *body, size_t len, ts__msg_mget_req *m)
{
    ts__rd r;
    uint32_t n = 0, max_items = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u32(&r, &n);
    ts__rd_u32(&r, &max_items);
    if (r.err != 0 || n == 0 || n > TS_MGET_MAX_NAMES)
        return TS_EPROTO;
    const uint8_t *names = r.p;
    size_t names_len = r.left;
    for (uint32_t i = 0; i < n; i++) {
        const char *name;
        size_t nl;
        ts__rd_name(&r, &name, &nl);
    }
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    m->n = n;
    m->max_items = max_items;
    m->names = names;
    m->names_len = names_len;
    return 0;
}

int ts__msg_mget_req_next(const ts__msg_mget_req *m, size_t *off, const uint8_t **name,
                          size_t *name_len)
{
    if (*off >= m->names_len)
        return 0;
    size_t nl = m->names[*off];
    *name = m->names + *off + 1;
    *name_len = nl;
    *off += 1 + nl;
    return 1;
}

uint64_t ts__msg_mget_head_size(uint32_t n)
{
    return ts__align_up(TS_MSG_MGET_REP_FIXED + (size_t)n * TS_MSG_MGET_ENTRY, TS__ALIGN);
}

int ts__msg_mget_head_encode(uint8_t *out, size_t cap, uint32_t n, const uint8_t *found,
                             const uint64_t *block_lens, size_t *len)
{
    if (n > TS_MGET_MAX_NAMES)
        return TS_EINVAL;
    for (uint32_t i = 0; i < n; i++) {
        if (found[i] > TS_MGET_FOUND || (found[i] == TS_MGET_MISSING && block_lens[i] != 0) ||
            (found[i] == TS_MGET_FOUND &&
             (block_lens[i] % TS__ALIGN != 0 || block_lens[i] < ts__items_head_size(0))))
            return TS_EINVAL;
    }
    size_t head = (size_t)ts__msg_mget_head_size(n);
    if (head > cap)
        return TS_EMSGSIZE;
    memset(out, 0, head);
    ts__put_u32le(out, n);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *e = out + TS_MSG_MGET_REP_FIXED + (size_t)i * TS_MSG_MGET_ENTRY;
        e[0] = found[i];
        ts__put_u64le(e + 8, block_lens[i]);
    }
    *len = head;
    return 0;
}

int ts__msg_mget_rep_decode(const uint8_t *body, size_t len, ts__msg_mget_rep *m)
{
    if (len < TS_MSG_MGET_REP_FIXED)
        return TS_EPROTO;
    uint32_t n = ts__get_u32le(body);
    if (n > TS_MGET_MAX_NAMES || ts__get_u32le(body + 4) != 0)
        return TS_EPROTO;
    size_t head = (size_t)ts__msg_mget_head_size(n);
    if (ts__msg_head_check(body, len, TS_MSG_MGET_REP_FIXED + (uint64_t)n * TS_MSG_MGET_ENTRY,
                           head) != 0)
        return TS_EPROTO;
    uint64_t off = head;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *e = body + TS_MSG_MGET_REP_FIXED + (size_t)i * TS_MSG_MGET_ENTRY;
        uint8_t found = e[0];
        uint64_t blen = ts__get_u64le(e + 8);
        if (found > TS_MGET_FOUND || e[1] != 0 || ts__get_u16le(e + 2) != 0 ||
            ts__get_u32le(e + 4) != 0)
            return TS_EPROTO;
        if (found == TS_MGET_MISSING) {
            if (blen != 0)
                return TS_EPROTO;
            continue;
        }
        /* Checked against what is left before it is added: no overflow. */
        if (blen % TS__ALIGN != 0 || blen > len - off)
            return TS_EPROTO;
        ts__msg_items it;
        if (ts__msg_items_decode(body + off, (size_t)blen, &it) != 0)
            return TS_EPROTO;
        off += blen;
    }
    if (off != len)
        return TS_EPROTO;
    m->n = n;
    m->body = body;
    m->len = len;
    return 0;
}

void ts__msg_mget_rep_get(const ts__msg_mget_rep *m, uint32_t i, int *found, ts__msg_items *items)
{
    assert(i < m->n);
    uint64_t off = ts__msg_mget_head_size(m->n);
    for (uint32_t k = 0;; k++) {
        const uint8_t *e = m->body + TS_MSG_MGET_REP_FIXED + (size_t)k * TS_MSG_MGET_ENTRY;
        uint64_t blen = ts__get_u64le(e + 8);
        if (k == i) {
            *found = e[0] == TS_MGET_FOUND;
            if (*found) {
                int rc = ts__msg_items_decode(m->body + off, (size_t)blen, items);
                assert(rc == 0);
                (void)rc;
            }
            return;
        }
        off += blen;
    }
}
