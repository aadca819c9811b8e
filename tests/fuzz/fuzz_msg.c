/*
 * Fuzz target: every decoder of the message codec (src/msg.c). The first input byte picks a body
 * (a request of an opcode, or a reply of an opcode with a status); the rest is the body. A body
 * that decodes must encode back to the same bytes, the decoder picked by the opcode must agree
 * with the decoder of the body's own kind, and the walks over ITEMS, LIST, ENTRIES and REF_ITEMS
 * bodies must stay inside the body (a REF_ITEMS descriptor entry inside its file_len). The
 * streaming PUT head must agree with the whole-body decoder at every split. The last selector
 * drives tensord's request parsing instead: the header check (ts__msg_request_check) on 24 header
 * bytes and a connection state, then the body decoder of the opcode it admits, as server/conn.c and
 * server/ops.c call them.
 */
#include "fuzz.h"

#include "msg.h"

/* Bytes; the re-encoding buffer. Bodies the target sees are shorter (libFuzzer's -max_len). */
#define FZ_MAX_BODY (1u << 20)

/* The bodies the selector byte picks from: direction, opcode, status. */
static const struct {
    uint8_t request;
    uint8_t op;
    uint16_t status;
} pick[] = {
    {1, TS_OP_HELLO, 0},
    {1, TS_OP_PING, 0},
    {1, TS_OP_PUT, 0},
    {1, TS_OP_APPEND, 0},
    {1, TS_OP_GET, 0},
    {1, TS_OP_PEEK, 0},
    {1, TS_OP_DELETE, 0},
    {1, TS_OP_LIST, 0},
    {1, TS_OP_LISTEN, 0},
    {1, TS_OP_UNLISTEN, 0},
    {1, TS_OP_WAIT, 0},
    {1, TS_OP_STATS, 0},
    {1, TS_OP_SAVE, 0},
    {0, TS_OP_HELLO, TS_ST_OK},
    {0, TS_OP_PING, TS_ST_OK},
    {0, TS_OP_PUT, TS_ST_OK},
    {0, TS_OP_GET, TS_ST_OK},
    {0, TS_OP_PEEK, TS_ST_OK},
    {0, TS_OP_LIST, TS_ST_OK},
    {0, TS_OP_UNLISTEN, TS_ST_OK},
    {0, TS_OP_WAIT, TS_ST_OK},
    {0, TS_OP_WAIT, TS_ST_TIMEOUT},
    {0, TS_OP_STATS, TS_ST_OK},
    {0, TS_OP_NOTIFY, TS_ST_OK},
    {0, TS_OP_GET, TS_ST_NOT_FOUND},
    {0, 0, TS_ST_SHUTTING_DOWN},
    {2, 0, 0}, /* a request header and its body: see request_input */
    /* Streams, after the request mode so that the seeds' selectors keep their meaning. */
    {1, TS_OP_STREAM_CREATE, 0},
    {1, TS_OP_STREAM_APPEND, 0},
    {1, TS_OP_STREAM_MARK, 0},
    {1, TS_OP_STREAM_CREDIT, 0},
    {1, TS_OP_STREAM_JOIN, 0},
    {1, TS_OP_STREAM_READ, 0},
    {1, TS_OP_STREAM_ACK, 0},
    {1, TS_OP_STREAM_LEAVE, 0},
    {1, TS_OP_STREAM_INFO, 0},
    {1, TS_OP_STREAM_RANGE, 0},
    {0, TS_OP_STREAM_CREATE, TS_ST_OK},
    {0, TS_OP_STREAM_APPEND, TS_ST_OK},
    {0, TS_OP_STREAM_JOIN, TS_ST_OK},
    {0, TS_OP_STREAM_READ, TS_ST_OK},
    {0, TS_OP_STREAM_ACK, TS_ST_OK},
    {0, TS_OP_STREAM_INFO, TS_ST_OK},
    {0, TS_OP_STREAM_RANGE, TS_ST_OK},
    {0, TS_OP_STREAM_APPEND, TS_ST_BACKPRESSURE},
    /* By reference and rows, after the streams for the same reason. */
    {0, TS_OP_GET_REF, TS_ST_OK},
    {0, TS_OP_PEEK_REF, TS_ST_OK},
    {1, TS_OP_PUT_FD, 0},
    {1, TS_OP_APPEND_FD, 0},
    {1, TS_OP_TENSOR_BIN, 0},
    {1, TS_OP_READ_ROWS, 0},
    /* Coordination (ADD, PUT_IF): PUT_IF's head has 8 fixed bytes after the name. */
    {1, TS_OP_ADD, 0},
    {0, TS_OP_ADD, TS_ST_OK},
    {1, TS_OP_PUT_IF, 0},
    {0, TS_OP_PUT_IF, TS_ST_VERSION_MISMATCH},
    {1, TS_OP_TAKE, 0},
    {1, TS_OP_MGET, 0},
    {0, TS_OP_MGET, TS_ST_OK},
    {1, TS_OP_BARRIER, 0},
    {0, TS_OP_BARRIER, TS_ST_OK},
    /* Replay tables: TABLE_INSERT's head has 16 fixed bytes after the name. */
    {1, TS_OP_TABLE_CREATE, 0},
    {1, TS_OP_TABLE_INSERT, 0},
    {1, TS_OP_TABLE_SAMPLE, 0},
    {1, TS_OP_TABLE_UPDATE, 0},
    {1, TS_OP_TABLE_REMOVE, 0},
    {0, TS_OP_TABLE_INSERT, TS_ST_OK},
    {0, TS_OP_TABLE_SAMPLE, TS_ST_OK},
    /* Parameter server: PS_PUSH's head has 16 fixed bytes after the name, EMB_PUSH's 8. */
    {1, TS_OP_PS_CREATE, 0},
    {1, TS_OP_PS_PUSH, 0},
    {1, TS_OP_PS_PULL, 0},
    {1, TS_OP_EMB_CREATE, 0},
    {1, TS_OP_EMB_PULL, 0},
    {1, TS_OP_EMB_PUSH, 0},
    {0, TS_OP_PS_PUSH, TS_ST_STALE_GRADIENT},
    {0, TS_OP_PS_PULL, TS_ST_OK},
    /* Services: SVC_CALL's head has 8 fixed bytes after the name, SVC_REPLY's 16. */
    {1, TS_OP_SVC_REGISTER, 0},
    {1, TS_OP_SVC_CALL, 0},
    {1, TS_OP_SVC_REPLY, 0},
    {0, TS_OP_SVC_REGISTER, TS_ST_OK},
    {0, TS_OP_SVC_CALL, TS_ST_OK},
    {0, TS_OP_SVC_REQUEST, TS_ST_OK},
    {0, TS_OP_SVC_CALL, TS_ST_SERVICE_GONE},
};

