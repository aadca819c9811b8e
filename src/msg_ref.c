/*
 * The by-reference bodies (see msg.h): the REF_ITEMS reply of GET_REF and PEEK_REF, and the
 * PUT_FD/APPEND_FD request. The descriptors themselves travel beside the bytes (SCM_RIGHTS);
 * these functions only say how many a body names and where each record lies.
 */
#include "msg.h"

_Static_assert(TS_MSG_REF_FIXED == 8 + 4 + 4 + 4 + 4, "REF_ITEMS fixed part");
_Static_assert(TS_MSG_REF_ENTRY == 1 + 1 + 2 + 4 + 8 + 8 + 8, "REF_ITEMS entry");
_Static_assert(TS_MAX_CTRL_BODY >= 1 + TS_MAX_NAME_LEN + TS_MSG_PUT_FD_FIXED,
               "a PUT_FD request fits the control body limit");

uint64_t ts__msg_ref_head_size(uint32_t n)
{
    /* n < 2^32, so this cannot wrap in 64 bits. */
    return ((uint64_t)TS_MSG_REF_FIXED + (uint64_t)TS_MSG_REF_ENTRY * n + (TS__ALIGN - 1)) &
           ~(uint64_t)(TS__ALIGN - 1);
}

/* 0 when entry e can be encoded or was validly decoded (the offset of inline ones aside). */
static int entry_check(const ts__msg_ref_entry *e)
{
    if ((e->flags & ~TS_REF_LIVE) != 0)
        return -1;
    if (e->where == TS_REF_INLINE)
        return e->file_len == 0 ? 0 : -1;
    if (e->where != TS_REF_FD)
        return -1;
    uint64_t end;
    if (e->offset % TS_REF_FILE_ALIGN != 0 || __builtin_add_overflow(e->offset, e->length, &end) ||
        end > e->file_len)
        return -1;
    return 0;
}

int ts__msg_ref_size(uint32_t n, const ts__msg_ref_entry *e, uint64_t *size)
{
    if (n > TS_MAX_REF_ITEMS)
        return TS_EINVAL;
    uint64_t total = ts__msg_ref_head_size(n);
    for (uint32_t i = 0; i < n; i++) {
        if (e[i].where != TS_REF_INLINE) {
            if (e[i].where != TS_REF_FD)
                return TS_EINVAL;
            continue;
        }
        if (ts__msg_add_padded(&total, e[i].length) != 0)
            return TS_EMSGSIZE;
    }
    if (total > SIZE_MAX)
        return TS_EMSGSIZE;
    *size = total;
    return 0;
}

int ts__msg_ref_head_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t remaining,
                            uint32_t n, ts__msg_ref_entry *e, size_t *len)
{
    uint64_t total;
    int rc = ts__msg_ref_size(n, e, &total);
    if (rc != 0)
        return rc;
    uint64_t head = ts__msg_ref_head_size(n);
    uint32_t n_fds = 0;
    uint64_t off = head;
    for (uint32_t i = 0; i < n; i++) {
        if (e[i].where == TS_REF_INLINE)
            e[i].file_len = 0;
        if (entry_check(&e[i]) != 0)
            return TS_EINVAL;
    }
    if (head > cap)
        return TS_EMSGSIZE;
    memset(out, 0, (size_t)head);
    for (uint32_t i = 0; i < n; i++) {
        uint8_t *p = out + TS_MSG_REF_FIXED + (size_t)TS_MSG_REF_ENTRY * i;
        if (e[i].where == TS_REF_INLINE) {
            /* The size check above bounds every running offset by total. */
            e[i].offset = off;
            off += e[i].length + ts__msg_items_pad(e[i].length);
        } else {
            n_fds++;
        }
        p[0] = e[i].where;
        p[1] = e[i].flags;
        ts__put_u64le(p + 8, e[i].offset);
        ts__put_u64le(p + 16, e[i].length);
        ts__put_u64le(p + 24, e[i].file_len);
    }
    ts__put_u64le(out, version);
    ts__put_u32le(out + 8, n);
    ts__put_u32le(out + 12, remaining);
    ts__put_u32le(out + 16, n_fds);
    *len = (size_t)head;
    return 0;
}

