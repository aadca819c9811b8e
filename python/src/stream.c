/*
 * stream.c: streams (include/tensorshare/stream.h) for Python.
 *
 * - The Client methods stream_create, stream_append, stream_mark, stream_credit, stream_join,
 *   stream_read, stream_ack, stream_leave, stream_info and stream_range: one low-level call
 *   each (client.c lists them through TSP_STREAM_CLIENT_METHODS).
 * - tensorshare.StreamEntry (a struct sequence) and tensorshare.StreamEntries (a list of them with
 *   the first_id, last_id and lost of the read): what stream_read and stream_range return.
 * - _StreamProducer and _StreamConsumer over the library's producer and consumer helpers, which
 *   python/tensorshare/stream.py subclasses into tensorshare.StreamProducer and StreamConsumer.
 *   Re-slicing into batches of batch_rows rows and the acknowledgements are the library's: this
 *   file only converts values and manages the waits.
 *
 * Waits: every call that may wait long (a read or range with a timeout, stream_credit, a push
 * waiting for credit, a consumer waiting for entries) is cut into slices of at most
 * TSP_STREAM_SLICE_MS with the GIL released, checking for signals (Ctrl-C) between two slices,
 * and for a close() from another thread: of the Client in its methods, of the producer or the
 * consumer in theirs (CancelledError at the end of the slice). A timeout of None
 * waits as long as it takes, in such slices.
 *
 * Threads: the library's producer and consumer are used by one thread at a time. Each Python
 * object has a lock that a call holds for as long as it uses the C object (waited for with the
 * GIL released), so several Python threads may share one; close() from another thread stops a
 * running wait at the end of its slice (CancelledError there) and then frees the C object.
 * Both objects enter their Client for their whole life (closing the Client takes effect once
 * they are closed), like the RL helpers.
 */
#include "tsp.h"

#include <limits.h>
#include <pythread.h>
#include <stdio.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

#include <tensorshare/stream.h>

/* ms; the longest piece of a wait before signals and close() are checked (Ctrl-C stays
 * responsive, and a close() from another thread takes effect within it) */
#define TSP_STREAM_SLICE_MS 250
/* entries a stream_read or stream_range asks for when the caller does not say */
#define TSP_STREAM_DEFAULT_READ 64

/* ---------------------------------------------------------------------------------------------
 * Arguments
 */

/* An int argument from 0 to max (NULL: *out unchanged); -1 with an exception (tsp_uint_arg). */
static int uint_arg(PyObject *obj, const char *what, unsigned long long max,
                    unsigned long long *out)
{
    return tsp_uint_arg(obj, what, 0, max, out);
}

static int u32_arg(PyObject *obj, const char *what, uint32_t *out)
{
    unsigned long long v = *out;
    if (uint_arg(obj, what, UINT32_MAX, &v) < 0)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

static int u64_arg(PyObject *obj, const char *what, uint64_t *out)
{
    unsigned long long v = *out;
    if (uint_arg(obj, what, ULLONG_MAX, &v) < 0)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

/* A count of milliseconds that fits the library's int (NULL: *out unchanged). */
static int ms_arg(PyObject *obj, const char *what, int *out)
{
    unsigned long long v = (unsigned long long)*out;
    if (uint_arg(obj, what, INT_MAX, &v) < 0)
        return -1;
    *out = (int)v;
    return 0;
}

/* A timeout in ms named what: None (or absent) gives TS_TIMEOUT_INFINITE, else 0..INT_MAX. */
static int timeout_ms_arg(PyObject *obj, const char *what, int *out)
{
    return tsp_ms_arg(obj, what, TS_TIMEOUT_INFINITE, out);
}

/* The UTF-8 of a name given as a str (valid while it lives), refusing NUL characters, which
 * would cut it short in the library. NULL with an exception. */
static const char *name_arg(PyObject *obj, const char *what)
{
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &len);
    if (s == NULL)
        return NULL;
    if ((size_t)len != strlen(s)) {
        char msg[64];
        snprintf(msg, sizeof(msg), "a %s name cannot contain NUL characters", what);
        tsp_raise_msg(TS_EINVAL, msg);
        return NULL;
    }
    return s;
}

/* start="oldest" | "newest". */
static int start_arg(PyObject *obj, ts_stream_start_t *out)
{
    *out = TS_STREAM_OLDEST;
    if (obj == NULL)
        return 0;
    const char *s = PyUnicode_Check(obj) ? tsp_c_string(obj) : NULL;
    if (s != NULL && strcmp(s, "oldest") == 0)
        return 0;
    if (s != NULL && strcmp(s, "newest") == 0) {
        *out = TS_STREAM_NEWEST;
        return 0;
    }
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "start must be 'oldest' or 'newest', not %R", obj);
    return -1;
}

/* The settings of a stream, by name (max_entries, max_bytes, max_age_ms, window, lease_ms). */
enum { CFG_MAX_ENTRIES, CFG_MAX_BYTES, CFG_MAX_AGE_MS, CFG_WINDOW, CFG_LEASE_MS, CFG_N };
static const char *const cfg_names[CFG_N] = {"max_entries", "max_bytes", "max_age_ms", "window",
                                             "lease_ms"};

/* cfg from the settings given (NULL: the default); the server checks their ranges. */
static int config_from(PyObject *const objs[CFG_N], ts_stream_config_t *cfg)
{
    ts_stream_config_init(cfg);
    return u64_arg(objs[CFG_MAX_ENTRIES], "max_entries", &cfg->max_entries) < 0 ||
                   u64_arg(objs[CFG_MAX_BYTES], "max_bytes", &cfg->max_bytes) < 0 ||
                   u32_arg(objs[CFG_MAX_AGE_MS], "max_age_ms", &cfg->max_age_ms) < 0 ||
                   u32_arg(objs[CFG_WINDOW], "window", &cfg->window) < 0 ||
                   u32_arg(objs[CFG_LEASE_MS], "lease_ms", &cfg->lease_ms) < 0
               ? -1
               : 0;
}

