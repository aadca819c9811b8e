/*
 * The parameter server bodies (see msg_ps.h): PS_CREATE, EMB_CREATE and PS_PULL requests and the
 * fixed fields of the PS_PUSH and EMB_PUSH uploads (docs/PROTOCOL.md 8.45 to 8.50). Written field
 * by field, read through the bounded reader.
 */
#include "msg.h"

_Static_assert(TS_MSG_PS_CREATE_FIXED == 4 * 1 + 3 * 4 + 4 * 8, "PS_CREATE fixed part");
_Static_assert(TS_MSG_EMB_CREATE_FIXED == 4 + 1 + 1 + 2 + 2 * 8 + 5 * 8, "EMB_CREATE fixed part");
_Static_assert(TS_MSG_PS_PUSH_FIXED <= TS_MSG_MAX_UPLOAD_FIXED, "PS_PUSH's fixed part fits");
_Static_assert(TS_MSG_EMB_PUSH_FIXED <= TS_MSG_MAX_UPLOAD_FIXED, "EMB_PUSH's fixed part fits");
_Static_assert(TS_MAX_CTRL_BODY >= 1 + TS_MAX_NAME_LEN + TS_MSG_EMB_CREATE_FIXED,
               "the parameter server's control requests fit the control body limit");

/*
 * Read the name and exactly fixed bytes after it: 0 with *name, *name_len and *p (the fixed
 * part), or TS_EPROTO when the body is not exactly that long.
 */
static int ps_read_head(const uint8_t *body, size_t len, size_t fixed, const uint8_t **name,
                        size_t *name_len, const uint8_t **p)
{
    ts__rd r;
    const char *n = NULL;
    size_t nl = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &n, &nl);
    const uint8_t *f = ts__rd_bytes(&r, fixed);
    if (ts__msg_rd_end(&r) != 0 || f == NULL)
        return TS_EPROTO;
    *name = (const uint8_t *)n;
    *name_len = nl;
    *p = f;
    return 0;
}

size_t ts__msg_ps_create_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_PS_CREATE_FIXED;
}

int ts__msg_ps_create_req_encode(uint8_t *out, size_t cap, const ts__msg_ps_create_req *m,
                                 size_t *len)
{
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_PS_CREATE_FIXED, &p);
    if (rc != 0)
        return rc;
    p[0] = m->optimizer;
    p[1] = m->mode;
    p[2] = m->flags;
    p[3] = 0;
    ts__put_u32le(p + 4, m->sync_k);
    ts__put_u32le(p + 8, m->tolerance);
    ts__put_u32le(p + 12, 0);
    ts__put_f64le(p + 16, m->lr);
    ts__put_f64le(p + 24, m->beta1);
    ts__put_f64le(p + 32, m->beta2);
    ts__put_f64le(p + 40, m->eps);
    *len = ts__msg_ps_create_req_size(m->name_len);
    return 0;
}

int ts__msg_ps_create_req_decode(const uint8_t *body, size_t len, ts__msg_ps_create_req *m)
{
    const uint8_t *name, *p;
    size_t name_len;
    if (ps_read_head(body, len, TS_MSG_PS_CREATE_FIXED, &name, &name_len, &p) != 0)
        return TS_EPROTO;
    if (p[3] != 0 || ts__get_u32le(p + 12) != 0)
        return TS_EPROTO;
    memset(m, 0, sizeof(*m));
    m->name = name;
    m->name_len = name_len;
    m->optimizer = p[0];
    m->mode = p[1];
    m->flags = p[2];
    m->sync_k = ts__get_u32le(p + 4);
    m->tolerance = ts__get_u32le(p + 8);
    m->lr = ts__get_f64le(p + 16);
    m->beta1 = ts__get_f64le(p + 24);
    m->beta2 = ts__get_f64le(p + 32);
    m->eps = ts__get_f64le(p + 40);
    return 0;
}

size_t ts__msg_emb_create_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_EMB_CREATE_FIXED;
}

int ts__msg_emb_create_req_encode(uint8_t *out, size_t cap, const ts__msg_ps_create_req *m,
                                  size_t *len)
{
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_EMB_CREATE_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, m->dim);
    p[4] = m->optimizer;
    p[5] = m->init;
    p[6] = 0;
    p[7] = 0;
    ts__put_u64le(p + 8, m->seed);
    ts__put_u64le(p + 16, m->num_ids);
    ts__put_f64le(p + 24, m->lr);
    ts__put_f64le(p + 32, m->beta1);
    ts__put_f64le(p + 40, m->beta2);
    ts__put_f64le(p + 48, m->eps);
    ts__put_f64le(p + 56, m->init_scale);
    *len = ts__msg_emb_create_req_size(m->name_len);
    return 0;
}

int ts__msg_emb_create_req_decode(const uint8_t *body, size_t len, ts__msg_ps_create_req *m)
{
    const uint8_t *name, *p;
    size_t name_len;
    if (ps_read_head(body, len, TS_MSG_EMB_CREATE_FIXED, &name, &name_len, &p) != 0)
        return TS_EPROTO;
    if (p[6] != 0 || p[7] != 0)
        return TS_EPROTO;
    memset(m, 0, sizeof(*m));
    m->name = name;
    m->name_len = name_len;
    m->dim = ts__get_u32le(p);
    m->optimizer = p[4];
    m->init = p[5];
    m->seed = ts__get_u64le(p + 8);
    m->num_ids = ts__get_u64le(p + 16);
    m->lr = ts__get_f64le(p + 24);
    m->beta1 = ts__get_f64le(p + 32);
    m->beta2 = ts__get_f64le(p + 40);
    m->eps = ts__get_f64le(p + 48);
    m->init_scale = ts__get_f64le(p + 56);
    return 0;
}

size_t ts__msg_ps_pull_req_size(size_t name_len)
{
    return 1 + name_len + TS_MSG_PS_PULL_FIXED;
}

int ts__msg_ps_pull_req_encode(uint8_t *out, size_t cap, const ts__msg_ps_pull_req *m, size_t *len)
{
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len, TS_MSG_PS_PULL_FIXED, &p);
    if (rc != 0)
        return rc;
    ts__put_u64le(p, m->if_newer_than);
    *len = ts__msg_ps_pull_req_size(m->name_len);
    return 0;
}

int ts__msg_ps_pull_req_decode(const uint8_t *body, size_t len, ts__msg_ps_pull_req *m)
{
    const uint8_t *name, *p;
    size_t name_len;
    if (ps_read_head(body, len, TS_MSG_PS_PULL_FIXED, &name, &name_len, &p) != 0)
        return TS_EPROTO;
    m->name = name;
    m->name_len = name_len;
    m->if_newer_than = ts__get_u64le(p);
    return 0;
}

void ts__msg_ps_push_fixed_encode(uint8_t out[TS_MSG_PS_PUSH_FIXED], const ts__msg_ps_push_fixed *m)
{
    ts__put_u64le(out, m->base_version);
    ts__put_f64le(out + 8, m->scale);
}

void ts__msg_ps_push_fixed_decode(const uint8_t in[TS_MSG_PS_PUSH_FIXED], ts__msg_ps_push_fixed *m)
{
    m->base_version = ts__get_u64le(in);
    m->scale = ts__get_f64le(in + 8);
}

void ts__msg_emb_push_fixed_encode(uint8_t out[TS_MSG_EMB_PUSH_FIXED], double scale)
{
    ts__put_f64le(out, scale);
}

double ts__msg_emb_push_fixed_decode(const uint8_t in[TS_MSG_EMB_PUSH_FIXED])
{
    return ts__get_f64le(in);
}
