/*
 * The stream bodies (see msg.h): the requests of opcodes 0x16 to 0x1F and the four fixed state
 * replies and ENTRIES reply they answer with (docs/PROTOCOL.md 8.23 to 8.32). STREAM_APPEND's
 * body is PUT's and STREAM_INFO's a plain name: they use those codecs.
 */
#include "msg.h"

#include <assert.h>

_Static_assert(TS_MSG_STREAM_CREATE_FIXED == 8 + 8 + 4 + 4 + 4 + 4, "STREAM_CREATE fixed part");
_Static_assert(TS_MSG_STREAM_JOIN_FIXED == 1 + 1 + 2 + 4, "STREAM_JOIN fixed part");
_Static_assert(TS_MSG_STREAM_READ_FIXED == 8 + 4 + 4, "STREAM_READ fixed part");
_Static_assert(TS_MSG_STREAM_ACK_FIXED == 8 + 8 + 4, "STREAM_ACK fixed part");
_Static_assert(TS_MSG_STREAM_RANGE_FIXED == 8 + 4 + 4, "STREAM_RANGE fixed part");
_Static_assert(TS_MSG_STREAM_STATE_SIZE == 3 * 8 + 6 * 4, "STREAM STATE layout");
_Static_assert(TS_MSG_STREAM_APPEND_SIZE == 2 * 8 + 2 * 4, "APPEND STATE layout");
_Static_assert(TS_MSG_STREAM_JOIN_SIZE == 3 * 8 + 4 * 4, "JOIN STATE layout");
_Static_assert(TS_MSG_STREAM_ACK_SIZE == 2 * 8 + 2 * 4, "ACK STATE layout");
_Static_assert(TS_MSG_STREAM_ENTRIES_FIXED == 3 * 8 + 4 + 4, "ENTRIES fixed part");
_Static_assert(TS_MSG_STREAM_ENTRY_HEAD == 3 * 8 + 4 + 2 + 1 + 1, "ENTRIES entry head");
_Static_assert(TS_STREAM_MAX_ID_LEN <= 255, "group and member names travel with a u8 length");
_Static_assert(3 * (1 + 255) + TS_MSG_STREAM_ACK_FIXED <= TS_MAX_CTRL_BODY &&
                   3 * (1 + 255) + TS_MSG_STREAM_READ_FIXED <= TS_MAX_CTRL_BODY &&
                   3 * (1 + 255) + TS_MSG_STREAM_JOIN_FIXED <= TS_MAX_CTRL_BODY &&
                   1 + 255 + TS_MSG_STREAM_CREATE_FIXED <= TS_MAX_CTRL_BODY,
               "the largest stream control request fits the control body limit");

/* ---------------------------------------------------------------------------------------------
 * Requests with a name and fixed fields: CREATE, MARK, CREDIT, RANGE
 */

size_t ts__msg_stream_create_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_STREAM_CREATE_FIXED;
}

int ts__msg_stream_create_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_create_req *m,
                                     size_t *len)
{
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_STREAM_CREATE_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u64le(p, m->max_entries);
    ts__put_u64le(p + 8, m->max_bytes);
    ts__put_u32le(p + 16, m->max_age_ms);
    ts__put_u32le(p + 20, m->window);
    ts__put_u32le(p + 24, m->lease_ms);
    ts__put_u32le(p + 28, m->flags);
    *len = ts__msg_stream_create_req_size(m->name_len);
    return 0;
}

int ts__msg_stream_create_req_decode(const uint8_t *body, size_t len, ts__msg_stream_create_req *m)
{
    ts__rd r;
    ts__msg_stream_create_req d;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u64(&r, &d.max_entries);
    ts__rd_u64(&r, &d.max_bytes);
    ts__rd_u32(&r, &d.max_age_ms);
    ts__rd_u32(&r, &d.window);
    ts__rd_u32(&r, &d.lease_ms);
    ts__rd_u32(&r, &d.flags);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

size_t ts__msg_stream_mark_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_STREAM_MARK_FIXED;
}

