/*
 * The codecs of the tensor-bin and row requests (docs/PROTOCOL.md, opcodes 0x12 to 0x15; see
 * msg.h): the TENSOR_BIN and READ_ROWS request bodies, and the layout of a record whose root is
 * one tensor, which tensor bins hold and row replies carry. GATHER_ROWS and WRITE_ROWS bodies are
 * a name and a record, as PUT's, and use PUT's codec.
 */
#include "msg.h"

#include "record.h"

_Static_assert(TS_MSG_TENSOR_BIN_FIXED == 1 + 1 + 2, "TENSOR_BIN fixed part after the name");
_Static_assert(TS_MSG_READ_ROWS_FIXED == 4 + 2 + 8 + 8, "READ_ROWS fixed part besides name, key");
_Static_assert(1 + TS_MAX_NAME_LEN + TS_MSG_TENSOR_BIN_FIXED + 8 * TS_MAX_NDIM <= TS_MAX_CTRL_BODY,
               "the largest TENSOR_BIN body fits the control body limit");
_Static_assert(1 + TS_MAX_NAME_LEN + TS_MSG_READ_ROWS_FIXED + TS_MSG_MAX_ROWS_KEY <=
                   TS_MAX_CTRL_BODY,
               "the largest READ_ROWS body fits the control body limit");

/* The record value type of a tensor (section 10.2). */
#define REC_TYPE_TENSOR 3
/* Bytes of a tensor value in meta: type, dtype, ndim, reserved, dims, data_off, data_len. */
#define TENSOR_META(ndim) (1u + 1u + 1u + 2u + 8u * (unsigned)(ndim) + 8u + 8u)

/* ---------------------------------------------------------------------------------------------
 * TENSOR_BIN
 */

size_t ts__msg_tensor_bin_req_size(size_t name_len, unsigned ndim)
{
    return 1 + name_len + TS_MSG_TENSOR_BIN_FIXED + 8 * (size_t)ndim;
}

int ts__msg_tensor_bin_req_encode(uint8_t *out, size_t cap, const ts__msg_tensor_bin_req *m,
                                  size_t *len)
{
    /* A name too long is the first error, before the dims are looked at. */
    if (m->name_len > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    if (m->ndim > TS_MAX_NDIM)
        return TS_EINVAL;
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len,
                                      TS_MSG_TENSOR_BIN_FIXED + 8 * (size_t)m->ndim, &p);
    if (rc != 0)
        return rc;
    *p++ = m->dtype;
    *p++ = m->ndim;
    ts__put_u16le(p, 0);
    p += 2;
    for (unsigned i = 0; i < m->ndim; i++, p += 8)
        ts__put_u64le(p, m->dims[i]);
    *len = ts__msg_tensor_bin_req_size(m->name_len, m->ndim);
    return 0;
}

int ts__msg_tensor_bin_req_decode(const uint8_t *body, size_t len, ts__msg_tensor_bin_req *m)
{
    ts__rd r;
    const char *name = NULL;
    size_t name_len = 0;
    uint8_t dtype = 0, ndim = 0;
    uint16_t rsvd = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &name, &name_len);
    ts__rd_u8(&r, &dtype);
    ts__rd_u8(&r, &ndim);
    ts__rd_u16(&r, &rsvd);
    /* Every announced dim must be in the body, however many: the layout is exact either way. */
    const uint8_t *dims = ts__rd_bytes(&r, 8 * (size_t)ndim);
    if (r.err != 0 || r.left != 0 || rsvd != 0)
        return TS_EPROTO;
    memset(m, 0, sizeof(*m));
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    m->dtype = dtype;
    m->ndim = ndim;
    /* Only the dims of a tensor the protocol allows are kept; the caller refuses the others. */
    for (unsigned i = 0; i < ndim && i < TS_MAX_NDIM; i++)
        m->dims[i] = ts__get_u64le(dims + 8 * (size_t)i);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * READ_ROWS
 */

size_t ts__msg_read_rows_req_size(size_t name_len, size_t key_len)
{
    return 1 + name_len + TS_MSG_READ_ROWS_FIXED + key_len;
}