/* Body limits (bytes) the request mode picks --max-frame from: around the control limit, and big.
 */
static const uint64_t max_frames[4] = {TS_MAX_CTRL_BODY - 1, TS_MAX_CTRL_BODY, (uint64_t)1 << 20,
                                       UINT64_MAX};

static uint8_t again[FZ_MAX_BODY];

/*
 * The kind-specific decoder of kind gives the same answer as the one picked by opcode (fixed:
 * the opcode's upload_fixed, for the uploads).
 */
static void same_as_kind(ts__msg_kind kind, size_t fixed, const uint8_t *body, size_t len, int rc)
{
    union {
        ts__msg_hello_req hq;
        ts__msg_hello_rep hr;
        ts__msg_name_req nq;
        ts__msg_put_req pq;
        ts__msg_bin_state st;
        ts__msg_items it;
        ts__msg_list li;
        ts__msg_notify nt;
        ts__msg_error er;
        ts__msg_ref_items ri;
        ts__msg_put_fd_req pf;
        ts__msg_tensor_bin_req tb;
        ts__msg_read_rows_req rr;
        ts__msg_stream_create_req sc;
        ts__msg_stream_mark_req sm;
        ts__msg_stream_credit_req scr;
        ts__msg_stream_member_req smb;
        ts__msg_stream_range_req sr;
        ts__msg_stream_state ss;
        ts__msg_stream_append_state sa;
        ts__msg_stream_join_state sj;
        ts__msg_stream_ack_state sk;
        ts__msg_stream_entries se;
        ts__msg_coord_req cq;
        ts__msg_add_state as;
        ts__msg_barrier_state bs;
        ts__msg_mget_req mq;
        ts__msg_mget_rep mr;
        ts__msg_table_create_req tc;
        ts__msg_ps_create_req pc;
        ts__msg_ps_pull_req pp;
        ts__msg_table_sample_req tsq;
        ts__msg_table_keys_req tk;
        ts__msg_table_state tst;
        ts__msg_table_samples tss;
        ts__msg_svc_register_req svr;
        ts__msg_svc_state svs;
        ts__msg_svc_push svp;
    } u;
    int k;
    switch (kind) {
    case TS_MSG_EMPTY:
        k = ts__msg_empty_decode(body, len);
        break;
    case TS_MSG_HELLO_REQ:
        k = ts__msg_hello_req_decode(body, len, &u.hq);
        break;
    case TS_MSG_HELLO_REP:
        k = ts__msg_hello_rep_decode(body, len, &u.hr);
        break;
    case TS_MSG_NAME_REQ:
        k = ts__msg_name_req_decode(body, len, &u.nq);
        break;
    case TS_MSG_GET_REQ:
        k = ts__msg_get_req_decode(body, len, &u.nq);
        break;
    case TS_MSG_WAIT_REQ:
        k = ts__msg_wait_req_decode(body, len, &u.nq);
        break;
    case TS_MSG_PUT_REQ:
        k = ts__msg_upload_decode(body, len, fixed, &u.pq);
        break;
    case TS_MSG_BIN_STATE:
        k = ts__msg_bin_state_decode(body, len, &u.st);
        break;
    case TS_MSG_ITEMS:
        k = ts__msg_items_decode(body, len, &u.it);
        break;
    case TS_MSG_LIST_REP:
        k = ts__msg_list_decode(body, len, &u.li);
        break;
    case TS_MSG_RECORD:
        k = ts__msg_record_decode(body, len);
        break;
    case TS_MSG_NOTIFY:
        k = ts__msg_notify_decode(body, len, &u.nt);
        break;
    case TS_MSG_ERROR:
        k = ts__msg_error_decode(body, len, &u.er);
        break;
    case TS_MSG_REF_ITEMS:
        k = ts__msg_ref_decode(body, len, &u.ri);
        break;
    case TS_MSG_PUT_FD_REQ:
        k = ts__msg_put_fd_req_decode(body, len, &u.pf);
        break;
    case TS_MSG_TENSOR_BIN_REQ:
        k = ts__msg_tensor_bin_req_decode(body, len, &u.tb);
        break;
    case TS_MSG_READ_ROWS_REQ:
        k = ts__msg_read_rows_req_decode(body, len, &u.rr);
        break;
    case TS_MSG_STREAM_CREATE_REQ:
        k = ts__msg_stream_create_req_decode(body, len, &u.sc);
        break;
    case TS_MSG_STREAM_MARK_REQ:
        k = ts__msg_stream_mark_req_decode(body, len, &u.sm);
        break;
    case TS_MSG_STREAM_CREDIT_REQ:
        k = ts__msg_stream_credit_req_decode(body, len, &u.scr);
        break;
    case TS_MSG_STREAM_JOIN_REQ:
        k = ts__msg_stream_join_req_decode(body, len, &u.smb);
        break;
    case TS_MSG_STREAM_READ_REQ:
        k = ts__msg_stream_read_req_decode(body, len, &u.smb);
        break;
    case TS_MSG_STREAM_ACK_REQ:
        k = ts__msg_stream_ack_req_decode(body, len, &u.smb);
        break;
    case TS_MSG_STREAM_LEAVE_REQ:
        k = ts__msg_stream_leave_req_decode(body, len, &u.smb);
        break;
    case TS_MSG_STREAM_RANGE_REQ:
        k = ts__msg_stream_range_req_decode(body, len, &u.sr);
        break;
    case TS_MSG_STREAM_STATE:
        k = ts__msg_stream_state_decode(body, len, &u.ss);
        break;
    case TS_MSG_STREAM_APPEND_STATE:
        k = ts__msg_stream_append_state_decode(body, len, &u.sa);
        break;
    case TS_MSG_STREAM_JOIN_STATE:
        k = ts__msg_stream_join_state_decode(body, len, &u.sj);
        break;
    case TS_MSG_STREAM_ACK_STATE:
        k = ts__msg_stream_ack_state_decode(body, len, &u.sk);
        break;
    case TS_MSG_STREAM_ENTRIES:
        k = ts__msg_stream_entries_decode(body, len, &u.se);
        break;
    case TS_MSG_ADD_REQ:
        k = ts__msg_add_req_decode(body, len, &u.cq);
        break;
    case TS_MSG_ADD_STATE:
        k = ts__msg_add_state_decode(body, len, &u.as);
        break;
    case TS_MSG_TAKE_REQ:
        k = ts__msg_take_req_decode(body, len, &u.cq);
        break;
    case TS_MSG_BARRIER_REQ:
        k = ts__msg_barrier_req_decode(body, len, &u.cq);
        break;
    case TS_MSG_BARRIER_STATE:
        k = ts__msg_barrier_state_decode(body, len, &u.bs);
        break;
    case TS_MSG_MGET_REQ:
        k = ts__msg_mget_req_decode(body, len, &u.mq);
        break;
    case TS_MSG_MGET_REP:
        k = ts__msg_mget_rep_decode(body, len, &u.mr);
        break;
    case TS_MSG_TABLE_CREATE_REQ:
        k = ts__msg_table_create_req_decode(body, len, &u.tc);
        break;
    case TS_MSG_PS_CREATE_REQ:
        k = ts__msg_ps_create_req_decode(body, len, &u.pc);
        break;
    case TS_MSG_EMB_CREATE_REQ:
        k = ts__msg_emb_create_req_decode(body, len, &u.pc);
        break;
    case TS_MSG_PS_PULL_REQ:
        k = ts__msg_ps_pull_req_decode(body, len, &u.pp);
        break;
    case TS_MSG_TABLE_SAMPLE_REQ:
        k = ts__msg_table_sample_req_decode(body, len, &u.tsq);
        break;
    case TS_MSG_TABLE_UPDATE_REQ:
        k = ts__msg_table_update_req_decode(body, len, &u.tk);
        break;
    case TS_MSG_TABLE_REMOVE_REQ:
        k = ts__msg_table_remove_req_decode(body, len, &u.tk);
        break;
    case TS_MSG_TABLE_STATE:
        k = ts__msg_table_state_decode(body, len, &u.tst);
        break;
    case TS_MSG_TABLE_SAMPLES:
        k = ts__msg_table_samples_decode(body, len, &u.tss);
        break;
    case TS_MSG_SVC_REGISTER_REQ:
        k = ts__msg_svc_register_req_decode(body, len, &u.svr);
        break;
    case TS_MSG_SVC_STATE:
        k = ts__msg_svc_state_decode(body, len, &u.svs);
        break;
    case TS_MSG_SVC_REQUEST:
        k = ts__msg_svc_push_decode(body, len, &u.svp);
        break;
    default:
        k = TS_EUNKNOWNOP;
        break;
    }
    FZ_CHECK(k == rc);
}