int ts__msg_stream_mark_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_mark_req *m,
                                   size_t *len)
{
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_STREAM_MARK_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u64le(p, m->tag);
    *len = ts__msg_stream_mark_req_size(m->name_len);
    return 0;
}

int ts__msg_stream_mark_req_decode(const uint8_t *body, size_t len, ts__msg_stream_mark_req *m)
{
    ts__rd r;
    ts__msg_stream_mark_req d;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u64(&r, &d.tag);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

size_t ts__msg_stream_credit_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_STREAM_CREDIT_FIXED;
}

int ts__msg_stream_credit_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_credit_req *m,
                                     size_t *len)
{
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_STREAM_CREDIT_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, m->timeout_ms);
    *len = ts__msg_stream_credit_req_size(m->name_len);
    return 0;
}

int ts__msg_stream_credit_req_decode(const uint8_t *body, size_t len, ts__msg_stream_credit_req *m)
{
    ts__rd r;
    ts__msg_stream_credit_req d;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u32(&r, &d.timeout_ms);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

size_t ts__msg_stream_range_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_STREAM_RANGE_FIXED;
}

int ts__msg_stream_range_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_range_req *m,
                                    size_t *len)
{
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_STREAM_RANGE_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u64le(p, m->after_id);
    ts__put_u32le(p + 8, m->max_entries);
    ts__put_u32le(p + 12, m->timeout_ms);
    *len = ts__msg_stream_range_req_size(m->name_len);
    return 0;
}

int ts__msg_stream_range_req_decode(const uint8_t *body, size_t len, ts__msg_stream_range_req *m)
{
    ts__rd r;
    ts__msg_stream_range_req d;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u64(&r, &d.after_id);
    ts__rd_u32(&r, &d.max_entries);
    ts__rd_u32(&r, &d.timeout_ms);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Requests addressed to a member: JOIN, READ, ACK, LEAVE
 */

/* The four layouts of ts__msg_stream_member_req; the value is the fixed tail's size. */
enum {
    MEMBER_LEAVE = 0,
    MEMBER_JOIN = TS_MSG_STREAM_JOIN_FIXED,
    MEMBER_READ = TS_MSG_STREAM_READ_FIXED,
    MEMBER_ACK = TS_MSG_STREAM_ACK_FIXED
};

static size_t member_size(size_t name_len, size_t group_len, size_t member_len, size_t tail)
{
    return 1 + name_len + 1 + group_len + 1 + member_len + tail;
}

size_t ts__msg_stream_join_req_size(size_t name_len, size_t group_len, size_t member_len)
{
    return member_size(name_len, group_len, member_len, MEMBER_JOIN);
}

size_t ts__msg_stream_read_req_size(size_t name_len, size_t group_len, size_t member_len)
{
    return member_size(name_len, group_len, member_len, MEMBER_READ);
}

size_t ts__msg_stream_ack_req_size(size_t name_len, size_t group_len, size_t member_len)
{
    return member_size(name_len, group_len, member_len, MEMBER_ACK);
}

size_t ts__msg_stream_leave_req_size(size_t name_len, size_t group_len, size_t member_len)
{
    return member_size(name_len, group_len, member_len, MEMBER_LEAVE);
}

static int member_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m, size_t *len,
                         size_t tail)
{
    if (m->name_len > TS_MAX_NAME_LEN || m->group_len > TS_STREAM_MAX_ID_LEN ||
        m->member_len > TS_STREAM_MAX_ID_LEN)
        return TS_ENAMETOOLONG;
    /* Only LEAVE may name no member (the whole group); no request may name no group. */
    if (m->group_len == 0 || (m->member_len == 0 && tail != MEMBER_LEAVE))
        return TS_EINVAL;
    size_t need = member_size(m->name_len, m->group_len, m->member_len, tail);
    if (need > cap)
        return TS_EMSGSIZE;
    uint8_t *p = out;
    p += ts__msg_put_name(p, m->name, m->name_len);
    p += ts__msg_put_name(p, m->group, m->group_len);
    p += ts__msg_put_name(p, m->member, m->member_len);
    if (tail == MEMBER_JOIN) {
        p[0] = m->start;
        p[1] = 0;
        ts__put_u16le(p + 2, 0);
        ts__put_u32le(p + 4, m->lease_ms);
    } else if (tail == MEMBER_READ) {
        ts__put_u64le(p, m->ack_through);
        ts__put_u32le(p + 8, m->max_entries);
        ts__put_u32le(p + 12, m->timeout_ms);
    } else if (tail == MEMBER_ACK) {
        ts__put_u64le(p, m->first);
        ts__put_u64le(p + 8, m->last);
        ts__put_u32le(p + 16, m->rows);
    }
    *len = need;
    return 0;
}

