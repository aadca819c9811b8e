/*
 * The replay table bodies (see msg_table.h): the requests of opcodes 0x28 to 0x2D, TABLE STATE
 * and SAMPLES (docs/PROTOCOL.md 8.33 to 8.38).
 */
#include "msg.h"

#include <assert.h>

_Static_assert(TS_MSG_TABLE_CREATE_FIXED == 8 + 8 + 8 + 8 + 8 + 4 + 1 + 1 + 2,
               "TABLE_CREATE fixed part");
_Static_assert(TS_MSG_TABLE_INSERT_FIXED <= TS_MSG_MAX_UPLOAD_FIXED,
               "TABLE_INSERT's fixed fields fit what a connection keeps");
_Static_assert(TS_MSG_TABLE_STATE_SIZE == 4 * 8 + 2 * 4, "TABLE STATE layout");
_Static_assert(TS_MSG_TABLE_SAMPLE_HEAD == 4 * 8 + 2 * 4, "SAMPLES head layout");
_Static_assert(1 + 255 + TS_MSG_TABLE_KEYS_FIXED + (size_t)TS_TABLE_MAX_KEYS * 16 <=
                   TS_MAX_CTRL_BODY,
               "the largest TABLE_UPDATE fits the control body limit");

static void rd_f64(ts__rd *r, double *v)
{
    uint64_t u = 0;
    if (ts__rd_u64(r, &u) == 0)
        memcpy(v, &u, sizeof(*v));
}

/* ---------------------------------------------------------------------------------------------
 * TABLE_CREATE
 */

size_t ts__msg_table_create_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_TABLE_CREATE_FIXED;
}

int ts__msg_table_create_req_encode(uint8_t *out, size_t cap, const ts__msg_table_create_req *m,
                                    size_t *len)
{
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_TABLE_CREATE_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u64le(p, m->capacity);
    ts__put_u64le(p + 8, m->min_size_to_sample);
    ts__put_f64le(p + 16, m->samples_per_insert);
    ts__put_f64le(p + 24, m->error_buffer);
    ts__put_f64le(p + 32, m->priority_exponent);
    ts__put_u32le(p + 40, m->max_times_sampled);
    p[44] = m->remover;
    p[45] = m->sampler;
    ts__put_u16le(p + 46, 0);
    *len = ts__msg_table_create_req_size(m->name_len);
    return 0;
}