/* Walk a decoded ITEMS body: every record lies inside it, 64-byte aligned, in order. */
static void walk_items(const ts__msg_items *m)
{
    ts__msg_items_iter it;
    size_t off, len, end = (size_t)ts__items_head_size(m->n_items);
    uint32_t seen = 0;
    ts__msg_items_iter_init(m, &it);
    while (ts__msg_items_next(m, &it, &off, &len)) {
        FZ_CHECK(off == end && off % TS__ALIGN == 0);
        FZ_CHECK(len <= m->len - off);
        end = off + len + ts__msg_items_pad(len);
        seen++;
    }
    FZ_CHECK(seen == m->n_items && end == m->len);
}

/* Walk a decoded LIST body: the entries fill it exactly. */
static void walk_list(const ts__msg_list *m)
{
    ts__msg_list_iter it = {0, 0};
    ts__msg_list_entry e;
    size_t total = 0;
    uint32_t seen = 0;
    while (ts__msg_list_next(m, &it, &e)) {
        FZ_CHECK(e.name >= m->entries && e.name + e.name_len <= m->entries + m->entries_len);
        total += ts__msg_list_entry_size(e.name_len);
        seen++;
    }
    FZ_CHECK(seen == m->n && total == m->entries_len);
}

/*
 * Walk a decoded ENTRIES body: at most TS_STREAM_MAX_READ entries of known kinds, each record
 * inside the body, 64-byte aligned, right after the one before; markers without bytes; the
 * accessor by index agrees with the walk.
 */