static int member_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m, size_t tail)
{
    ts__rd r;
    ts__msg_stream_member_req d;
    uint8_t rsv8 = 0;
    uint16_t rsv16 = 0;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__msg_rd_str(&r, 1, &d.group, &d.group_len);
    ts__msg_rd_str(&r, tail == MEMBER_LEAVE ? 0 : 1, &d.member, &d.member_len);
    if (tail == MEMBER_JOIN) {
        ts__rd_u8(&r, &d.start);
        ts__rd_u8(&r, &rsv8);
        ts__rd_u16(&r, &rsv16);
        ts__rd_u32(&r, &d.lease_ms);
    } else if (tail == MEMBER_READ) {
        ts__rd_u64(&r, &d.ack_through);
        ts__rd_u32(&r, &d.max_entries);
        ts__rd_u32(&r, &d.timeout_ms);
    } else if (tail == MEMBER_ACK) {
        ts__rd_u64(&r, &d.first);
        ts__rd_u64(&r, &d.last);
        ts__rd_u32(&r, &d.rows);
    }
    if (ts__msg_rd_end(&r) != 0 || rsv8 != 0 || rsv16 != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

int ts__msg_stream_join_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                   size_t *len)
{
    return member_encode(out, cap, m, len, MEMBER_JOIN);
}

int ts__msg_stream_read_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                   size_t *len)
{
    return member_encode(out, cap, m, len, MEMBER_READ);
}

int ts__msg_stream_ack_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                  size_t *len)
{
    return member_encode(out, cap, m, len, MEMBER_ACK);
}

int ts__msg_stream_leave_req_encode(uint8_t *out, size_t cap, const ts__msg_stream_member_req *m,
                                    size_t *len)
{
    return member_encode(out, cap, m, len, MEMBER_LEAVE);
}

int ts__msg_stream_join_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m)
{
    return member_decode(body, len, m, MEMBER_JOIN);
}

int ts__msg_stream_read_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m)
{
    return member_decode(body, len, m, MEMBER_READ);
}

int ts__msg_stream_ack_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m)
{
    return member_decode(body, len, m, MEMBER_ACK);
}

int ts__msg_stream_leave_req_decode(const uint8_t *body, size_t len, ts__msg_stream_member_req *m)
{
    return member_decode(body, len, m, MEMBER_LEAVE);
}

/* ---------------------------------------------------------------------------------------------
 * The fixed state replies
 */

int ts__msg_stream_state_encode(uint8_t *out, size_t cap, const ts__msg_stream_state *m,
                                size_t *len)
{
    if (cap < TS_MSG_STREAM_STATE_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->first_id);
    ts__put_u64le(out + 8, m->last_id);
    ts__put_u64le(out + 16, m->bytes);
    ts__put_u32le(out + 24, m->n_entries);
    ts__put_u32le(out + 28, m->n_groups);
    ts__put_u32le(out + 32, m->n_stale);
    ts__put_u32le(out + 36, m->credit);
    ts__put_u32le(out + 40, m->window);
    ts__put_u32le(out + 44, 0);
    *len = TS_MSG_STREAM_STATE_SIZE;
    return 0;
}