/* cfg from a dict of settings (unknown keys: TypeError, as unknown keyword arguments). */
static int config_from_dict(PyObject *d, ts_stream_config_t *cfg)
{
    if (!PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "config must be a dict or None, not %s", Py_TYPE(d)->tp_name);
        return -1;
    }
    PyObject *objs[CFG_N] = {NULL};
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &key, &value)) {
        int found = 0;
        for (int i = 0; i < CFG_N && PyUnicode_Check(key); i++) {
            if (PyUnicode_CompareWithASCIIString(key, cfg_names[i]) == 0) {
                objs[i] = value;
                found = 1;
            }
        }
        if (!found) {
            PyErr_Format(PyExc_TypeError,
                         "unknown stream setting %R (max_entries, max_bytes, max_age_ms, window, "
                         "lease_ms)",
                         key);
            return -1;
        }
    }
    return config_from(objs, cfg);
}

/* ---------------------------------------------------------------------------------------------
 * Waits in slices
 */

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A wait of timeout_ms (TS_TIMEOUT_INFINITE: no limit) cut into slices. */
typedef struct slicer {
    int infinite;
    int64_t end; /* monotonic ms */
} slicer;

static slicer slicer_start(int timeout_ms)
{
    slicer s = {timeout_ms == TS_TIMEOUT_INFINITE, 0};
    if (!s.infinite)
        s.end = now_ms() + timeout_ms;
    return s;
}

/* The next slice: at most TSP_STREAM_SLICE_MS, and what is left (0 once it has passed). */
static int slicer_next(const slicer *s)
{
    if (s->infinite)
        return TSP_STREAM_SLICE_MS;
    int64_t left = s->end - now_ms();
    if (left <= 0)
        return 0;
    return left < TSP_STREAM_SLICE_MS ? (int)left : TSP_STREAM_SLICE_MS;
}

/* Whether the wait may go on after a slice: time is left, and no signal handler raised. -1
 * with the handler's exception (KeyboardInterrupt). */
static int slicer_more(const slicer *s)
{
    if (PyErr_CheckSignals() < 0)
        return -1;
    return s->infinite || now_ms() < s->end;
}

/*
 * The timeout a library helper is opened with for a wait of timeout_ms of ours: a slice that
 * divides it evenly (so that the whole wait is about timeout_ms), TSP_STREAM_SLICE_MS for no
 * limit, 0 for 0.
 */
static int helper_slice(int timeout_ms)
{
    if (timeout_ms == TS_TIMEOUT_INFINITE)
        return TSP_STREAM_SLICE_MS;
    if (timeout_ms <= TSP_STREAM_SLICE_MS)
        return timeout_ms;
    int n = (timeout_ms + TSP_STREAM_SLICE_MS - 1) / TSP_STREAM_SLICE_MS;
    return (timeout_ms + n - 1) / n;
}

/* ---------------------------------------------------------------------------------------------
 * Results
 */

static PyTypeObject *entry_type; /* tensorshare.StreamEntry */

/* A list of StreamEntry with what the read saw of the stream. */
typedef struct entries_object {
    PyListObject list;
    unsigned long long first_id;
    unsigned long long last_id;
    unsigned long long lost;
} entries_object;

static PyObject *entries_repr(PyObject *self_obj)
{
    entries_object *self = (entries_object *)self_obj;
    PyObject *items = PyList_Type.tp_repr(self_obj);
    if (items == NULL)
        return NULL;
    PyObject *r = PyUnicode_FromFormat("StreamEntries(%U, first_id=%llu, last_id=%llu, lost=%llu)",
                                       items, self->first_id, self->last_id, self->lost);
    Py_DECREF(items);
    return r;
}