static void walk_entries(const ts__msg_stream_entries *m)
{
    ts__msg_stream_entries_iter it;
    ts__msg_stream_entry e, g;
    uint64_t end = ts__msg_stream_entries_head_size(m->n);
    uint32_t seen = 0;
    FZ_CHECK(m->n <= TS_STREAM_MAX_READ);
    ts__msg_stream_entries_iter_init(m, &it);
    while (ts__msg_stream_entries_next(m, &it, &e)) {
        FZ_CHECK(e.kind == TS_STREAM_ENTRY_RECORD || e.kind == TS_STREAM_ENTRY_MARKER);
        FZ_CHECK((e.flags & ~TS_STREAM_ENTRY_REDELIVERED) == 0);
        if (e.kind == TS_STREAM_ENTRY_MARKER) {
            FZ_CHECK(e.record == NULL && e.len == 0);
        } else {
            FZ_CHECK(e.record == m->body + end && end % TS__ALIGN == 0 && e.tag == 0);
            FZ_CHECK(e.len <= m->len - end);
            end += e.len + ts__msg_items_pad(e.len);
        }
        /* Sampled: the accessor walks the entries before i, so every one would be quadratic. */
        if (seen % 61 == 0 || seen + 1 == m->n) {
            ts__msg_stream_entry_get(m, seen, &g);
            FZ_CHECK(g.id == e.id && g.len == e.len && g.record == e.record);
        }
        seen++;
    }
    FZ_CHECK(seen == m->n && end == m->len);
}