int ts__msg_stream_state_decode(const uint8_t *body, size_t len, ts__msg_stream_state *m)
{
    if (len != TS_MSG_STREAM_STATE_SIZE || ts__get_u32le(body + 44) != 0)
        return TS_EPROTO;
    m->first_id = ts__get_u64le(body);
    m->last_id = ts__get_u64le(body + 8);
    m->bytes = ts__get_u64le(body + 16);
    m->n_entries = ts__get_u32le(body + 24);
    m->n_groups = ts__get_u32le(body + 28);
    m->n_stale = ts__get_u32le(body + 32);
    m->credit = ts__get_u32le(body + 36);
    m->window = ts__get_u32le(body + 40);
    return 0;
}

int ts__msg_stream_append_state_encode(uint8_t *out, size_t cap,
                                       const ts__msg_stream_append_state *m, size_t *len)
{
    if (cap < TS_MSG_STREAM_APPEND_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->id);
    ts__put_u64le(out + 8, m->first_id);
    ts__put_u32le(out + 16, m->credit);
    ts__put_u32le(out + 20, m->n_entries);
    *len = TS_MSG_STREAM_APPEND_SIZE;
    return 0;
}

int ts__msg_stream_append_state_decode(const uint8_t *body, size_t len,
                                       ts__msg_stream_append_state *m)
{
    if (len != TS_MSG_STREAM_APPEND_SIZE)
        return TS_EPROTO;
    m->id = ts__get_u64le(body);
    m->first_id = ts__get_u64le(body + 8);
    m->credit = ts__get_u32le(body + 16);
    m->n_entries = ts__get_u32le(body + 20);
    return 0;
}

int ts__msg_stream_join_state_encode(uint8_t *out, size_t cap, const ts__msg_stream_join_state *m,
                                     size_t *len)
{
    if (cap < TS_MSG_STREAM_JOIN_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->next_id);
    ts__put_u64le(out + 8, m->floor);
    ts__put_u64le(out + 16, m->lost);
    ts__put_u32le(out + 24, m->pending);
    ts__put_u32le(out + 28, m->members);
    ts__put_u32le(out + 32, m->rows_done);
    ts__put_u32le(out + 36, 0);
    *len = TS_MSG_STREAM_JOIN_SIZE;
    return 0;
}

int ts__msg_stream_join_state_decode(const uint8_t *body, size_t len, ts__msg_stream_join_state *m)
{
    if (len != TS_MSG_STREAM_JOIN_SIZE || ts__get_u32le(body + 36) != 0)
        return TS_EPROTO;
    m->next_id = ts__get_u64le(body);
    m->floor = ts__get_u64le(body + 8);
    m->lost = ts__get_u64le(body + 16);
    m->pending = ts__get_u32le(body + 24);
    m->members = ts__get_u32le(body + 28);
    m->rows_done = ts__get_u32le(body + 32);
    return 0;
}

int ts__msg_stream_ack_state_encode(uint8_t *out, size_t cap, const ts__msg_stream_ack_state *m,
                                    size_t *len)
{
    if (cap < TS_MSG_STREAM_ACK_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->acked);
    ts__put_u64le(out + 8, m->floor);
    ts__put_u32le(out + 16, m->pending);
    ts__put_u32le(out + 20, m->credit);
    *len = TS_MSG_STREAM_ACK_SIZE;
    return 0;
}