static PyMemberDef entries_members[] = {
    {"first_id", T_ULONGLONG, offsetof(entries_object, first_id), READONLY,
     "the oldest id the stream kept when it was read"},
    {"last_id", T_ULONGLONG, offsetof(entries_object, last_id), READONLY,
     "the newest id of the stream when it was read"},
    {"lost", T_ULONGLONG, offsetof(entries_object, lost), READONLY,
     "entries the group lost to the replay window so far (0 from stream_range)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject entries_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare.StreamEntries",
    .tp_basicsize = sizeof(entries_object),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The entries of Client.stream_read or stream_range: a list of StreamEntry, oldest "
              "first, with the stream's first_id and last_id and the group's lost count when it "
              "was read.",
    .tp_repr = entries_repr,
    .tp_members = entries_members,
};

static PyStructSequence_Field entry_fields[] = {
    {"id", "the entry's id (1 for the first entry of the stream, then +1 each)"},
    {"value", "the record, converted as get() converts items; None for a marker"},
    {"is_marker", "True for an end-of-epoch marker"},
    {"tag", "the marker's tag (0 for a record)"},
    {"deliveries", "times the entry was handed out to the group (0 from stream_range)"},
    {"redelivered", "True when it had been handed out before"},
    {"rows_done", "rows of it recorded as consumed (stream_ack with rows)"},
    {NULL, NULL},
};
static PyStructSequence_Desc entry_desc = {"tensorshare.StreamEntry", "One entry of a stream read.",
                                           entry_fields, 7};

static void batch_release(void *arg)
{
    ts_stream_batch_free(arg);
}

/*
 * A batch as StreamEntries. Takes b: the tensors are views of its memory, which it keeps until
 * the last view is gone (freed at once when there are none, and on failure).
 */
static PyObject *entries_from_batch(ts_stream_batch_t *b, tsp_tensor_type_t tt)
{
    tsp_owner_t *owner = tsp_owner_new(batch_release, b);
    if (owner == NULL) {
        ts_stream_batch_free(b);
        return PyErr_NoMemory();
    }
    entries_object *l = (entries_object *)PyObject_CallNoArgs((PyObject *)&entries_type);
    if (l == NULL) {
        tsp_owner_unref(owner);
        return NULL;
    }
    l->first_id = ts_stream_batch_first_id(b);
    l->last_id = ts_stream_batch_last_id(b);
    l->lost = ts_stream_batch_lost(b);
    size_t n = ts_stream_batch_count(b);
    for (size_t i = 0; i < n; i++) {
        PyObject *e = PyStructSequence_New(entry_type);
        if (e == NULL)
            goto fail;
        const ts_value_t *v = ts_stream_batch_value(b, i);
        int marker = ts_stream_batch_is_marker(b, i);
        PyObject *value;
        if (marker || v == NULL) {
            value = Py_None;
            Py_INCREF(value);
        } else {
            value = tsp_value_to_py_ex(v, tt, owner);
        }
        PyStructSequence_SET_ITEM(e, 0, PyLong_FromUnsignedLongLong(ts_stream_batch_id(b, i)));
        PyStructSequence_SET_ITEM(e, 1, value);
        PyStructSequence_SET_ITEM(e, 2, PyBool_FromLong(marker));
        PyStructSequence_SET_ITEM(e, 3, PyLong_FromUnsignedLongLong(ts_stream_batch_tag(b, i)));
        PyStructSequence_SET_ITEM(e, 4, PyLong_FromUnsignedLong(ts_stream_batch_deliveries(b, i)));
        PyStructSequence_SET_ITEM(e, 5, PyBool_FromLong(ts_stream_batch_redelivered(b, i)));
        PyStructSequence_SET_ITEM(e, 6, PyLong_FromUnsignedLong(ts_stream_batch_rows_done(b, i)));
        /* A failed conversion left its slot NULL with an exception set. */
        int bad = value == NULL || PyErr_Occurred() != NULL;
        if (bad || PyList_Append((PyObject *)l, e) < 0) {
            Py_DECREF(e);
            goto fail;
        }
        Py_DECREF(e);
    }
    tsp_owner_unref(owner);
    return (PyObject *)l;
fail:
    Py_DECREF(l);
    tsp_owner_unref(owner);
    return NULL;
}

/* Credit as Python: None for "no limit" (UINT32_MAX), else the int. */
static PyObject *credit_to_py(uint32_t credit)
{
    if (credit == UINT32_MAX)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(credit);
}

static PyObject *state_to_py(const ts_stream_state_t *st)
{
    PyObject *credit = credit_to_py(st->credit);
    if (credit == NULL)
        return NULL;
    return Py_BuildValue(
        "{sKsKsKsIsIsIsNsI}", "first_id", (unsigned long long)st->first_id, "last_id",
        (unsigned long long)st->last_id, "bytes", (unsigned long long)st->bytes, "n_entries",
        (unsigned int)st->n_entries, "n_groups", (unsigned int)st->n_groups, "n_stale",
        (unsigned int)st->n_stale, "credit", credit, "window", (unsigned int)st->window);
}

/* ---------------------------------------------------------------------------------------------
 * Client methods
 */

PyObject *tsp_client_stream_create(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name",   "max_entries", "max_bytes", "max_age_ms",
                            "window", "lease_ms",    NULL};
    const char *name;
    PyObject *objs[CFG_N] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|OOOOO:stream_create", names, &name,
                                     &objs[CFG_MAX_ENTRIES], &objs[CFG_MAX_BYTES],
                                     &objs[CFG_MAX_AGE_MS], &objs[CFG_WINDOW], &objs[CFG_LEASE_MS]))
        return NULL;
    ts_stream_config_t cfg;
    if (config_from(objs, &cfg) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_stream_state_t st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_create(c, name, &cfg, &st);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? state_to_py(&st) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_append(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "value", NULL};
    const char *name;
    PyObject *value;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO:stream_append", names, &name, &value))
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, value) < 0) {
        tsp_client_leave(client);
        return NULL;
    }
    ts_stream_append_t res;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_append(c, name, s.value, &res);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? PyLong_FromUnsignedLongLong(res.id) : tsp_raise(rc);
    tsp_send_clear(&s);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_mark(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "tag", NULL};
    const char *name;
    PyObject *tag_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO:stream_mark", names, &name, &tag_obj))
        return NULL;
    uint64_t tag = 0;
    if (u64_arg(tag_obj, "tag", &tag) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_stream_append_t res;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_mark(c, name, tag, &res);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? PyLong_FromUnsignedLongLong(res.id) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_credit(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "timeout_ms", NULL};
    const char *name;
    PyObject *timeout_obj = NULL;
    int timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|O:stream_credit", names, &name, &timeout_obj) ||
        timeout_ms_arg(timeout_obj, "timeout_ms", &timeout_ms) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    slicer sl = slicer_start(timeout_ms);
    ts_stream_state_t st;
    int rc;
    int no_reply;
    for (;;) {
        int slice = slicer_next(&sl);
        PyThreadState *nogil = PyEval_SaveThread();
        rc = ts_stream_credit(c, name, slice, &st);
        no_reply = rc == TS_ETIMEDOUT && ts_last_error_no_reply();
        PyEval_RestoreThread(nogil);
        if (rc != TS_ETIMEDOUT || no_reply)
            break;
        int more = slicer_more(&sl);
        if (more > 0 && tsp_client_cancelled(client))
            more = -1;
        if (more < 0) {
            tsp_client_leave(client);
            return NULL;
        }
        if (!more)
            break;
    }
    PyObject *r;
    if (rc == TS_ETIMEDOUT && !no_reply)
        r = tsp_raise_msg(TS_ETIMEDOUT, "the stream's window stayed full for timeout_ms");
    else
        r = rc == 0 ? state_to_py(&st) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_join(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "group", "member", "start", "lease_ms", NULL};
    const char *name, *group, *member;
    PyObject *start_obj = NULL, *lease_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sss|OO:stream_join", names, &name, &group, &member,
                                     &start_obj, &lease_obj))
        return NULL;
    ts_stream_start_t start;
    int lease_ms = 0;
    if (start_arg(start_obj, &start) < 0 || ms_arg(lease_obj, "lease_ms", &lease_ms) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_stream_join_t j;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_join(c, name, group, member, start, lease_ms, &j);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? Py_BuildValue("{sKsKsKsIsIsI}", "next_id", (unsigned long long)j.next_id, "floor",
                                (unsigned long long)j.floor, "lost", (unsigned long long)j.lost,
                                "pending", (unsigned int)j.pending, "members",
                                (unsigned int)j.members, "rows_done", (unsigned int)j.rows_done)
                : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

/*
 * The optional arguments stream_read and stream_range share: the first id (ack_through or
 * after_id, named what), max_entries, timeout_ms (0 when absent) and tensor_type.
 */
static int read_args(PyObject *client, PyObject *id_obj, const char *what, PyObject *max_obj,
                     PyObject *timeout_obj, PyObject *tt_obj, uint64_t *id, size_t *max_entries,
                     int *timeout_ms, tsp_tensor_type_t *tt)
{
    unsigned long long max = TSP_STREAM_DEFAULT_READ;
    *id = 0;
    *timeout_ms = 0;
    if (u64_arg(id_obj, what, id) < 0 ||
        tsp_uint_arg(max_obj, "max_entries", 1, TS_STREAM_READ_MAX, &max) < 0 ||
        (timeout_obj != NULL && timeout_ms_arg(timeout_obj, "timeout_ms", timeout_ms) < 0) ||
        tsp_client_tensor_type_arg(tt_obj, client, tt) < 0)
        return -1;
    *max_entries = (size_t)max;
    return 0;
}

/*
 * stream_read and stream_range: one request per slice until entries come or the timeout
 * passes (then an empty StreamEntries). ack_through goes with the first request only.
 */
static PyObject *read_impl(PyObject *client, const char *name, const char *group,
                           const char *member, uint64_t ack_through, size_t max_entries,
                           int timeout_ms, tsp_tensor_type_t tt)
{
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    slicer sl = slicer_start(timeout_ms);
    ts_stream_batch_t *b = NULL;
    int rc;
    for (;;) {
        int slice = slicer_next(&sl);
        PyThreadState *nogil = PyEval_SaveThread();
        if (group != NULL)
            rc = ts_stream_read(c, name, group, member, ack_through, max_entries, slice, &b);
        else
            rc = ts_stream_range(c, name, ack_through, max_entries, slice, &b);
        PyEval_RestoreThread(nogil);
        if (rc != 0 || ts_stream_batch_count(b) > 0)
            break;
        int more = slicer_more(&sl);
        if (more > 0 && tsp_client_cancelled(client))
            more = -1;
        if (more <= 0) {
            if (more < 0) {
                ts_stream_batch_free(b);
                tsp_client_leave(client);
                return NULL;
            }
            break;
        }
        ts_stream_batch_free(b);
        b = NULL;
        if (group != NULL)
            ack_through = 0; /* done by the first request */
    }
    PyObject *r = rc == 0 ? entries_from_batch(b, tt) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_read(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name",        "group",      "member",      "ack_through",
                            "max_entries", "timeout_ms", "tensor_type", NULL};
    const char *name, *group, *member;
    PyObject *ack_obj = NULL, *max_obj = NULL, *timeout_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sss|OOO$O:stream_read", names, &name, &group,
                                     &member, &ack_obj, &max_obj, &timeout_obj, &tt_obj))
        return NULL;
    uint64_t ack_through;
    size_t max_entries;
    int timeout_ms;
    tsp_tensor_type_t tt;
    if (read_args(client, ack_obj, "ack_through", max_obj, timeout_obj, tt_obj, &ack_through,
                  &max_entries, &timeout_ms, &tt) < 0)
        return NULL;
    return read_impl(client, name, group, member, ack_through, max_entries, timeout_ms, tt);
}