/*
 * Walk a decoded REF_ITEMS body as the client's descriptor lane does: at most TS_MAX_REF_ITEMS
 * entries of known where and flags; inline records inside the body, 64-byte aligned, right after
 * the one before, padded with zeros, with no file_len; descriptor entries 4096-aligned with
 * [offset, offset + length) inside file_len, as many as n_fds says; nothing after the last record.
 */
static void walk_ref(const ts__msg_ref_items *m)
{
    uint64_t end = ts__msg_ref_head_size(m->n_items);
    uint32_t fds = 0;
    FZ_CHECK(m->n_items <= TS_MAX_REF_ITEMS && end <= m->len && m->n_fds <= m->n_items);
    for (uint32_t i = 0; i < m->n_items; i++) {
        ts__msg_ref_entry e, again_e;
        ts__msg_ref_entry_get(m, i, &e);
        FZ_CHECK((e.flags & ~TS_REF_LIVE) == 0);
        if (e.where == TS_REF_FD) {
            FZ_CHECK(e.offset % TS_REF_FILE_ALIGN == 0);
            FZ_CHECK(e.length <= e.file_len && e.offset <= e.file_len - e.length);
            fds++;
        } else {
            FZ_CHECK(e.where == TS_REF_INLINE && e.file_len == 0);
            FZ_CHECK(e.offset == end && end % TS__ALIGN == 0);
            FZ_CHECK(e.length <= m->len - end);
            size_t pad = ts__msg_items_pad(e.length);
            FZ_CHECK(pad <= m->len - end - e.length);
            for (size_t j = 0; j < pad; j++)
                FZ_CHECK(m->body[end + e.length + j] == 0);
            end += e.length + pad;
        }
        /* The accessor reads the body only: the same entry twice. */
        ts__msg_ref_entry_get(m, i, &again_e);
        FZ_CHECK(again_e.where == e.where && again_e.offset == e.offset &&
                 again_e.length == e.length && again_e.file_len == e.file_len);
    }
    FZ_CHECK(fds == m->n_fds && end == m->len);
}