int ts__msg_read_rows_req_encode(uint8_t *out, size_t cap, const ts__msg_read_rows_req *m,
                                 size_t *len)
{
    /* A name too long is the first error, before the key is looked at. */
    if (m->name_len > TS_MAX_NAME_LEN)
        return TS_ENAMETOOLONG;
    if (m->key_len > TS_MSG_MAX_ROWS_KEY)
        return TS_EINVAL;
    uint8_t *p;
    int rc = ts__msg_name_head_encode(out, cap, m->name, m->name_len,
                                      TS_MSG_READ_ROWS_FIXED + m->key_len, &p);
    if (rc != 0)
        return rc;
    ts__put_u32le(p, (uint32_t)m->item);
    ts__put_u16le(p + 4, (uint16_t)m->key_len);
    p += 6;
    if (m->key_len > 0)
        memcpy(p, m->key, m->key_len);
    p += m->key_len;
    ts__put_u64le(p, m->start);
    ts__put_u64le(p + 8, m->end);
    *len = ts__msg_read_rows_req_size(m->name_len, m->key_len);
    return 0;
}

int ts__msg_read_rows_req_decode(const uint8_t *body, size_t len, ts__msg_read_rows_req *m)
{
    ts__rd r;
    const char *name = NULL;
    size_t name_len = 0;
    uint32_t item = 0;
    uint16_t key_len = 0;
    uint64_t start = 0, end = 0;
    ts__rd_init(&r, body, len);
    ts__rd_name(&r, &name, &name_len);
    ts__rd_u32(&r, &item);
    ts__rd_u16(&r, &key_len);
    const uint8_t *key = ts__rd_bytes(&r, key_len);
    ts__rd_u64(&r, &start);
    ts__rd_u64(&r, &end);
    if (r.err != 0 || r.left != 0 || key_len > TS_MSG_MAX_ROWS_KEY)
        return TS_EPROTO;
    m->name = (const uint8_t *)name;
    m->name_len = name_len;
    m->item = (int32_t)item;
    m->key = key_len > 0 ? key : NULL;
    m->key_len = key_len;
    m->start = start;
    m->end = end;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Records whose root is one tensor
 */

int ts__rows_tensor_bytes(uint8_t dtype, unsigned ndim, const uint64_t *dims, uint64_t *bytes)
{
    size_t es = ts_dtype_size((ts_dtype_t)dtype);
    if (es == 0 || ndim > TS_MAX_NDIM)
        return TS_EINVAL;
    /* Left to right, as the record validator multiplies (section 10.5 rule 10). */
    uint64_t n = es;
    for (unsigned i = 0; i < ndim; i++) {
        if (dims[i] > (uint64_t)INT64_MAX || __builtin_mul_overflow(n, dims[i], &n))
            return TS_EMSGSIZE;
    }
    *bytes = n;
    return 0;
}

size_t ts__rows_rec_head_size(unsigned ndim)
{
    return ts__align_up(TS_REC_HDR_SIZE + TENSOR_META(ndim), TS__ALIGN);
}

int ts__rows_rec_size(uint8_t dtype, unsigned ndim, const uint64_t *dims, uint64_t *size)
{
    uint64_t data;
    int rc = ts__rows_tensor_bytes(dtype, ndim, dims, &data);
    if (rc != 0)
        return rc;
    uint64_t total;
    if (__builtin_add_overflow((uint64_t)ts__rows_rec_head_size(ndim), data, &total))
        return TS_EMSGSIZE;
#if SIZE_MAX < UINT64_MAX
    if (total > SIZE_MAX)
        return TS_EMSGSIZE;
#endif
    *size = total;
    return 0;
}

void ts__rows_rec_head_write(uint8_t *out, uint8_t dtype, unsigned ndim, const uint64_t *dims,
                             uint64_t data_len)
{
    size_t head = ts__rows_rec_head_size(ndim);
    memset(out, 0, head);
    out[0] = TS_REC_MAGIC0;
    out[1] = TS_REC_MAGIC1;
    out[2] = TS_REC_MAGIC2;
    out[3] = TS_REC_MAGIC3;
    ts__put_u32le(out + 4, TENSOR_META(ndim));
    ts__put_u64le(out + 8, data_len);
    uint8_t *p = out + TS_REC_HDR_SIZE;
    *p++ = REC_TYPE_TENSOR;
    *p++ = dtype;
    *p++ = (uint8_t)ndim;
    p += 2; /* reserved, zero */
    for (unsigned i = 0; i < ndim; i++, p += 8)
        ts__put_u64le(p, dims[i]);
    ts__put_u64le(p, 0); /* data_off: the tensor is the only range */
    ts__put_u64le(p + 8, data_len);
}