int ts__msg_ref_encode(uint8_t *out, size_t cap, uint64_t version, uint32_t remaining, uint32_t n,
                       ts__msg_ref_entry *e, const uint8_t *const *recs, size_t *len)
{
    uint64_t total;
    int rc = ts__msg_ref_size(n, e, &total);
    if (rc != 0)
        return rc;
    if (total > cap)
        return TS_EMSGSIZE;
    size_t off;
    rc = ts__msg_ref_head_encode(out, cap, version, remaining, n, e, &off);
    if (rc != 0)
        return rc;
    /* total <= cap bounds every running offset: no record can fail to fit. */
    for (uint32_t i = 0; i < n; i++)
        if (e[i].where == TS_REF_INLINE)
            (void)ts__msg_put_padded(out, cap, &off, recs[i], e[i].length);
    *len = off;
    return 0;
}

/* Read entry i of a body whose head has been checked to lie inside it. */
static void entry_read(const uint8_t *body, uint32_t i, ts__msg_ref_entry *e, uint32_t *rsv)
{
    const uint8_t *p = body + TS_MSG_REF_FIXED + (size_t)TS_MSG_REF_ENTRY * i;
    e->where = p[0];
    e->flags = p[1];
    *rsv = (uint32_t)ts__get_u16le(p + 2) | ts__get_u32le(p + 4);
    e->offset = ts__get_u64le(p + 8);
    e->length = ts__get_u64le(p + 16);
    e->file_len = ts__get_u64le(p + 24);
}

int ts__msg_ref_decode(const uint8_t *body, size_t len, ts__msg_ref_items *m)
{
    if (len < TS_MSG_REF_FIXED)
        return TS_EPROTO;
    uint64_t version = ts__get_u64le(body);
    uint32_t n = ts__get_u32le(body + 8);
    uint32_t remaining = ts__get_u32le(body + 12);
    uint32_t n_fds = ts__get_u32le(body + 16);
    if (ts__get_u32le(body + 20) != 0 || n > TS_MAX_REF_ITEMS)
        return TS_EPROTO;
    uint64_t head = ts__msg_ref_head_size(n);
    if (ts__msg_head_check(body, len, TS_MSG_REF_FIXED + (uint64_t)TS_MSG_REF_ENTRY * n, head) != 0)
        return TS_EPROTO;
    uint64_t off = head;
    uint32_t fds = 0;
    for (uint32_t i = 0; i < n; i++) {
        ts__msg_ref_entry e;
        uint32_t rsv;
        entry_read(body, i, &e, &rsv);
        if (rsv != 0 || entry_check(&e) != 0)
            return TS_EPROTO;
        if (e.where == TS_REF_FD) {
            fds++;
            continue;
        }
        /* Inline records lie one after the other in entry order, each padded to 64. */
        if (e.offset != off || ts__msg_skip_padded(body, len, &off, e.length) != 0)
            return TS_EPROTO;
    }
    if (off != len || fds != n_fds)
        return TS_EPROTO;
    m->version = version;
    m->n_items = n;
    m->remaining = remaining;
    m->n_fds = n_fds;
    m->body = body;
    m->len = len;
    return 0;
}

void ts__msg_ref_entry_get(const ts__msg_ref_items *m, uint32_t i, ts__msg_ref_entry *e)
{
    uint32_t rsv;
    entry_read(m->body, i, e, &rsv);
}

/* ---------------------------------------------------------------------------------------------
 * PUT_FD / APPEND_FD
 */

size_t ts__msg_put_fd_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_PUT_FD_FIXED;
}

int ts__msg_put_fd_req_encode(uint8_t *out, size_t cap, const ts__msg_put_fd_req *m, size_t *len)
{
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_PUT_FD_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u64le(p, m->rec_len);
    *len = ts__msg_put_fd_req_size(m->name_len);
    return 0;
}

int ts__msg_put_fd_req_decode(const uint8_t *body, size_t len, ts__msg_put_fd_req *m)
{
    ts__rd r;
    const char *name;
    size_t name_len;
    uint64_t rec_len = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &name, &name_len);
    ts__rd_u64(&r, &rec_len);
    if (r.err != 0 || r.left != 0)
        return TS_EPROTO;
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    m->rec_len = rec_len;
    return 0;
}

unsigned ts__msg_request_fds(uint8_t op)
{
    return op == TS_OP_PUT_FD || op == TS_OP_APPEND_FD ? 1u : 0u;
}