/* The name and key of a decoded row or descriptor request lie inside the body, which they fill. */
static void check_rows_reqs(const ts__msg *m, const uint8_t *body, size_t len)
{
    switch (m->kind) {
    case TS_MSG_PUT_FD_REQ:
        FZ_CHECK(m->u.put_fd.name_len <= TS_MAX_NAME_LEN && m->u.put_fd.name == body + 1);
        FZ_CHECK(len == ts__msg_put_fd_req_size(m->u.put_fd.name_len));
        break;
    case TS_MSG_TENSOR_BIN_REQ: {
        const ts__msg_tensor_bin_req *t = &m->u.tensor_bin;
        FZ_CHECK(t->name_len <= TS_MAX_NAME_LEN && t->name == body + 1);
        FZ_CHECK(len == ts__msg_tensor_bin_req_size(t->name_len, t->ndim));
        /* The dims kept are the body's first ones. */
        const uint8_t *dims = body + 1 + t->name_len + TS_MSG_TENSOR_BIN_FIXED;
        for (unsigned i = 0; i < t->ndim && i < TS_MAX_NDIM; i++)
            FZ_CHECK(t->dims[i] == ts__get_u64le(dims + 8 * (size_t)i));
        break;
    }
    case TS_MSG_READ_ROWS_REQ: {
        const ts__msg_read_rows_req *r = &m->u.read_rows;
        FZ_CHECK(r->name_len <= TS_MAX_NAME_LEN && r->name == body + 1);
        FZ_CHECK(r->key_len <= TS_MSG_MAX_ROWS_KEY && (r->key == NULL) == (r->key_len == 0));
        /* The key follows the name, the i32 item and the u16 key_len. */
        if (r->key != NULL)
            FZ_CHECK(r->key == body + 1 + r->name_len + 4 + 2);
        FZ_CHECK(len == ts__msg_read_rows_req_size(r->name_len, r->key_len));
        break;
    }
    default:
        break;
    }
}

/* Bytes; the largest tensor-bin record built per input (larger ones only have their size checked).
 */
#define FZ_MAX_ROWS_REC (64u << 10)

static uint8_t rows_rec[FZ_MAX_ROWS_REC];

/*
 * The record tensord preallocates for a TENSOR_BIN it takes (src/msg_rows.c): its size is the
 * 64-byte aligned head plus the data bytes, and the head written for zeroed data makes a valid
 * record (decoded, walked and re-encoded by ts__fz_check_record) whose data area starts right
 * after the head. An unknown dtype or a size past 64 bits is refused, never wrapped.
 */
static void tensor_bin_record(const ts__msg_tensor_bin_req *t)
{
    if (t->ndim > TS_MAX_NDIM)
        return;
    uint64_t size, data;
    int rc = ts__rows_rec_size(t->dtype, t->ndim, t->dims, &size);
    int rc_data = ts__rows_tensor_bytes(t->dtype, t->ndim, t->dims, &data);
    FZ_CHECK(rc == 0 || rc == TS_EINVAL || rc == TS_EMSGSIZE);
    if (rc == TS_EINVAL || rc_data != 0) {
        FZ_CHECK(rc == rc_data || (rc == TS_EMSGSIZE && rc_data == 0));
        FZ_CHECK(rc != TS_EINVAL || ts_dtype_size((ts_dtype_t)t->dtype) == 0);
        return;
    }
    if (rc != 0)
        return; /* the head and the data pass 64 bits (or size_t) together */
    size_t head = ts__rows_rec_head_size(t->ndim);
    FZ_CHECK(head % TS__ALIGN == 0 && size - head == data && size >= head);
    if (size > FZ_MAX_ROWS_REC)
        return;
    memset(rows_rec, 0, (size_t)size);
    ts__rows_rec_head_write(rows_rec, t->dtype, t->ndim, t->dims, data);
    ts__rec_info info;
    FZ_CHECK(ts__record_validate(rows_rec, (size_t)size, TS_MAX_DEPTH, TS_MAX_NDIM, &info) == 0);
    FZ_CHECK(info.data_start == head && info.n_nodes == 1);
    FZ_CHECK(ts__fz_check_record(rows_rec, (size_t)size) == 0);
}