PyObject *tsp_client_stream_range(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "after_id", "max_entries", "timeout_ms", "tensor_type", NULL};
    const char *name;
    PyObject *after_obj = NULL, *max_obj = NULL, *timeout_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|OOO$O:stream_range", names, &name, &after_obj,
                                     &max_obj, &timeout_obj, &tt_obj))
        return NULL;
    uint64_t after_id;
    size_t max_entries;
    int timeout_ms;
    tsp_tensor_type_t tt;
    if (read_args(client, after_obj, "after_id", max_obj, timeout_obj, tt_obj, &after_id,
                  &max_entries, &timeout_ms, &tt) < 0)
        return NULL;
    return read_impl(client, name, NULL, NULL, after_id, max_entries, timeout_ms, tt);
}

PyObject *tsp_client_stream_ack(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "group", "member", "first", "last", "rows", NULL};
    const char *name, *group, *member;
    PyObject *first_obj, *last_obj = NULL, *rows_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sssO|OO:stream_ack", names, &name, &group, &member,
                                     &first_obj, &last_obj, &rows_obj))
        return NULL;
    uint64_t first = 0, last;
    uint32_t rows = 0;
    if (u64_arg(first_obj, "first", &first) < 0)
        return NULL;
    last = first;
    if ((last_obj != Py_None && u64_arg(last_obj, "last", &last) < 0) ||
        u32_arg(rows_obj, "rows", &rows) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_stream_ack_t a;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_ack(c, name, group, member, first, last, rows, &a);
    Py_END_ALLOW_THREADS PyObject *r = NULL;
    if (rc == 0) {
        PyObject *credit = credit_to_py(a.credit);
        if (credit != NULL)
            r = Py_BuildValue("{sKsKsIsN}", "acked", (unsigned long long)a.acked, "floor",
                              (unsigned long long)a.floor, "pending", (unsigned int)a.pending,
                              "credit", credit);
    } else {
        tsp_raise(rc);
    }
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_leave(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "group", "member", NULL};
    const char *name, *group, *member = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|z:stream_leave", names, &name, &group, &member))
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_stream_state_t st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_leave(c, name, group, member, &st);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? state_to_py(&st) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_stream_info(PyObject *client, PyObject *args, PyObject *kw)
{
    PyObject *r = tsp_client_info(client, args, kw, "s:stream_info", ts_stream_info);
    /* The server says -1 for "no limit"; the other results of this module say None. */
    if (r != NULL && PyDict_Check(r)) {
        PyObject *credit = PyDict_GetItemString(r, "credit");
        if (credit != NULL && PyLong_Check(credit) && PyLong_AsLong(credit) == -1 &&
            PyDict_SetItemString(r, "credit", Py_None) < 0)
            Py_CLEAR(r);
    }
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * What the producer and the consumer share: the Client, the lock, close() from any thread
 */

typedef struct helper_base {
    PyObject_HEAD PyObject *client;       /* the tensorshare.Client, entered while handle is set */
    void *handle;                         /* the library's producer or consumer; NULL once freed */
    PyThread_type_lock lock;              /* held by the call using handle */
    int closing;                          /* close() was called: waits stop at the end of a slice */
    unsigned long fork_generation;        /* tsp_fork_generation when created */
    const char *what;                     /* "StreamProducer" or "StreamConsumer", for messages */
    PyObject *name;                       /* the stream's name (str) */
    unsigned long holder;                 /* the thread holding lock (0: none), under the GIL */
    int deferred;                         /* close() ran on the holder's thread: the holder frees */
    int close_arg;                        /* free_handle's argument for a deferred close */
    int (*free_handle)(void *h, int arg); /* frees handle; its result is close()'s */
} helper_base;

static int base_close(helper_base *b, int arg);

/* Take b's lock, waiting for it with the GIL released. */
static void base_lock(helper_base *b)
{
    if (!PyThread_acquire_lock(b->lock, NOWAIT_LOCK)) {
        Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock(b->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
}

/* -1 with RuntimeError when b already has a handle or a lock (__init__ called again). */
static int base_unused(const helper_base *b, const char *what)
{
    if (b->handle == NULL && b->lock == NULL)
        return 0;
    PyErr_Format(PyExc_RuntimeError, "%s.__init__ called twice", what);
    return -1;
}

/* A new reference to obj, or to None when obj is NULL. */
static PyObject *ref_or_none(PyObject *obj)
{
    PyObject *r = obj != NULL ? obj : Py_None;
    Py_INCREF(r);
    return r;
}

/*
 * Start a call: take the lock (waiting with the GIL released) and return the handle, or NULL
 * with an exception (closed, or used after fork) and the lock not held.
 */
static void *base_enter(helper_base *b)
{
    if (b->fork_generation != tsp_fork_generation && b->handle != NULL) {
        char msg[128];
        snprintf(msg, sizeof(msg), "this %s was created before os.fork(): create a new one here",
                 b->what);
        tsp_raise_msg(TS_ENOTCONN, msg);
        return NULL;
    }
    if (b->lock == NULL || b->handle == NULL || b->closing) {
        char msg[64];
        snprintf(msg, sizeof(msg), "the %s is %s", b->what,
                 b->lock == NULL ? "not initialised" : "closed");
        tsp_raise_msg(TS_ECANCELED, msg);
        return NULL;
    }
    if (b->holder == PyThread_get_thread_ident()) {
        /* A signal handler run between two slices of this thread's own wait. */
        char msg[96];
        snprintf(msg, sizeof(msg), "the %s is in use by this thread (a signal handler?)", b->what);
        PyErr_SetString(PyExc_RuntimeError, msg);
        return NULL;
    }
    base_lock(b);
    if (b->handle == NULL || b->closing) { /* closed while we waited */
        PyThread_release_lock(b->lock);
        char msg[64];
        snprintf(msg, sizeof(msg), "the %s is closed", b->what);
        tsp_raise_msg(TS_ECANCELED, msg);
        return NULL;
    }
    b->holder = PyThread_get_thread_ident();
    return b->handle;
}

/* End a call; when close() was called meanwhile on this thread, free the handle now. */
static void base_leave(helper_base *b)
{
    b->holder = 0;
    PyThread_release_lock(b->lock);
    if (b->deferred) {
        b->deferred = 0;
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb); /* the call's own result stands */
        base_close(b, b->close_arg);
        PyErr_Restore(type, value, tb);
    }
}

/* Whether a wait must stop because close() was called: raises CancelledError then. */
static int base_cancelled(helper_base *b)
{
    if (!b->closing)
        return 0;
    char msg[96];
    snprintf(msg, sizeof(msg), "the %s was closed during the wait", b->what);
    tsp_raise_msg(TS_ECANCELED, msg);
    return 1;
}

/*
 * Close: stop the waits of other threads (at the end of their slice), take the lock once the
 * running call has left, and free the handle with b->free_handle(h, arg) (GIL released), whose
 * result is returned; then leave the Client. 0 when there was nothing to free.
 *
 * On the thread that holds the lock (a signal handler that closes between two slices of its
 * own wait) taking the lock would wait for itself: the call in progress frees the handle when
 * it leaves instead. In a child after fork the library's threads are gone, and the lock may
 * have been held by one of them: the handle and the lock are left alone.
 */
static int base_close(helper_base *b, int arg)
{
    b->closing = 1;
    void *h = b->handle;
    if (h == NULL)
        return 0;
    if (b->fork_generation != tsp_fork_generation) {
        b->handle = NULL;
        tsp_client_leave(b->client);
        return 0;
    }
    if (b->holder == PyThread_get_thread_ident()) {
        b->deferred = 1;
        b->close_arg = arg;
        return 0;
    }
    base_lock(b);
    h = b->handle; /* NULL when another thread closed it while we waited */
    b->handle = NULL;
    int rc = 0;
    if (h != NULL) {
        int (*free_handle)(void *h, int arg) = b->free_handle;
        Py_BEGIN_ALLOW_THREADS rc = free_handle(h, arg);
        Py_END_ALLOW_THREADS
    }
    PyThread_release_lock(b->lock);
    if (h != NULL)
        tsp_client_leave(b->client);
    return rc;
}

/* Set up b for a new handle: lock, client reference (entered by the caller), name. */
static int base_init(helper_base *b, const char *what, PyObject *client, PyObject *name,
                     int (*free_handle)(void *h, int arg))
{
    b->what = what;
    if (base_unused(b, what) < 0)
        return -1;
    b->lock = PyThread_allocate_lock();
    if (b->lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(client);
    Py_XSETREF(b->client, client);
    Py_INCREF(name);
    Py_XSETREF(b->name, name);
    b->fork_generation = tsp_fork_generation;
    b->free_handle = free_handle;
    return 0;
}

/* A dealloc's first part: stop GC tracking, close (freeing the handle), drop b's fields. */
static void base_dealloc(PyObject *self_obj)
{
    helper_base *b = (helper_base *)self_obj;
    PyObject_GC_UnTrack(self_obj);
    base_close(b, 0);
    Py_CLEAR(b->client);
    Py_CLEAR(b->name);
    /* In a child after fork a parent's thread may have held it: left alone. */
    if (b->lock != NULL && b->fork_generation == tsp_fork_generation)
        PyThread_free_lock(b->lock);
    b->lock = NULL;
}

static int base_traverse(PyObject *self_obj, visitproc visit, void *arg)
{
    Py_VISIT(((helper_base *)self_obj)->client);
    return 0;
}

static PyObject *base_get_closed(PyObject *self_obj, void *closure)
{
    (void)closure;
    helper_base *b = (helper_base *)self_obj;
    return PyBool_FromLong(b->handle == NULL || b->closing);
}

static PyObject *base_get_client(PyObject *self_obj, void *closure)
{
    (void)closure;
    helper_base *b = (helper_base *)self_obj;
    return ref_or_none(b->handle != NULL ? b->client : NULL);
}

static PyObject *base_get_name(PyObject *self_obj, void *closure)
{
    (void)closure;
    return ref_or_none(((helper_base *)self_obj)->name);
}

static PyObject *base_enter_cm(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    Py_INCREF(self_obj);
    return self_obj;
}

/* ---------------------------------------------------------------------------------------------
 * _StreamProducer
 */

typedef struct producer_object {
    helper_base base;
    int block_ms;             /* ours: TS_TIMEOUT_INFINITE or 0..INT_MAX */
    unsigned long long last;  /* the id of the last push or marker (0: none) */
    unsigned long long waits; /* pushes that found the window full and waited */
} producer_object;

static int producer_free_handle(void *h, int unused)
{
    (void)unused;
    ts_stream_producer_free(h);
    return 0;
}

static int producer_init(PyObject *self_obj, PyObject *args, PyObject *kw)
{
    producer_object *self = (producer_object *)self_obj;
    static char *names[] = {"client", "name", "config", "block_ms", NULL};
    PyObject *client, *name_obj, *config = Py_None, *block_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OU|O$O:StreamProducer", names, &client, &name_obj,
                                     &config, &block_obj))
        return -1;
    const char *name = name_arg(name_obj, "stream");
    if (name == NULL)
        return -1;
    ts_stream_config_t cfg;
    int block_ms;
    if ((config != Py_None && config_from_dict(config, &cfg) < 0) ||
        timeout_ms_arg(block_obj, "block_ms", &block_ms) < 0)
        return -1;
    if (base_unused(&self->base, "StreamProducer") < 0)
        return -1;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return -1;
    ts_stream_producer_t *p = NULL;
    int slice = helper_slice(block_ms);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        ts_stream_producer_open(&p, c, name, config != Py_None ? &cfg : NULL, slice);
    Py_END_ALLOW_THREADS if (rc != 0)
    {
        tsp_raise(rc);
        tsp_client_leave(client);
        return -1;
    }
    if (base_init(&self->base, "StreamProducer", client, name_obj, producer_free_handle) < 0) {
        Py_BEGIN_ALLOW_THREADS ts_stream_producer_free(p);
        Py_END_ALLOW_THREADS tsp_client_leave(client);
        return -1;
    }
    self->base.handle = p;
    self->block_ms = block_ms;
    return 0;
}

static PyObject *producer_push(PyObject *self_obj, PyObject *value)
{
    producer_object *self = (producer_object *)self_obj;
    tsp_send_t s;
    if (tsp_send_init(&s, value) < 0)
        return NULL;
    ts_stream_producer_t *p = base_enter(&self->base);
    if (p == NULL) {
        tsp_send_clear(&s);
        return NULL;
    }
    /* The library waits one slice for credit per call (TS_ETIMEDOUT: nothing was stored). */
    slicer sl = slicer_start(self->block_ms);
    uint64_t waits_before = ts_stream_producer_waits(p);
    uint64_t id = 0;
    int rc;
    int no_reply;
    PyObject *r = NULL;
    for (;;) {
        PyThreadState *nogil = PyEval_SaveThread();
        rc = ts_stream_producer_push(p, s.value, &id);
        no_reply = rc == TS_ETIMEDOUT && ts_last_error_no_reply();
        PyEval_RestoreThread(nogil);
        if (rc != TS_ETIMEDOUT || no_reply)
            break;
        int more = slicer_more(&sl);
        if (more < 0 || base_cancelled(&self->base))
            goto out;
        if (!more)
            break;
    }
    if (rc == TS_ETIMEDOUT && !no_reply) {
        tsp_raise_msg(TS_ETIMEDOUT, "the stream's window stayed full for block_ms");
    } else if (rc == 0) {
        self->last = id;
        r = PyLong_FromUnsignedLongLong(id);
    } else {
        tsp_raise(rc);
    }
out:
    /* A push that waited counts once, however many slices its wait took. */
    if (ts_stream_producer_waits(p) != waits_before)
        self->waits++;
    base_leave(&self->base);
    tsp_send_clear(&s);
    return r;
}

static PyObject *producer_end_epoch(PyObject *self_obj, PyObject *tag_obj)
{
    producer_object *self = (producer_object *)self_obj;
    uint64_t tag = 0;
    if (u64_arg(tag_obj, "tag", &tag) < 0)
        return NULL;
    ts_stream_producer_t *p = base_enter(&self->base);
    if (p == NULL)
        return NULL;
    uint64_t id = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_producer_end_epoch(p, tag, &id);
    Py_END_ALLOW_THREADS base_leave(&self->base);
    if (rc != 0)
        return tsp_raise(rc);
    self->last = id;
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *producer_close(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    base_close(&((producer_object *)self_obj)->base, 0);
    Py_RETURN_NONE;
}

static PyObject *producer_exit_cm(PyObject *self_obj, PyObject *args)
{
    (void)args;
    PyObject *r = producer_close(self_obj, NULL);
    Py_XDECREF(r);
    if (r == NULL)
        return NULL;
    Py_RETURN_FALSE;
}

static PyObject *producer_get_waits(PyObject *self_obj, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(((producer_object *)self_obj)->waits);
}

static PyObject *producer_get_last_id(PyObject *self_obj, void *closure)
{
    (void)closure;
    return PyLong_FromUnsignedLongLong(((producer_object *)self_obj)->last);
}

static void producer_dealloc(PyObject *self_obj)
{
    base_dealloc(self_obj);
    Py_TYPE(self_obj)->tp_free(self_obj);
}

static PyMethodDef producer_methods[] = {
    {"push", producer_push, METH_O,
     "push(value) -> int\n\nAppend value (a record) to the stream and return its id, waiting "
     "for credit up to block_ms (TimeoutError after it; BackpressureError at once with "
     "block_ms=0)."},
    {"end_epoch", producer_end_epoch, METH_O,
     "end_epoch(tag) -> int\n\nAppend an end-of-epoch marker with tag (an int, such as the "
     "epoch number) and return its id. Never waits for credit."},
    {"close", producer_close, METH_NOARGS, "close(): free the producer (idempotent)."},
    {"__enter__", base_enter_cm, METH_NOARGS, NULL},
    {"__exit__", producer_exit_cm, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef producer_getset[] = {
    {"waits", producer_get_waits, NULL, "times a push found the window full and waited", NULL},
    {"last_id", producer_get_last_id, NULL, "the id of the last entry pushed (0: none)", NULL},
    {"name", base_get_name, NULL, "the stream's name", NULL},
    {"closed", base_get_closed, NULL, "True after close()", NULL},
    {"client", base_get_client, NULL, "the tensorshare.Client (None after close)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject producer_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare._StreamProducer",
    .tp_basicsize = sizeof(producer_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The stream producer of stream.h (see tensorshare.StreamProducer).",
    .tp_new = PyType_GenericNew,
    .tp_init = producer_init,
    .tp_dealloc = producer_dealloc,
    .tp_traverse = base_traverse,
    .tp_methods = producer_methods,
    .tp_getset = producer_getset,
};

/* ---------------------------------------------------------------------------------------------
 * _StreamConsumer
 */

typedef struct consumer_object {
    helper_base base;
    int timeout_ms;                             /* ours: TS_TIMEOUT_INFINITE or 0..INT_MAX */
    tsp_tensor_type_t tt;                       /* what tensors become */
    PyObject *group;                            /* str */
    PyObject *member;                           /* str */
    PyObject *epoch;                            /* the tag of the last marker (an int), or None */
    unsigned long long first_id, last_id, lost; /* of the last batch or marker */
} consumer_object;

/* Commit (to report a failure: ts_stream_consumer_close commits again, silently), then free. */
static int consumer_free_handle(void *h, int leave)
{
    int rc = ts_stream_consumer_commit(h);
    ts_stream_consumer_close(h, leave);
    return rc;
}

static int consumer_init(PyObject *self_obj, PyObject *args, PyObject *kw)
{
    consumer_object *self = (consumer_object *)self_obj;
    static char *names[] = {"client",     "name",        "group",    "member",
                            "start",      "batch_rows",  "prefetch", "lease_ms",
                            "timeout_ms", "tensor_type", NULL};
    PyObject *client, *name_obj, *group_obj, *member_obj = Py_None, *start_obj = NULL,
                                             *rows_obj = NULL, *prefetch_obj = NULL,
                                             *lease_obj = NULL, *timeout_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OUU|O$OOOOOO:StreamConsumer", names, &client,
                                     &name_obj, &group_obj, &member_obj, &start_obj, &rows_obj,
                                     &prefetch_obj, &lease_obj, &timeout_obj, &tt_obj))
        return -1;
    if (member_obj == Py_None)
        member_obj = group_obj;
    else if (!PyUnicode_Check(member_obj)) {
        PyErr_Format(PyExc_TypeError, "member must be a str or None, not %s",
                     Py_TYPE(member_obj)->tp_name);
        return -1;
    }
    const char *name = name_arg(name_obj, "stream");
    const char *group = name != NULL ? name_arg(group_obj, "group") : NULL;
    const char *member = group != NULL ? name_arg(member_obj, "member") : NULL;
    if (member == NULL)
        return -1;
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    unsigned long long prefetch = o.prefetch;
    int timeout_ms;
    tsp_tensor_type_t tt;
    if (start_arg(start_obj, &o.start) < 0 || u32_arg(rows_obj, "batch_rows", &o.batch_rows) < 0 ||
        uint_arg(prefetch_obj, "prefetch", TS_STREAM_READ_MAX, &prefetch) < 0 ||
        ms_arg(lease_obj, "lease_ms", &o.lease_ms) < 0 ||
        timeout_ms_arg(timeout_obj, "timeout_ms", &timeout_ms) < 0 ||
        tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return -1;
    if (prefetch == 0) {
        PyErr_Format(PyExc_ValueError, "prefetch must be an int from 1 to %d, not 0",
                     TS_STREAM_READ_MAX);
        return -1;
    }
    o.prefetch = (uint32_t)prefetch;
    o.timeout_ms = helper_slice(timeout_ms);
    if (base_unused(&self->base, "StreamConsumer") < 0)
        return -1;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return -1;
    ts_stream_consumer_t *s = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_consumer_open(&s, c, name, group, member, &o);
    Py_END_ALLOW_THREADS if (rc != 0)
    {
        tsp_raise(rc);
        tsp_client_leave(client);
        return -1;
    }
    if (base_init(&self->base, "StreamConsumer", client, name_obj, consumer_free_handle) < 0) {
        Py_BEGIN_ALLOW_THREADS ts_stream_consumer_close(s, 0);
        Py_END_ALLOW_THREADS tsp_client_leave(client);
        return -1;
    }
    self->base.handle = s;
    self->timeout_ms = timeout_ms;
    self->tt = tt;
    Py_INCREF(group_obj);
    Py_XSETREF(self->group, group_obj);
    Py_INCREF(member_obj);
    Py_XSETREF(self->member, member_obj);
    Py_INCREF(Py_None);
    Py_XSETREF(self->epoch, Py_None);
    return 0;
}

/*
 * The next batch as Python; at a marker, NULL with *marker = 1 and no exception. NULL with an
 * exception on failure (TimeoutError when nothing came within the consumer's timeout).
 */
static PyObject *consumer_next_impl(consumer_object *self, int *marker)
{
    *marker = 0;
    ts_stream_consumer_t *s = base_enter(&self->base);
    if (s == NULL)
        return NULL;
    slicer sl = slicer_start(self->timeout_ms);
    ts_value_t *v = NULL;
    ts_stream_item_t info;
    int rc;
    int no_reply;
    for (;;) {
        PyThreadState *nogil = PyEval_SaveThread();
        rc = ts_stream_consumer_next(s, &v, &info);
        no_reply = rc == TS_ETIMEDOUT && ts_last_error_no_reply();
        PyEval_RestoreThread(nogil);
        if (rc != TS_ETIMEDOUT || no_reply)
            break;
        int more = slicer_more(&sl);
        if (more < 0 || base_cancelled(&self->base)) {
            base_leave(&self->base);
            return NULL;
        }
        if (!more)
            break;
    }
    base_leave(&self->base);
    if (rc == TS_ETIMEDOUT && !no_reply)
        return tsp_raise_msg(TS_ETIMEDOUT, "no entry came within the consumer's timeout_ms");
    if (rc != 0)
        return tsp_raise(rc);
    self->first_id = info.first_id;
    self->last_id = info.last_id;
    self->lost = info.lost;
    if (info.end_of_epoch) {
        ts_value_free(v); /* NULL for a marker; freed in case */
        PyObject *tag = PyLong_FromUnsignedLongLong(info.tag);
        if (tag == NULL)
            return NULL;
        Py_XSETREF(self->epoch, tag);
        *marker = 1;
        return NULL;
    }
    if (v == NULL)
        return tsp_raise_msg(TS_EPROTO, "the stream consumer handed out no value");
    /*
     * The batch counts as consumed from here (the library acknowledges it with the next read):
     * when the conversion fails (no memory), it is not handed out again.
     */
    return tsp_value_to_py_owned(v, self->tt);
}

static PyObject *consumer_iternext(PyObject *self_obj)
{
    int marker;
    return consumer_next_impl((consumer_object *)self_obj, &marker);
}

static PyObject *consumer_read(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    int marker;
    PyObject *r = consumer_next_impl((consumer_object *)self_obj, &marker);
    if (r == NULL && marker)
        Py_RETURN_NONE;
    return r;
}

static PyObject *consumer_iter(PyObject *self_obj)
{
    Py_INCREF(self_obj);
    return self_obj;
}

static PyObject *consumer_commit(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    consumer_object *self = (consumer_object *)self_obj;
    ts_stream_consumer_t *s = base_enter(&self->base);
    if (s == NULL)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stream_consumer_commit(s);
    Py_END_ALLOW_THREADS base_leave(&self->base);
    if (rc != 0)
        return tsp_raise(rc);
    Py_RETURN_NONE;
}

static PyObject *consumer_close(PyObject *self_obj, PyObject *args, PyObject *kw)
{
    consumer_object *self = (consumer_object *)self_obj;
    static char *names[] = {"leave", NULL};
    int leave = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|p:close", names, &leave))
        return NULL;
    int rc = base_close(&self->base, leave);
    if (rc != 0)
        return tsp_raise(rc);
    Py_RETURN_NONE;
}

static PyObject *consumer_exit_cm(PyObject *self_obj, PyObject *args)
{
    /* An exception leaving the with block wins over a failed commit. */
    PyObject *exc_type =
        PyTuple_Check(args) && PyTuple_GET_SIZE(args) > 0 ? PyTuple_GET_ITEM(args, 0) : Py_None;
    PyObject *empty = PyTuple_New(0);
    if (empty == NULL)
        return NULL;
    PyObject *r = consumer_close(self_obj, empty, NULL);
    Py_DECREF(empty);
    if (r == NULL) {
        if (exc_type == Py_None)
            return NULL;
        PyErr_Clear();
    }
    Py_XDECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *consumer_get_epoch(PyObject *self_obj, void *closure)
{
    (void)closure;
    return ref_or_none(((consumer_object *)self_obj)->epoch);
}

static PyObject *consumer_get_group(PyObject *self_obj, void *closure)
{
    (void)closure;
    return ref_or_none(((consumer_object *)self_obj)->group);
}

static PyObject *consumer_get_member(PyObject *self_obj, void *closure)
{
    (void)closure;
    return ref_or_none(((consumer_object *)self_obj)->member);
}

static void consumer_dealloc(PyObject *self_obj)
{
    consumer_object *self = (consumer_object *)self_obj;
    base_dealloc(self_obj);
    Py_CLEAR(self->group);
    Py_CLEAR(self->member);
    Py_CLEAR(self->epoch);
    Py_TYPE(self_obj)->tp_free(self_obj);
}

static PyMethodDef consumer_methods[] = {
    {"read", consumer_read, METH_NOARGS,
     "read() -> batch or None\n\nThe next batch, or None at an end-of-epoch marker (its tag is "
     "then in .epoch). TimeoutError when nothing came within timeout_ms."},
    {"commit", consumer_commit, METH_NOARGS,
     "commit() -> None\n\nAcknowledge now everything handed out (rows included), so that a "
     "consumer that joins again resumes right after it."},
    {"close", (PyCFunction)(void (*)(void))consumer_close, METH_VARARGS | METH_KEYWORDS,
     "close(leave=False) -> None\n\nCommit, then free the consumer. The member stays in its "
     "group (a consumer of the same group and member resumes after what was committed) unless "
     "leave=True. Idempotent."},
    {"__enter__", base_enter_cm, METH_NOARGS, NULL},
    {"__exit__", consumer_exit_cm, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef consumer_members[] = {
    {"first_id", T_ULONGLONG, offsetof(consumer_object, first_id), READONLY,
     "the oldest entry the last batch's rows came from"},
    {"last_id", T_ULONGLONG, offsetof(consumer_object, last_id), READONLY,
     "the newest entry the last batch's rows came from (or the last marker's id)"},
    {"lost", T_ULONGLONG, offsetof(consumer_object, lost), READONLY,
     "entries the group lost to the replay window so far"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef consumer_getset[] = {
    {"epoch", consumer_get_epoch, NULL, "the tag of the last end-of-epoch marker (None: none yet)",
     NULL},
    {"group", consumer_get_group, NULL, "the group's name", NULL},
    {"member", consumer_get_member, NULL, "the member's name", NULL},
    {"name", base_get_name, NULL, "the stream's name", NULL},
    {"closed", base_get_closed, NULL, "True after close()", NULL},
    {"client", base_get_client, NULL, "the tensorshare.Client (None after close)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static int consumer_traverse(PyObject *self_obj, visitproc visit, void *arg)
{
    consumer_object *self = (consumer_object *)self_obj;
    Py_VISIT(self->epoch);
    return base_traverse(self_obj, visit, arg);
}

static PyTypeObject consumer_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare._StreamConsumer",
    .tp_basicsize = sizeof(consumer_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The stream consumer of stream.h (see tensorshare.StreamConsumer).",
    .tp_new = PyType_GenericNew,
    .tp_init = consumer_init,
    .tp_dealloc = consumer_dealloc,
    .tp_traverse = consumer_traverse,
    .tp_iter = consumer_iter,
    .tp_iternext = consumer_iternext,
    .tp_methods = consumer_methods,
    .tp_members = consumer_members,
    .tp_getset = consumer_getset,
};

/* ---------------------------------------------------------------------------------------------
 * Module init
 */

int tsp_stream_init(PyObject *module)
{
    entries_type.tp_base = &PyList_Type;
    if (tsp_add_type(module, &entries_type, "StreamEntries") < 0 ||
        tsp_add_type(module, &producer_type, "_StreamProducer") < 0 ||
        tsp_add_type(module, &consumer_type, "_StreamConsumer") < 0)
        return -1;
    entry_type = PyStructSequence_NewType(&entry_desc);
    if (entry_type == NULL)
        return -1;
    Py_INCREF(entry_type);
    if (PyModule_AddObject(module, "StreamEntry", (PyObject *)entry_type) < 0) {
        Py_DECREF(entry_type);
        return -1;
    }
    if (PyModule_AddIntConstant(module, "STREAM_READ_MAX", TS_STREAM_READ_MAX) < 0 ||
        PyModule_AddIntConstant(module, "STREAM_ENTRIES_MAX", (long)TS_STREAM_ENTRIES_MAX) < 0 ||
        PyModule_AddIntConstant(module, "STREAM_DEFAULT_LEASE_MS", TS_STREAM_DEFAULT_LEASE_MS) < 0)
        return -1;
    return 0;
}
