/*
 * The bodies of services (msg_svc.h): SVC_REGISTER's request, SERVICE STATE, the fixed fields of
 * the SVC_CALL and SVC_REPLY uploads (msg.c's ts__msg_upload_* carry their names and records),
 * and the head of the SVC_REQUEST push. Written field by field, read through the bounded reader.
 */
#include "msg.h"

_Static_assert(TS_MSG_SVC_STATE_SIZE == 4 + 4 + 8, "SERVICE STATE layout");
_Static_assert(TS_MSG_SVC_REPLY_FIXED == 8 + 2 + 2 + 4, "SVC_REPLY fixed layout");
_Static_assert(TS_MSG_SVC_PUSH_FIXED == 8 + 4 + 4 + 8, "SVC_REQUEST head layout");
_Static_assert(TS_MSG_SVC_REPLY_FIXED <= TS_MSG_MAX_UPLOAD_FIXED, "SVC_REPLY's fixed part fits");
_Static_assert(TS_MAX_CTRL_BODY >= 1 + TS_MAX_NAME_LEN + TS_MSG_SVC_REGISTER_FIXED,
               "SVC_REGISTER fits the control body limit");

size_t ts__msg_svc_register_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_SVC_REGISTER_FIXED;
}

int ts__msg_svc_register_req_encode(uint8_t *out, size_t cap, const ts__msg_svc_register_req *m,
                                    size_t *len)
{
    uint8_t *p;
    int rc =
        ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_SVC_REGISTER_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, m->concurrency);
    ts__put_u32le(p + 4, m->flags);
    *len = ts__msg_svc_register_req_size(m->name_len);
    return 0;
}

int ts__msg_svc_register_req_decode(const uint8_t *body, size_t len, ts__msg_svc_register_req *m)
{
    ts__rd r;
    const char *name = NULL;
    size_t name_len = 0;
    uint32_t conc = 0, flags = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &name, &name_len);
    ts__rd_u32(&r, &conc);
    ts__rd_u32(&r, &flags);
    if (ts__msg_rd_end(&r) != 0)
        return TS_EPROTO;
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    m->concurrency = conc;
    m->flags = flags;
    return 0;
}

int ts__msg_svc_state_encode(uint8_t *out, size_t cap, const ts__msg_svc_state *m, size_t *len)
{
    if (cap < TS_MSG_SVC_STATE_SIZE)
        return TS_EMSGSIZE;
    ts__put_u32le(out, m->servers);
    ts__put_u32le(out + 4, m->queued);
    ts__put_u64le(out + 8, m->calls);
    *len = TS_MSG_SVC_STATE_SIZE;
    return 0;
}

int ts__msg_svc_state_decode(const uint8_t *body, size_t len, ts__msg_svc_state *m)
{
    if (len != TS_MSG_SVC_STATE_SIZE)
        return TS_EPROTO;
    m->servers = ts__get_u32le(body);
    m->queued = ts__get_u32le(body + 4);
    m->calls = ts__get_u64le(body + 8);
    return 0;
}

void ts__msg_svc_call_fixed_encode(uint8_t out[TS_MSG_SVC_CALL_FIXED],
                                   const ts__msg_svc_call_fixed *m)
{
    ts__put_u32le(out, m->timeout_ms);
    ts__put_u32le(out + 4, m->flags);
}

void ts__msg_svc_call_fixed_decode(const uint8_t in[TS_MSG_SVC_CALL_FIXED],
                                   ts__msg_svc_call_fixed *m)
{
    m->timeout_ms = ts__get_u32le(in);
    m->flags = ts__get_u32le(in + 4);
}

void ts__msg_svc_reply_fixed_encode(uint8_t out[TS_MSG_SVC_REPLY_FIXED],
                                    const ts__msg_svc_reply_fixed *m)
{
    ts__put_u64le(out, m->call_id);
    ts__put_u16le(out + 8, m->status);
    ts__put_u16le(out + 10, m->reserved16);
    ts__put_u32le(out + 12, m->reserved32);
}

void ts__msg_svc_reply_fixed_decode(const uint8_t in[TS_MSG_SVC_REPLY_FIXED],
                                    ts__msg_svc_reply_fixed *m)
{
    m->call_id = ts__get_u64le(in);
    m->status = ts__get_u16le(in + 8);
    m->reserved16 = ts__get_u16le(in + 10);
    m->reserved32 = ts__get_u32le(in + 12);
}

int ts__msg_svc_reply_is_error(const uint8_t fixed[TS_MSG_SVC_REPLY_FIXED])
{
    return ts__get_u16le(fixed + 8) != TS_ST_OK;
}

int ts__msg_svc_status_allowed(uint16_t status)
{
    return status != TS_ST_OK && status < TS_ST_COUNT_ && status != TS_ST_WRONG_SHARD &&
           status != TS_ST_VERSION_MISMATCH && status != TS_ST_STALE_GRADIENT;
}

size_t ts__msg_svc_push_head_size(size_t name_len)
{
    return (TS_MSG_SVC_PUSH_FIXED + 1 + name_len + 63) / 64 * 64;
}

int ts__msg_svc_push_head_encode(uint8_t *out, size_t cap, const ts__msg_svc_push *m, size_t *len)
{
    if (m->name_len < 1 || m->name_len > TS_MAX_NAME_LEN)
        return TS_EINVAL;
    size_t need = ts__msg_svc_push_head_size(m->name_len);
    if (need > cap)
        return TS_EMSGSIZE;
    memset(out, 0, need);
    ts__put_u64le(out, m->call_id);
    ts__put_u32le(out + 8, m->timeout_ms);
    ts__put_u64le(out + 16, m->rec_len);
    (void)ts__msg_put_name(out + TS_MSG_SVC_PUSH_FIXED, m->name, m->name_len);
    *len = need;
    return 0;
}

int ts__msg_svc_push_decode(const uint8_t *body, size_t len, ts__msg_svc_push *m)
{
    if (len < TS_MSG_SVC_PUSH_FIXED + 1)
        return TS_EPROTO;
    size_t nl = body[TS_MSG_SVC_PUSH_FIXED];
    size_t head = ts__msg_svc_push_head_size(nl);
    uint64_t rec_len = ts__get_u64le(body + 16);
    if (nl == 0 || head > len || rec_len > len - head ||
        len - head - rec_len != ts__msg_items_pad(rec_len) || ts__get_u32le(body + 12) != 0 ||
        !ts__msg_all_zero(body + TS_MSG_SVC_PUSH_FIXED + 1 + nl,
                          head - TS_MSG_SVC_PUSH_FIXED - 1 - nl) ||
        !ts__msg_all_zero(body + head + rec_len, len - head - (size_t)rec_len))
        return TS_EPROTO;
    m->call_id = ts__get_u64le(body);
    m->timeout_ms = ts__get_u32le(body + 8);
    m->name = body + TS_MSG_SVC_PUSH_FIXED + 1;
    m->name_len = nl;
    m->rec_len = rec_len;
    m->head_len = head;
    m->record = body + head;
    return 0;
}