/* The streaming upload head agrees with the whole body at every split of the first bytes. */
static void put_splits(size_t fixed, const uint8_t *body, size_t len, int rc)
{
    ts__msg_put_req whole = {0}, part;
    if (rc == 0)
        FZ_CHECK(ts__msg_upload_decode(body, len, fixed, &whole) == 0);
    size_t head = 1 + TS_MAX_NAME_LEN + fixed;
    size_t last = len < head ? len : head;
    for (size_t avail = 0; avail <= last; avail++) {
        int r = ts__msg_upload_head_decode(body, avail, len, fixed, &part);
        if (rc != 0) {
            FZ_CHECK(r != 0);
            continue;
        }
        FZ_CHECK(r == 0 || r == TS_EAGAIN);
        if (r == 0)
            FZ_CHECK(part.name == whole.name && part.name_len == whole.name_len &&
                     part.rec_len == whole.rec_len && part.head_len == whole.head_len);
        else
            FZ_CHECK(avail < whole.head_len);
    }
}

/*
 * The request mode: one state byte (bit 0: HELLO done, bit 1: LZ4 granted, bits 2-3: which
 * max_frames), 24 header bytes, then body bytes. The rule that decides must be the first one
 * broken in the documented order; what is admitted must fit the limits of its opcode, and its
 * body (when whole in the input) goes to the decoder tensord uses.
 */