int ts__msg_table_create_req_decode(const uint8_t *body, size_t len, ts__msg_table_create_req *m)
{
    ts__rd r;
    ts__msg_table_create_req d;
    uint16_t reserved = 0;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u64(&r, &d.capacity);
    ts__rd_u64(&r, &d.min_size_to_sample);
    rd_f64(&r, &d.samples_per_insert);
    rd_f64(&r, &d.error_buffer);
    rd_f64(&r, &d.priority_exponent);
    ts__rd_u32(&r, &d.max_times_sampled);
    ts__rd_u8(&r, &d.remover);
    ts__rd_u8(&r, &d.sampler);
    ts__rd_u16(&r, &reserved);
    if (ts__msg_rd_end(&r) != 0 || reserved != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * TABLE_INSERT's fixed fields
 */

void ts__msg_table_insert_fixed_encode(uint8_t out[TS_MSG_TABLE_INSERT_FIXED],
                                       const ts__msg_table_insert_fixed *m)
{
    ts__put_f64le(out, m->priority);
    ts__put_u32le(out + 8, m->timeout_ms);
    ts__put_u32le(out + 12, 0);
}

int ts__msg_table_insert_fixed_decode(const uint8_t in[TS_MSG_TABLE_INSERT_FIXED],
                                      ts__msg_table_insert_fixed *m)
{
    if (ts__get_u32le(in + 12) != 0)
        return TS_EPROTO;
    m->priority = ts__get_f64le(in);
    m->timeout_ms = ts__get_u32le(in + 8);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * TABLE_SAMPLE
 */

size_t ts__msg_table_sample_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_TABLE_SAMPLE_FIXED;
}

int ts__msg_table_sample_req_encode(uint8_t *out, size_t cap, const ts__msg_table_sample_req *m,
                                    size_t *len)
{
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_TABLE_SAMPLE_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, m->n);
    ts__put_u32le(p + 4, m->timeout_ms);
    *len = ts__msg_table_sample_req_size(m->name_len);
    return 0;
}

int ts__msg_table_sample_req_decode(const uint8_t *body, size_t len, ts__msg_table_sample_req *m)
{
    ts__rd r;
    ts__msg_table_sample_req d;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u32(&r, &d.n);
    ts__rd_u32(&r, &d.timeout_ms);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * TABLE_UPDATE, TABLE_REMOVE
 */

size_t ts__msg_table_keys_req_size(size_t name_len, uint32_t n, int with_priority)
{
    return 1 + name_len + TS_MSG_TABLE_KEYS_FIXED + (size_t)n * (with_priority ? 16u : 8u);
}

int ts__msg_table_keys_req_encode(uint8_t *out, size_t cap, const uint8_t *name, size_t name_len,
                                  uint32_t n, const uint64_t *keys, const double *priorities,
                                  size_t *len)
{
    /* A name too long is the first error, before the count is looked at. */
    if (name_len > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    if (n > TS_TABLE_MAX_KEYS)
        return TS_EINVAL;
    int wp = priorities != NULL;
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, name, name_len,
                                      TS_MSG_TABLE_KEYS_FIXED + (size_t)n * (wp ? 16u : 8u), &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, n);
    ts__put_u32le(p + 4, 0);
    p += TS_MSG_TABLE_KEYS_FIXED;
    for (uint32_t i = 0; i < n; i++) {
        ts__put_u64le(p, keys[i]);
        p += 8;
        if (wp) {
            ts__put_f64le(p, priorities[i]);
            p += 8;
        }
    }
    *len = ts__msg_table_keys_req_size(name_len, n, wp);
    return 0;
}

static int keys_decode(const uint8_t *body, size_t len, int wp, ts__msg_table_keys_req *m)
{
    ts__rd r;
    ts__msg_table_keys_req d;
    uint32_t reserved = 1;
    memset(&d, 0, sizeof(d));
    ts__rd_init(&r, body, len);
    ts__msg_rd_str(&r, 0, &d.name, &d.name_len);
    ts__rd_u32(&r, &d.n);
    ts__rd_u32(&r, &reserved);
    if (r.err != 0 || reserved != 0 || d.n > TS_TABLE_MAX_KEYS)
        return TS_EPROTO;
    d.with_priority = wp;
    d.pairs = ts__rd_bytes(&r, (size_t)d.n * (wp ? 16u : 8u));
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    *m = d;
    return 0;
}

int ts__msg_table_update_req_decode(const uint8_t *body, size_t len, ts__msg_table_keys_req *m)
{
    return keys_decode(body, len, 1, m);
}

int ts__msg_table_remove_req_decode(const uint8_t *body, size_t len, ts__msg_table_keys_req *m)
{
    return keys_decode(body, len, 0, m);
}

void ts__msg_table_key_at(const ts__msg_table_keys_req *m, uint32_t i, uint64_t *key,
                          double *priority)
{
    assert(i < m->n);
    const uint8_t *p = m->pairs + (size_t)i * (m->with_priority ? 16u : 8u);
    *key = ts__get_u64le(p);
    *priority = m->with_priority ? ts__get_f64le(p + 8) : 0.0;
}

/* ---------------------------------------------------------------------------------------------
 * TABLE STATE
 */

int ts__msg_table_state_encode(uint8_t *out, size_t cap, const ts__msg_table_state *m, size_t *len)
{
    if (cap < TS_MSG_TABLE_STATE_SIZE)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->key);
    ts__put_u64le(out + 8, m->size);
    ts__put_u64le(out + 16, m->inserts);
    ts__put_u64le(out + 24, m->samples);
    ts__put_u32le(out + 32, m->done);
    ts__put_u32le(out + 36, m->skipped);
    *len = TS_MSG_TABLE_STATE_SIZE;
    return 0;
}

int ts__msg_table_state_decode(const uint8_t *body, size_t len, ts__msg_table_state *m)
{
    if (len != TS_MSG_TABLE_STATE_SIZE)
        return TS_EPROTO;
    m->key = ts__get_u64le(body);
    m->size = ts__get_u64le(body + 8);
    m->inserts = ts__get_u64le(body + 16);
    m->samples = ts__get_u64le(body + 24);
    m->done = ts__get_u32le(body + 32);
    m->skipped = ts__get_u32le(body + 36);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * SAMPLES
 */

uint64_t ts__msg_table_samples_head_size(uint32_t n)
{
    return ts__align_up(TS_MSG_TABLE_SAMPLES_FIXED + (size_t)n * TS_MSG_TABLE_SAMPLE_HEAD,
                        TS__ALIGN);
}

void ts__msg_table_samples_set(uint8_t *head, uint32_t i, const ts__msg_table_sample *e)
{
    uint8_t *p = head + TS_MSG_TABLE_SAMPLES_FIXED + (size_t)i * TS_MSG_TABLE_SAMPLE_HEAD;
    ts__put_u64le(p, e->key);
    ts__put_u64le(p + 8, e->len);
    ts__put_f64le(p + 16, e->probability);
    ts__put_u64le(p + 24, e->age_ms);
    ts__put_u32le(p + 32, e->times_sampled);
    ts__put_u32le(p + 36, 0);
}

int ts__msg_table_samples_head_encode(uint8_t *out, size_t cap, uint64_t size, uint32_t n,
                                      const ts__msg_table_sample *e, size_t *len)
{
    if (n < 1 || n > TS_TABLE_MAX_SAMPLE)
        return TS_EINVAL;
    size_t head = (size_t)ts__msg_table_samples_head_size(n);
    if (head > cap)
        return TS_EMSGSIZE;
    memset(out, 0, head);
    ts__put_u64le(out, size);
    ts__put_u32le(out + 8, n);
    if (e != NULL)
        for (uint32_t i = 0; i < n; i++)
            ts__msg_table_samples_set(out, i, &e[i]);
    *len = head;
    return 0;
}

int ts__msg_table_samples_encode(uint8_t *out, size_t cap, uint64_t size, uint32_t n,
                                 const ts__msg_table_sample *e, size_t *len)
{
    size_t off;
    int rc = ts__msg_table_samples_head_encode(out, cap, size, n, e, &off);
    if (rc != 0)
        return rc;
    for (uint32_t i = 0; i < n; i++)
        if (ts__msg_put_padded(out, cap, &off, e[i].record, e[i].len) != 0)
            return TS_EMSGSIZE;
    *len = off;
    return 0;
}

static void head_get(const uint8_t *body, uint32_t i, ts__msg_table_sample *e)
{
    const uint8_t *p = body + TS_MSG_TABLE_SAMPLES_FIXED + (size_t)i * TS_MSG_TABLE_SAMPLE_HEAD;
    e->key = ts__get_u64le(p);
    e->len = ts__get_u64le(p + 8);
    e->probability = ts__get_f64le(p + 16);
    e->age_ms = ts__get_u64le(p + 24);
    e->times_sampled = ts__get_u32le(p + 32);
    e->record = NULL;
}

int ts__msg_table_samples_decode(const uint8_t *body, size_t len, ts__msg_table_samples *m)
{
    if (len < TS_MSG_TABLE_SAMPLES_FIXED)
        return TS_EPROTO;
    uint32_t n = ts__get_u32le(body + 8);
    if (n < 1 || n > TS_TABLE_MAX_SAMPLE || ts__get_u32le(body + 12) != 0)
        return TS_EPROTO;
    uint64_t head = ts__msg_table_samples_head_size(n);
    uint64_t used = TS_MSG_TABLE_SAMPLES_FIXED + (uint64_t)n * TS_MSG_TABLE_SAMPLE_HEAD;
    if (ts__msg_head_check(body, len, used, head) != 0)
        return TS_EPROTO;
    uint64_t off = head;
    for (uint32_t i = 0; i < n; i++) {
        ts__msg_table_sample e;
        head_get(body, i, &e);
        if (ts__get_u32le(body + TS_MSG_TABLE_SAMPLES_FIXED + (size_t)i * TS_MSG_TABLE_SAMPLE_HEAD +
                          36) != 0)
            return TS_EPROTO;
        if (ts__msg_skip_padded(body, len, &off, e.len) != 0)
            return TS_EPROTO;
    }
    if (off != len)
        return TS_EPROTO;
    m->size = ts__get_u64le(body);
    m->n = n;
    m->body = body;
    m->len = len;
    return 0;
}

void ts__msg_table_sample_get(const ts__msg_table_samples *m, uint32_t i, ts__msg_table_sample *e)
{
    assert(i < m->n);
    uint64_t off = ts__msg_table_samples_head_size(m->n);
    for (uint32_t k = 0; k < i; k++) {
        ts__msg_table_sample o;
        head_get(m->body, k, &o);
        off += o.len + ts__msg_items_pad(o.len);
    }
    head_get(m->body, i, e);
    e->record = m->body + off;
}