int ts__msg_stream_ack_state_decode(const uint8_t *body, size_t len, ts__msg_stream_ack_state *m)
{
    if (len != TS_MSG_STREAM_ACK_SIZE)
        return TS_EPROTO;
    m->acked = ts__get_u64le(body);
    m->floor = ts__get_u64le(body + 8);
    m->pending = ts__get_u32le(body + 16);
    m->credit = ts__get_u32le(body + 20);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * ENTRIES
 */

uint64_t ts__msg_stream_entries_head_size(uint32_t n)
{
    /* n < 2^32, so this cannot wrap in 64 bits. */
    return ((uint64_t)TS_MSG_STREAM_ENTRIES_FIXED + (uint64_t)TS_MSG_STREAM_ENTRY_HEAD * n +
            (TS__ALIGN - 1)) &
           ~(uint64_t)(TS__ALIGN - 1);
}

/* 0 when an entry head obeys the layout's rules (kind, flags, a marker's len, a record's tag). */
static int entry_check(const ts__msg_stream_entry *e)
{
    if ((e->flags & ~TS_STREAM_ENTRY_REDELIVERED) != 0)
        return -1;
    if (e->kind == TS_STREAM_ENTRY_MARKER)
        return e->len == 0 ? 0 : -1;
    if (e->kind == TS_STREAM_ENTRY_RECORD)
        return e->tag == 0 ? 0 : -1;
    return -1;
}

int ts__msg_stream_entries_size(uint32_t n, const ts__msg_stream_entry *e, uint64_t *size)
{
    if (n > TS_STREAM_MAX_READ)
        return TS_EINVAL;
    uint64_t total = ts__msg_stream_entries_head_size(n);
    for (uint32_t i = 0; i < n; i++)
        if (ts__msg_add_padded(&total, e[i].len) != 0)
            return TS_EMSGSIZE;
#if SIZE_MAX < UINT64_MAX
    if (total > SIZE_MAX)
        return TS_EMSGSIZE;
#endif
    *size = total;
    return 0;
}

/* Write an entry head at p (TS_MSG_STREAM_ENTRY_HEAD bytes). */
static void entry_write(uint8_t *p, const ts__msg_stream_entry *e)
{
    ts__put_u64le(p, e->id);
    ts__put_u64le(p + 8, e->len);
    ts__put_u64le(p + 16, e->tag);
    ts__put_u32le(p + 24, e->rows_done);
    ts__put_u16le(p + 28, e->deliveries);
    p[30] = e->kind;
    p[31] = e->flags;
}

/* Read entry i's head from a body whose head has been checked to lie inside it. */
static void entry_read(const uint8_t *body, uint32_t i, ts__msg_stream_entry *e)
{
    const uint8_t *p =
        body + TS_MSG_STREAM_ENTRIES_FIXED + (size_t)TS_MSG_STREAM_ENTRY_HEAD * (size_t)i;
    e->id = ts__get_u64le(p);
    e->len = ts__get_u64le(p + 8);
    e->tag = ts__get_u64le(p + 16);
    e->rows_done = ts__get_u32le(p + 24);
    e->deliveries = ts__get_u16le(p + 28);
    e->kind = p[30];
    e->flags = p[31];
    e->record = NULL;
}

int ts__msg_stream_entries_head_encode(uint8_t *out, size_t cap, uint64_t first_id,
                                       uint64_t last_id, uint64_t lost, uint32_t n,
                                       const ts__msg_stream_entry *e, size_t *len)
{
    if (n > TS_STREAM_MAX_READ)
        return TS_EINVAL;
    for (uint32_t i = 0; e != NULL && i < n; i++)
        if (entry_check(&e[i]) != 0)
            return TS_EINVAL;
    uint64_t head = ts__msg_stream_entries_head_size(n);
    if (head > cap)
        return TS_EMSGSIZE;
    memset(out, 0, (size_t)head);
    ts__put_u64le(out, first_id);
    ts__put_u64le(out + 8, last_id);
    ts__put_u64le(out + 16, lost);
    ts__put_u32le(out + 24, n);
    for (uint32_t i = 0; e != NULL && i < n; i++)
        entry_write(out + TS_MSG_STREAM_ENTRIES_FIXED + (size_t)TS_MSG_STREAM_ENTRY_HEAD * i,
                    &e[i]);
    *len = (size_t)head;
    return 0;
}

void ts__msg_stream_entries_set(uint8_t *head, uint32_t i, const ts__msg_stream_entry *e)
{
    assert(i < TS_STREAM_MAX_READ && entry_check(e) == 0);
    entry_write(head + TS_MSG_STREAM_ENTRIES_FIXED + (size_t)TS_MSG_STREAM_ENTRY_HEAD * i, e);
}

int ts__msg_stream_entries_encode(uint8_t *out, size_t cap, uint64_t first_id, uint64_t last_id,
                                  uint64_t lost, uint32_t n, const ts__msg_stream_entry *e,
                                  size_t *len)
{
    uint64_t total;
    int rc = ts__msg_stream_entries_size(n, e, &total);
    if (rc != 0)
        return rc;
    for (uint32_t i = 0; i < n; i++)
        if (entry_check(&e[i]) != 0)
            return TS_EINVAL;
    /* Room for everything first, so that a refused body leaves the buffer untouched. */
    if (total > cap)
        return TS_EMSGSIZE;
    size_t off;
    rc = ts__msg_stream_entries_head_encode(out, cap, first_id, last_id, lost, n, e, &off);
    assert(rc == 0);
    (void)rc;
    /* The size check bounds every running offset by total: no record can fail to fit. */
    for (uint32_t i = 0; i < n; i++)
        (void)ts__msg_put_padded(out, cap, &off, e[i].record, e[i].len);
    *len = off;
    return 0;
}

int ts__msg_stream_entries_decode(const uint8_t *body, size_t len, ts__msg_stream_entries *m)
{
    if (len < TS_MSG_STREAM_ENTRIES_FIXED)
        return TS_EPROTO;
    uint32_t n = ts__get_u32le(body + 24);
    if (ts__get_u32le(body + 28) != 0 || n > TS_STREAM_MAX_READ)
        return TS_EPROTO;
    /* The entry heads must lie in the body before anything is walked by n. */
    uint64_t head = ts__msg_stream_entries_head_size(n);
    uint64_t heads_end = TS_MSG_STREAM_ENTRIES_FIXED + (uint64_t)TS_MSG_STREAM_ENTRY_HEAD * n;
    if (ts__msg_head_check(body, len, heads_end, head) != 0)
        return TS_EPROTO;
    uint64_t off = head;
    for (uint32_t i = 0; i < n; i++) {
        ts__msg_stream_entry e;
        entry_read(body, i, &e);
        if (entry_check(&e) != 0)
            return TS_EPROTO;
        /* Records lie one after the other in entry order, each padded with zeros to 64. */
        if (ts__msg_skip_padded(body, len, &off, e.len) != 0)
            return TS_EPROTO;
    }
    if (off != len)
        return TS_EPROTO;
    m->first_id = ts__get_u64le(body);
    m->last_id = ts__get_u64le(body + 8);
    m->lost = ts__get_u64le(body + 16);
    m->n = n;
    m->body = body;
    m->len = len;
    return 0;
}

void ts__msg_stream_entries_iter_init(const ts__msg_stream_entries *m,
                                      ts__msg_stream_entries_iter *it)
{
    it->i = 0;
    it->off = ts__msg_stream_entries_head_size(m->n);
}

int ts__msg_stream_entries_next(const ts__msg_stream_entries *m, ts__msg_stream_entries_iter *it,
                                ts__msg_stream_entry *e)
{
    if (it->i >= m->n)
        return 0;
    entry_read(m->body, it->i, e);
    e->record = e->kind == TS_STREAM_ENTRY_RECORD ? m->body + it->off : NULL;
    it->off += e->len + ts__msg_items_pad(e->len);
    it->i++;
    return 1;
}

void ts__msg_stream_entry_get(const ts__msg_stream_entries *m, uint32_t i, ts__msg_stream_entry *e)
{
    assert(i < m->n);
    ts__msg_stream_entries_iter it;
    ts__msg_stream_entries_iter_init(m, &it);
    /* Only the lengths of the entries before i are needed to find its record. */
    for (uint32_t k = 0; k < i; k++) {
        uint64_t l = ts__get_u64le(m->body + TS_MSG_STREAM_ENTRIES_FIXED +
                                   (size_t)TS_MSG_STREAM_ENTRY_HEAD * k + 8);
        it.off += l + ts__msg_items_pad(l);
    }
    it.i = i;
    int more = ts__msg_stream_entries_next(m, &it, e);
    assert(more == 1);
    (void)more;
}