static void request_input(const uint8_t *data, size_t size)
{
    if (size < 1 + TS_HDR_SIZE)
        return;
    ts__msg_conn_state st = {.helloed = data[0] & 1,
                             .lz4 = (data[0] >> 1) & 1,
                             .max_frame = max_frames[(data[0] >> 2) & 3]};
    const uint8_t *p = data + 1;
    const uint8_t *body = p + TS_HDR_SIZE;
    size_t avail = size - 1 - TS_HDR_SIZE;
    ts__hdr h, h2;
    ts__msg_hdr_rule rule, rule2;
    uint16_t status = ts__msg_request_check(p, &st, &h, &rule);
    /* Pure: the same bytes and state give the same answer. */
    FZ_CHECK(ts__msg_request_check(p, &st, &h2, &rule2) == status && rule2 == rule);
    FZ_CHECK(status == ts__msg_hdr_rule_status(rule));
    FZ_CHECK((status == TS_ST_OK) == (rule == TS_HDR_OK));
    ts__hdr d;
    int format_ok = ts__hdr_decode(p, TS_MAGIC_REQ, &d) == 0;
    /* The format rules come first: past them, the header decodes. */
    if (rule > TS_HDR_RESERVED || rule == TS_HDR_OK)
        FZ_CHECK(format_ok);
    if (rule >= TS_HDR_MAGIC && rule <= TS_HDR_RESERVED)
        FZ_CHECK(!format_ok);
    if (rule > TS_HDR_STATUS || rule == TS_HDR_OK)
        FZ_CHECK(d.status == 0);
    if (rule == TS_HDR_STATUS)
        FZ_CHECK(d.status != 0);
    /* Before HELLO, only a small HELLO or AUTH_CHALLENGE passes the connection rules. */
    if (!st.helloed && (rule > TS_HDR_NOT_HELLO || rule == TS_HDR_OK))
        FZ_CHECK((d.opcode == TS_OP_HELLO || d.opcode == TS_OP_AUTH_CHALLENGE) &&
                 d.body_len <= TS_MAX_PREAUTH_BODY);
    if (rule == TS_HDR_PREAUTH_SIZE || rule == TS_HDR_NOT_HELLO)
        FZ_CHECK(!st.helloed);
    if (rule == TS_HDR_LZ4)
        FZ_CHECK((d.flags & TS_FLAG_LZ4) && !st.lz4);
    if (rule == TS_HDR_MAX_FRAME)
        FZ_CHECK(d.body_len > st.max_frame);
    if (rule == TS_HDR_OPCODE || rule == TS_HDR_CTRL_SIZE)
        FZ_CHECK(d.body_len <= st.max_frame);
    const ts__msg_op *info = format_ok ? ts__msg_op_info(d.opcode) : NULL;
    if (rule == TS_HDR_OPCODE)
        FZ_CHECK(info == NULL || info->request == TS_MSG_NONE);
    if (rule == TS_HDR_CTRL_SIZE)
        FZ_CHECK(info != NULL && !info->upload && d.body_len > TS_MAX_CTRL_BODY);
    if (status != TS_ST_OK)
        return;
    FZ_CHECK(h.opcode == d.opcode && h.flags == d.flags && h.request_id == d.request_id &&
             h.body_len == d.body_len && h.status == 0);
    FZ_CHECK(info != NULL && info->request != TS_MSG_NONE);
    FZ_CHECK(!(h.flags & TS_FLAG_LZ4) || st.lz4);
    FZ_CHECK(h.body_len <= ts__msg_request_limit(h.opcode, st.helloed, st.max_frame));
    /* The body, as tensord reads it: a PUT head as it streams in, the others whole. */
    if (info->upload) {
        ts__msg_put_req m;
        int r = ts__msg_upload_head_decode(body, avail, h.body_len, info->upload_fixed, &m);
        FZ_CHECK(r == 0 || r == TS_EAGAIN || r == TS_EPROTO);
        if (r == 0)
            FZ_CHECK(m.head_len <= avail && m.head_len + m.rec_len == h.body_len);
    } else if (h.body_len <= avail) {
        ts__msg m;
        int r = ts__msg_request_decode(h.opcode, body, (size_t)h.body_len, &m);
        FZ_CHECK(r == 0 || r == TS_EPROTO);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size - 1 > FZ_MAX_BODY)
        return 0;
    size_t which = data[0] % TS__ARRAY_SIZE(pick);
    if (pick[which].request == 2) {
        request_input(data + 1, size - 1);
        return 0;
    }
    const uint8_t *body = data + 1;
    size_t len = size - 1;
    ts__msg m;
    ts__msg_kind kind;
    int rc;
    if (pick[which].request) {
        rc = ts__msg_request_decode(pick[which].op, body, len, &m);
        kind = (ts__msg_kind)ts__msg_op_info(pick[which].op)->request;
    } else {
        rc = ts__msg_reply_decode(pick[which].op, pick[which].status, body, len, &m);
        kind = ts__msg_reply_kind(pick[which].op, pick[which].status);
    }
    FZ_CHECK(rc == 0 || rc == TS_EPROTO);
    const ts__msg_op *info = ts__msg_op_info(pick[which].op);
    size_t fixed = info != NULL && pick[which].request ? info->upload_fixed : 0;
    same_as_kind(kind, fixed, body, len, rc);
    if (kind == TS_MSG_PUT_REQ)
        put_splits(fixed, body, len, rc);
    if (rc != 0)
        return 0;
    FZ_CHECK(m.kind == kind);
    check_rows_reqs(&m, body, len);
    if (kind == TS_MSG_TENSOR_BIN_REQ)
        tensor_bin_record(&m.u.tensor_bin);
    if (kind == TS_MSG_REF_ITEMS)
        walk_ref(&m.u.ref_items);

    /*
     * Decoded bodies encode back to the very same bytes. A TENSOR_BIN body may announce more dims
     * than a tensor has (the server answers INVALID): it decodes, and the encoder refuses it.
     */
    size_t n = 0;
    if (kind == TS_MSG_TENSOR_BIN_REQ && m.u.tensor_bin.ndim > TS_MAX_NDIM) {
        FZ_CHECK(ts__msg_encode(&m, again, sizeof(again), &n) == TS_EINVAL);
        return 0;
    }
    FZ_CHECK(ts__msg_encode(&m, again, sizeof(again), &n) == 0);
    if (kind == TS_MSG_EMPTY) {
        FZ_CHECK(len == 0);
    } else if (kind == TS_MSG_RECORD) {
        FZ_CHECK(len >= TS_REC_HDR_SIZE);
    } else {
        FZ_CHECK(n == len);
        FZ_CHECK(n == 0 || memcmp(again, body, n) == 0);
        /* One byte less room is refused without writing past it. */
        if (n > 0)
            FZ_CHECK(ts__msg_encode(&m, again, n - 1, &n) == TS_EMSGSIZE);
    }
    if (kind == TS_MSG_ITEMS)
        walk_items(&m.u.items);
    if (kind == TS_MSG_LIST_REP)
        walk_list(&m.u.list);
    if (kind == TS_MSG_STREAM_ENTRIES)
        walk_entries(&m.u.stream_entries);
    return 0;
}
