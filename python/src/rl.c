/*
 * rl.c: the RL helpers of rl.h for Python: tensorshare._tensorshare._RLTrainer and _RLWorker,
 * which python/tensorshare/rl.py subclasses into tensorshare.RLTrainer and RLWorker (adding the
 * Batch and Params named tuples). Both sit on a tensorshare.Client, entered for their whole
 * life (tsp_client_enter), so closing the Client takes effect once they are closed.
 *
 * Threads: every blocking call releases the GIL. A long or unlimited wait (collect, await) is
 * cut into slices of TSP_RL_SLICE_MS so that Ctrl-C (a signal handled between two slices) can
 * interrupt it. Several Python threads may share one trainer or worker: calls count themselves
 * as users, and close() frees the C object only when the last user has left, so a close from
 * another thread never frees it under a running call.
 *
 * The worker's on_event callback runs on the client's I/O thread (or in the constructor's
 * thread) with the GIL taken, while rl.c's worker may hold its lock: calling the worker's own
 * methods from it would deadlock, so they raise DeadlockError there.
 */
#include "tsp.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <tensorshare/rl.h>

/* ms; the longest piece of a wait before signals are checked (Ctrl-C stays responsive). */
#define TSP_RL_SLICE_MS 250

/* ---------------------------------------------------------------------------------------------
 * Shared helpers
 */

/*
 * A timeout argument in seconds: None gives none_ms, a number >= 0 its milliseconds (rounded
 * up, so a positive timeout never becomes "do not wait"), inf TS_TIMEOUT_INFINITE. 0 or -1.
 */
static int timeout_from_py(PyObject *obj, int none_ms, int *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = none_ms;
        return 0;
    }
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(s) || s < 0) {
        PyErr_SetString(PyExc_ValueError, "timeout must be None or a number of seconds >= 0");
        return -1;
    }
    double ms = ceil(s * 1000.0);
    *out = isinf(s) || ms >= (double)INT_MAX ? TS_TIMEOUT_INFINITE : (int)ms;
    return 0;
}

/* Monotonic milliseconds. */
static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A string option: None leaves *out NULL, a str gives its UTF-8 (valid while obj lives). */
static int opt_str(PyObject *obj, const char *what, const char **out)
{
    if (obj == NULL || obj == Py_None)
        return 0;
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a str or None", what);
        return -1;
    }
    *out = tsp_c_string(obj);
    if (*out == NULL && !PyErr_Occurred())
        PyErr_Format(tsp_state.InvalidArgumentError, "%s cannot contain NUL characters", what);
    return *out == NULL ? -1 : 0;
}

/* The options shared by the trainer and the worker, from keyword arguments. */
typedef struct rl_kw {
    PyObject *prefix, *params_bin, *data_bin, *timeout;
} rl_kw;

static int fill_options(ts_rl_options_t *o, const rl_kw *kw)
{
    ts_rl_options_init(o);
    if (opt_str(kw->prefix, "prefix", &o->prefix) < 0 ||
        opt_str(kw->params_bin, "params_bin", &o->params_bin) < 0 ||
        opt_str(kw->data_bin, "data_bin", &o->data_bin) < 0)
        return -1;
    if (o->params_bin == NULL)
        o->params_bin = "parameters";
    if (o->data_bin == NULL)
        o->data_bin = "data";
    int ms;
    if (timeout_from_py(kw->timeout, 30000, &ms) < 0) /* 0: do not wait, as rl.h allows */
        return -1;
    o->timeout_ms = ms;
    return 0;
}

/*
 * What the trainer and the worker have in common: the Client and the call accounting (u.handle
 * is the ts_rl_trainer_t or ts_rl_worker_t; freeing a worker waits for its adds and runs event
 * callbacks, which tsp_client_user_free allows by releasing the GIL).
 */
typedef struct rl_base {
    tsp_client_user u; /* first: the object's head */
    const char *what;  /* "RLTrainer" or "RLWorker", for messages */
} rl_base;

/* Start a call: the handle, or NULL with an exception (closed, or used after fork). */
static void *base_enter(rl_base *b)
{
    if (b->u.handle == NULL || b->u.closing) {
        char msg[64];
        snprintf(msg, sizeof(msg), "the %s is %s", b->what != NULL ? b->what : "object",
                 b->u.closing ? "closed" : "not initialised");
        tsp_raise_msg(TS_ECANCELED, msg);
        return NULL;
    }
    if (b->u.fork_generation != tsp_fork_generation) {
        char msg[128];
        snprintf(msg, sizeof(msg),
                 "this %s was created before os.fork(): create a new one in the child", b->what);
        tsp_raise_msg(TS_ENOTCONN, msg);
        return NULL;
    }
    b->u.users++;
    return b->u.handle;
}

/* What base_open hands to the trainer's or the worker's constructor, and what it made. */
typedef struct rl_open_arg {
    const ts_rl_options_t *options;
    void *handle; /* the ts_rl_trainer_t or ts_rl_worker_t made */
} rl_open_arg;

/*
 * The end of __init__ for both: enter client, make the C object with open_fn (an rl_open_arg
 * as its argument) and take both into b. 0, or -1 with an exception and b unchanged.
 */
static int base_open(rl_base *b, PyObject *client, PyObject *tt_obj, const ts_rl_options_t *o,
                     tsp_open_fn open_fn, void (*free_handle)(void *h))
{
    rl_open_arg a = {o, NULL};
    tsp_tensor_type_t tt;
    if (tsp_client_open(client, tt_obj, open_fn, &a, &tt) < 0)
        return -1;
    Py_INCREF(client);
    b->u.client = client;
    b->u.handle = a.handle;
    b->u.fork_generation = tsp_fork_generation;
    b->u.tensor_type = tt;
    b->u.free_handle = free_handle;
    return 0;
}

/*
 * Call wait_fn(ctx, slice) with the GIL released, in slices of at most TSP_RL_SLICE_MS, until
 * it answers other than TS_ETIMEDOUT, or with the client's own TS_ETIMEDOUT (tensord did not
 * answer: ts_last_error_no_reply), or timeout_ms (TS_TIMEOUT_INFINITE: no limit, 0: one call
 * that does not wait) has passed; between two slices a pending signal's handler runs, and a
 * close() of b from another thread ends the wait (TS_ECANCELED, within one slice). 0 with the
 * last answer in *rc, or -1 with the exception the handler raised.
 */
static int wait_in_slices(const rl_base *b, int timeout_ms, int (*wait_fn)(void *ctx, int slice_ms),
                          void *ctx, int *rc)
{
    int64_t deadline = timeout_ms > 0 ? now_ms() + timeout_ms : 0;
    for (;;) {
        int slice = timeout_ms;
        if (timeout_ms == TS_TIMEOUT_INFINITE) {
            slice = TSP_RL_SLICE_MS;
        } else if (timeout_ms > 0) {
            int64_t left = deadline - now_ms();
            slice = left <= 0 ? 0 : left > TSP_RL_SLICE_MS ? TSP_RL_SLICE_MS : (int)left;
        }
        PyThreadState *nogil = PyEval_SaveThread();
        *rc = wait_fn(ctx, slice);
        /* tensord did not answer (the client's own timeout): another slice would only add one. */
        int no_reply = *rc == TS_ETIMEDOUT && ts_last_error_no_reply();
        PyEval_RestoreThread(nogil);
        if (*rc == TS_ETIMEDOUT && b->u.closing && slice > 0) {
            *rc = TS_ECANCELED;
            return 0;
        }
        if (*rc != TS_ETIMEDOUT || slice == 0 || no_reply)
            return 0;
        if (timeout_ms != TS_TIMEOUT_INFINITE && now_ms() >= deadline)
            return 0;
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

/* Raise the exception for a wait's answer rc (TS_ECANCELED: b was closed meanwhile). NULL. */
static PyObject *wait_raise(const rl_base *b, int rc)
{
    if (rc == TS_ECANCELED && b->u.closing) {
        char msg[64];
        snprintf(msg, sizeof(msg), "the %s was closed", b->what);
        return tsp_raise_msg(TS_ECANCELED, msg);
    }
    return tsp_raise(rc);
}

/* ---------------------------------------------------------------------------------------------
 * RLTrainer
 */

typedef struct trainer_object {
    rl_base base;
} trainer_object;

static void trainer_free_handle(void *h)
{
    ts_rl_trainer_free(h);
}

/* base_open's constructor of a trainer. */
static int trainer_open(ts_client_t *c, void *arg)
{
    rl_open_arg *a = arg;
    ts_rl_trainer_t *t = NULL;
    int rc = ts_rl_trainer_new(&t, c, a->options);
    a->handle = t;
    return rc;
}

static int trainer_init(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    trainer_object *self = (trainer_object *)self_obj;
    static char *kwlist[] = {
        "client",  "prefix",      "params_bin", "data_bin", "staleness_tolerance",
        "timeout", "tensor_type", NULL};
    PyObject *client;
    rl_kw kw = {NULL, NULL, NULL, NULL};
    long long tolerance = 0;
    PyObject *tolerance_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$OOOOOO", kwlist, &client, &kw.prefix,
                                     &kw.params_bin, &kw.data_bin, &tolerance_obj, &kw.timeout,
                                     &tt_obj) ||
        tsp_int_arg(tolerance_obj, "staleness_tolerance", INT_MIN, INT_MAX, &tolerance) < 0)
        return -1;
    self->base.what = "RLTrainer";
    if (self->base.u.handle != NULL || self->base.u.closing) {
        PyErr_SetString(PyExc_RuntimeError, "RLTrainer.__init__ called twice");
        return -1;
    }
    ts_rl_options_t o;
    if (fill_options(&o, &kw) < 0)
        return -1;
    if (tolerance < TS_RL_NO_FILTER) {
        PyErr_SetString(PyExc_ValueError,
                        "staleness_tolerance must be >= 0, or NO_FILTER (-1) to keep everything");
        return -1;
    }
    o.staleness_tolerance = (int)tolerance;
    return base_open(&self->base, client, tt_obj, &o, trainer_open, trainer_free_handle);
}

static PyObject *trainer_publish(PyObject *self_obj, PyObject *params)
{
    rl_base *b = (rl_base *)self_obj;
    ts_rl_trainer_t *t = base_enter(b);
    if (t == NULL)
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, params) < 0) {
        tsp_client_user_leave(&b->u);
        return NULL;
    }
    int64_t version = -1;
    int rc;
    PyThreadState *nogil = PyEval_SaveThread();
    rc = ts_rl_trainer_publish(t, s.value, &version);
    PyEval_RestoreThread(nogil);
    PyObject *res = rc == 0 ? PyLong_FromLongLong(version) : tsp_raise(rc);
    tsp_send_clear(&s);
    tsp_client_user_leave(&b->u);
    return res;
}

/*
 * What keeps a collected batch's memory alive while views of it exist. It is made before the
 * collect takes anything out of the data bin (with no batch yet), so that no allocation the
 * conversion needs can fail between taking the items and handing them out. Plain malloc: the
 * last view may release it on any thread, without the GIL.
 */
typedef struct batch_slot {
    ts_rl_batch_t *batch; /* NULL until the collect returned one */
} batch_slot;

static void batch_slot_release(void *arg)
{
    batch_slot *slot = arg;
    ts_rl_batch_free(slot->batch);
    free(slot);
}

/* A new owner for the batch a collect will put into *slot_out; NULL with MemoryError. */
static tsp_owner_t *batch_owner_new(batch_slot **slot_out)
{
    batch_slot *slot = malloc(sizeof(*slot));
    tsp_owner_t *owner = slot != NULL ? tsp_owner_new(batch_slot_release, slot) : NULL;
    if (owner == NULL) {
        free(slot);
        PyErr_NoMemory();
        return NULL;
    }
    slot->batch = NULL;
    *slot_out = slot;
    return owner;
}

/* What batch_item converts: a collected batch, whose memory owner keeps. */
typedef struct batch_items {
    const ts_rl_batch_t *batch;
    tsp_tensor_type_t tt;
    tsp_owner_t *owner;
} batch_items;

/* The i-th item of a collected batch on its own, as a (data, version) pair (tsp_item_fn). */
static PyObject *batch_item(void *arg, size_t i)
{
    const batch_items *b = arg;
    PyObject *d = tsp_value_to_py_ex(ts_rl_batch_data(b->batch, i), b->tt, b->owner);
    PyObject *v = d != NULL ? PyLong_FromLongLong(ts_rl_batch_version(b->batch, i)) : NULL;
    PyObject *pair = v != NULL ? PyTuple_Pack(2, d, v) : NULL;
    Py_XDECREF(d);
    Py_XDECREF(v);
    return pair;
}

/*
 * After the conversion of a collected batch failed (the current exception): the items are out
 * of the data bin already, so nothing may be lost silently. Convert each item on its own and
 * hand them over on the exception as .items, oldest first: a (data, version) pair per item, as
 * in a Batch, or None for one that could not be made (None is never a record). When even the
 * list cannot be made the exception goes on alone.
 */
static void batch_hand_over(const ts_rl_batch_t *batch, tsp_tensor_type_t tt, tsp_owner_t *owner)
{
    batch_items b = {batch, tt, owner};
    tsp_hand_over_items(ts_rl_batch_count(batch), batch_item, &b,
                        "tensorshare: the collect took %zu items out of the data bin; they are "
                        "in this exception's .items, oldest first, as (data, version) pairs (None "
                        "for the %zu that could not be converted)");
}

/*
 * (data list, versions list, dropped) of a collected batch, whose memory owner keeps (the
 * caller's reference stays the caller's). On failure the exception carries the items taken.
 */
static PyObject *batch_to_py(const ts_rl_batch_t *batch, tsp_tensor_type_t tt, tsp_owner_t *owner)
{
    size_t n = ts_rl_batch_count(batch);
    PyObject *data = PyList_New((Py_ssize_t)n);
    PyObject *versions = PyList_New((Py_ssize_t)n);
    PyObject *res = NULL;
    if (data == NULL || versions == NULL)
        goto out;
    for (size_t i = 0; i < n; i++) {
        PyObject *d = tsp_value_to_py_ex(ts_rl_batch_data(batch, i), tt, owner);
        PyObject *v = d != NULL ? PyLong_FromLongLong(ts_rl_batch_version(batch, i)) : NULL;
        if (v == NULL) {
            Py_XDECREF(d);
            goto out;
        }
        PyList_SET_ITEM(data, (Py_ssize_t)i, d);
        PyList_SET_ITEM(versions, (Py_ssize_t)i, v);
    }
    res = Py_BuildValue("(OOn)", data, versions, (Py_ssize_t)ts_rl_batch_dropped(batch));
out:
    Py_XDECREF(data);
    Py_XDECREF(versions);
    if (res == NULL)
        batch_hand_over(batch, tt, owner);
    return res;
}

/* What a collect passes to collect_slice, and the batch it got. */
typedef struct collect_ctx {
    ts_rl_trainer_t *t;
    size_t max_items;
    ts_rl_batch_t *batch;
} collect_ctx;

/* One slice of a collect (wait_in_slices). */
static int collect_slice(void *arg, int slice_ms)
{
    collect_ctx *ctx = arg;
    return ts_rl_trainer_collect(ctx->t, ctx->max_items, slice_ms, &ctx->batch);
}

static PyObject *trainer_collect(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_items", "timeout", NULL};
    unsigned long long max_items = 0; /* 0: every item */
    PyObject *max_obj = NULL, *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO", kwlist, &max_obj, &timeout_obj) ||
        tsp_uint_arg(max_obj, "max_items", 0, PY_SSIZE_T_MAX, &max_items) < 0)
        return NULL;
    int timeout_ms;
    if (timeout_from_py(timeout_obj, TS_TIMEOUT_INFINITE, &timeout_ms) < 0)
        return NULL;
    rl_base *b = (rl_base *)self_obj;
    ts_rl_trainer_t *t = base_enter(b);
    if (t == NULL)
        return NULL;
    /*
     * What the conversion needs that can fail on its own (the tensor type's module, the memory
     * owner) is made before anything is taken out of the data bin: a failure then takes nothing.
     */
    batch_slot *slot = NULL;
    tsp_owner_t *owner = NULL;
    if (tsp_tensor_type_ready(b->u.tensor_type) < 0 || (owner = batch_owner_new(&slot)) == NULL) {
        tsp_client_user_leave(&b->u);
        return NULL;
    }
    collect_ctx ctx = {t, (size_t)max_items, NULL};
    int rc;
    if (wait_in_slices(b, timeout_ms, collect_slice, &ctx, &rc) < 0) {
        tsp_owner_unref(owner);
        tsp_client_user_leave(&b->u);
        return NULL;
    }
    ts_rl_batch_t *batch = ctx.batch;
    PyObject *res;
    if (rc == 0) {
        slot->batch = batch;
        res = batch_to_py(batch, b->u.tensor_type, owner);
    } else {
        res = wait_raise(b, rc);
    }
    /* The views hold their own references: the batch goes when the last of them does. */
    tsp_owner_unref(owner);
    tsp_client_user_leave(&b->u);
    return res;
}

static PyObject *trainer_get_version(PyObject *self_obj, void *closure)
{
    (void)closure;
    rl_base *b = (rl_base *)self_obj;
    ts_rl_trainer_t *t = base_enter(b);
    if (t == NULL)
        return NULL;
    int64_t v;
    PyThreadState *nogil = PyEval_SaveThread();
    v = ts_rl_trainer_version(t);
    PyEval_RestoreThread(nogil);
    tsp_client_user_leave(&b->u);
    return PyLong_FromLongLong(v);
}

static PyObject *trainer_stats(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    rl_base *b = (rl_base *)self_obj;
    ts_rl_trainer_t *t = base_enter(b);
    if (t == NULL)
        return NULL;
    ts_rl_trainer_stats_t st;
    PyThreadState *nogil = PyEval_SaveThread();
    ts_rl_trainer_stats(t, &st);
    PyEval_RestoreThread(nogil);
    tsp_client_user_leave(&b->u);
    return Py_BuildValue("{sLsLsLsKsKsKsKsK}", "version", (long long)st.version, "resumed_from",
                         (long long)st.resumed_from, "newest_seen", (long long)st.newest_seen,
                         "published", (unsigned long long)st.published, "publish_failed",
                         (unsigned long long)st.publish_failed, "received",
                         (unsigned long long)st.received, "dropped_stale",
                         (unsigned long long)st.dropped_stale, "dropped_malformed",
                         (unsigned long long)st.dropped_malformed);
}

static PyObject *base_enter_method(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    rl_base *b = (rl_base *)self_obj;
    if (b->u.handle == NULL || b->u.closing)
        return tsp_raise_msg(TS_ECANCELED, "closed");
    Py_INCREF(self_obj);
    return self_obj;
}

static void base_dealloc(PyObject *self_obj)
{
    rl_base *b = (rl_base *)self_obj;
    PyObject_GC_UnTrack(self_obj);
    b->u.closing = 1;
    tsp_client_user_free(&b->u);
    Py_TYPE(self_obj)->tp_free(self_obj);
}

static PyMethodDef trainer_methods[] = {
    {"publish", trainer_publish, METH_O,
     "publish(params) -> int\n\nPublish params (a record, typically a state dict) as the next "
     "version and return it once tensord holds it. The tensors are sent from their memory."},
    {"collect", (PyCFunction)(void (*)(void))trainer_collect, METH_VARARGS | METH_KEYWORDS,
     "collect(max_items=0, timeout=None) -> (data, versions, dropped)\n\nTake up to max_items "
     "experience items (0: all), oldest first, after the staleness filter; wait up to timeout "
     "seconds (None: no limit, 0: do not wait) for one. TimeoutError when none was kept. When "
     "the items taken cannot all be converted, the exception carries them in .items: "
     "(data, version) pairs, None for those that could not be made."},
    {"stats", trainer_stats, METH_NOARGS, "stats() -> dict of the trainer's counters"},
    {"close", tsp_client_user_close_method, METH_NOARGS, "close(): free the trainer (idempotent)"},
    {"__enter__", base_enter_method, METH_NOARGS, NULL},
    {"__exit__", tsp_client_user_exit_method, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef trainer_getset[] = {
    {"version", trainer_get_version, NULL,
     "the newest version published or resumed from, -1 when none", NULL},
    {"closed", tsp_client_user_get_closed, NULL, "True after close()", NULL},
    {"client", tsp_client_user_get_client, NULL, "the tensorshare.Client (None after close)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject trainer_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare._RLTrainer",
    .tp_basicsize = sizeof(trainer_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The RL trainer of rl.h (see tensorshare.RLTrainer).",
    .tp_new = PyType_GenericNew,
    .tp_init = trainer_init,
    .tp_dealloc = base_dealloc,
    .tp_traverse = tsp_client_user_traverse,
    .tp_methods = trainer_methods,
    .tp_getset = trainer_getset,
};

/* ---------------------------------------------------------------------------------------------
 * RLWorker
 */

typedef struct worker_object {
    rl_base base;
    PyObject *on_event;         /* callable or NULL; read by the event callback */
    unsigned long event_thread; /* thread running on_event now, 0 when none */
    PyObject *borrowed;         /* list of capsules of copy=False adds still in flight */
} worker_object;

static void worker_free_handle(void *h)
{
    ts_rl_worker_free(h);
}

/*
 * Before the C worker is freed (tsp_client_user's before_free): ts_rl_worker_free waits for the
 * adds in flight only up to the worker's timeout, and those still in flight after it read
 * their copy=False memory until they are answered, at the latest when the Client's
 * ts_client_t is freed. So when adds are in flight now, the Client keeps the borrowed objects
 * until then; otherwise nothing reads them any more once the worker is freed.
 */
static void worker_before_free(tsp_client_user *u, void *h)
{
    worker_object *self = (worker_object *)u;
    if (self->borrowed == NULL || PyList_GET_SIZE(self->borrowed) == 0)
        return;
    ts_rl_worker_stats_t st;
    ts_rl_worker_stats(h, &st); /* short: a lock no callback holds for long */
    if (st.in_flight == 0)
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb); /* the exception of the call that frees, if any, stands */
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL || tsp_client_keep(u->client, self->borrowed) < 0) {
        /* Cannot hand them over: leak rather than free memory the library may still read. */
        PyErr_Clear();
        Py_XDECREF(fresh);
        self->borrowed = NULL;
    } else {
        Py_SETREF(self->borrowed, fresh);
    }
    PyErr_Restore(type, value, tb);
}

/* base_open's constructor of a worker. */
static int worker_open(ts_client_t *c, void *arg)
{
    rl_open_arg *a = arg;
    ts_rl_worker_t *w = NULL;
    int rc = ts_rl_worker_new(&w, c, a->options);
    a->handle = w;
    return rc;
}

static const char *event_name(ts_rl_event_t ev)
{
    switch (ev) {
    case TS_RL_EV_PARAMS:
        return "params";
    case TS_RL_EV_DISCONNECTED:
        return "disconnected";
    case TS_RL_EV_RESUBSCRIBED:
        return "resubscribed";
    case TS_RL_EV_ADD_FAILED:
        return "add_failed";
    case TS_RL_EV_PARAMS_FAILED:
        return "params_failed";
    case TS_RL_EV_PARAMS_BAD:
        return "params_bad";
    }
    return "unknown";
}

/*
 * rl.h's event callback: on_event(event, version, error) with the GIL taken. error is None or
 * the tensorshare.Error for status.
 */
static void on_worker_event(ts_rl_worker_t *w, int status, ts_rl_event_t event, int64_t version,
                            void *arg)
{
    (void)w;
    worker_object *self = arg;
    /* The reason is thread-local: read it before any Python code runs on this thread. */
    char msg[TS_MAX_ERROR_LEN + 1];
    snprintf(msg, sizeof(msg), "%s", status != 0 ? ts_last_error() : "");
    PyGILState_STATE g;
    if (!tsp_gil_acquire(&g))
        return;
    PyObject *cb = self->on_event;
    if (cb != NULL) {
        Py_INCREF(cb);
        PyObject *err = status != 0 ? tsp_exception_new(status, msg[0] ? msg : NULL) : Py_None;
        if (err == Py_None)
            Py_INCREF(err);
        PyObject *res = NULL;
        if (err != NULL) {
            unsigned long prev = self->event_thread;
            self->event_thread = PyThread_get_thread_ident();
            res = PyObject_CallFunction(cb, "sLO", event_name(event), (long long)version, err);
            self->event_thread = prev;
            Py_DECREF(err);
        }
        if (res == NULL)
            tsp_report_callback_error("RLWorker on_event", cb);
        Py_XDECREF(res);
        Py_DECREF(cb);
    }
    tsp_gil_release(g);
}

/* base_enter, refusing calls from inside on_event (the worker's lock may be held there). */
static ts_rl_worker_t *worker_enter(worker_object *self)
{
    if (self->event_thread != 0 && self->event_thread == PyThread_get_thread_ident()) {
        tsp_raise_msg(TS_EDEADLK, "RLWorker methods cannot be called from its on_event callback");
        return NULL;
    }
    return base_enter(&self->base);
}

static int worker_init(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    worker_object *self = (worker_object *)self_obj;
    static char *kwlist[] = {
        "client",  "prefix",   "params_bin",  "data_bin", "max_in_flight", "max_in_flight_bytes",
        "timeout", "on_event", "tensor_type", NULL};
    PyObject *client;
    rl_kw kw = {NULL, NULL, NULL, NULL};
    unsigned long long max_in_flight = 16, max_bytes = 64 << 20;
    PyObject *max_obj = NULL, *max_bytes_obj = NULL, *on_event = Py_None, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$OOOOOOOO", kwlist, &client, &kw.prefix,
                                     &kw.params_bin, &kw.data_bin, &max_obj, &max_bytes_obj,
                                     &kw.timeout, &on_event, &tt_obj) ||
        tsp_uint_arg(max_obj, "max_in_flight", 1, UINT_MAX, &max_in_flight) < 0 ||
        tsp_uint_arg(max_bytes_obj, "max_in_flight_bytes", 1, PY_SSIZE_T_MAX, &max_bytes) < 0)
        return -1;
    self->base.what = "RLWorker";
    if (self->base.u.handle != NULL || self->base.u.closing) {
        PyErr_SetString(PyExc_RuntimeError, "RLWorker.__init__ called twice");
        return -1;
    }
    if (on_event != Py_None && !PyCallable_Check(on_event)) {
        PyErr_SetString(PyExc_TypeError, "on_event must be callable or None");
        return -1;
    }
    ts_rl_options_t o;
    if (fill_options(&o, &kw) < 0)
        return -1;
    o.max_in_flight = (unsigned)max_in_flight;
    o.max_in_flight_bytes = (size_t)max_bytes;
    if (on_event != Py_None) {
        Py_INCREF(on_event);
        self->on_event = on_event;
        o.on_event = on_worker_event;
        o.event_arg = self;
    }
    self->borrowed = PyList_New(0);
    if (self->borrowed == NULL)
        return -1;
    if (base_open(&self->base, client, tt_obj, &o, worker_open, worker_free_handle) < 0)
        return -1;
    self->base.u.before_free = worker_before_free;
    return 0;
}

static void params_release(void *arg)
{
    ts_rl_params_release(arg);
}

/* (value, version) of a parameters snapshot, whose reference this takes over. */
static PyObject *params_to_py(ts_rl_params_t *p, tsp_tensor_type_t tt)
{
    int64_t version = ts_rl_params_version(p);
    tsp_owner_t *owner = tsp_owner_new(params_release, p);
    if (owner == NULL) {
        ts_rl_params_release(p);
        return PyErr_NoMemory();
    }
    PyObject *value = tsp_value_to_py_ex(ts_rl_params_value(p), tt, owner);
    tsp_owner_unref(owner);
    if (value == NULL)
        return NULL;
    PyObject *res = Py_BuildValue("(OL)", value, (long long)version);
    Py_DECREF(value);
    return res;
}

static PyObject *worker_params(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    worker_object *self = (worker_object *)self_obj;
    ts_rl_worker_t *w = worker_enter(self);
    if (w == NULL)
        return NULL;
    ts_rl_params_t *p = NULL;
    int rc;
    PyThreadState *nogil = PyEval_SaveThread();
    rc = ts_rl_worker_params(w, &p);
    PyEval_RestoreThread(nogil);
    PyObject *res;
    if (rc == TS_ENOENT) {
        Py_INCREF(Py_None);
        res = Py_None;
    } else {
        res = rc == 0 ? params_to_py(p, self->base.u.tensor_type) : tsp_raise(rc);
    }
    tsp_client_user_leave(&self->base.u);
    return res;
}

/* What an await passes to await_slice, and the parameters it got. */
typedef struct await_ctx {
    ts_rl_worker_t *w;
    ts_rl_params_t *params;
} await_ctx;

/* One slice of an await_params (wait_in_slices). */
static int await_slice(void *arg, int slice_ms)
{
    await_ctx *ctx = arg;
    return ts_rl_worker_await(ctx->w, slice_ms, &ctx->params);
}

static PyObject *worker_await(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj))
        return NULL;
    int timeout_ms;
    if (timeout_from_py(timeout_obj, TS_TIMEOUT_INFINITE, &timeout_ms) < 0)
        return NULL;
    worker_object *self = (worker_object *)self_obj;
    ts_rl_worker_t *w = worker_enter(self);
    if (w == NULL)
        return NULL;
    await_ctx ctx = {w, NULL};
    int rc;
    if (wait_in_slices(&self->base, timeout_ms, await_slice, &ctx, &rc) < 0) {
        tsp_client_user_leave(&self->base.u);
        return NULL;
    }
    PyObject *res =
        rc == 0 ? params_to_py(ctx.params, self->base.u.tensor_type) : wait_raise(&self->base, rc);
    tsp_client_user_leave(&self->base.u);
    return res;
}

/* A copy=False add's record and pins, kept until a flush finds nothing in flight. */
static void send_capsule_free(PyObject *capsule)
{
    tsp_send_t *s = PyCapsule_GetPointer(capsule, "tensorshare.rl.send");
    if (s != NULL) {
        tsp_send_clear(s);
        PyMem_Free(s);
    }
}

static PyObject *worker_add(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"data", "copy", "block", NULL};
    PyObject *data;
    int copy = 1, block = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$pp", kwlist, &data, &copy, &block))
        return NULL;
    worker_object *self = (worker_object *)self_obj;
    ts_rl_worker_t *w = worker_enter(self);
    if (w == NULL)
        return NULL;
    tsp_send_t *s = PyMem_Malloc(sizeof(*s));
    if (s == NULL) {
        tsp_client_user_leave(&self->base.u);
        return PyErr_NoMemory();
    }
    if (tsp_send_init(s, data) < 0) {
        PyMem_Free(s);
        tsp_client_user_leave(&self->base.u);
        return NULL;
    }
    unsigned flags = (copy ? TS_COPY : TS_BORROW) | (block ? 0u : TS_RL_NONBLOCK);
    int rc;
    PyThreadState *nogil = PyEval_SaveThread();
    rc = ts_rl_worker_add(w, s->value, flags);
    PyEval_RestoreThread(nogil);
    PyObject *res = NULL;
    if (rc != 0) {
        tsp_raise(rc);
        tsp_send_clear(s);
        PyMem_Free(s);
    } else if (copy) {
        tsp_send_clear(s);
        PyMem_Free(s);
        res = Py_None;
    } else {
        /* The library reads the memory until the add is answered: keep it until a flush. */
        PyObject *cap = PyCapsule_New(s, "tensorshare.rl.send", send_capsule_free);
        if (cap == NULL) {
            /* Cannot keep it safely: leak rather than free memory the library still reads. */
            tsp_client_user_leave(&self->base.u);
            return NULL;
        }
        res = PyList_Append(self->borrowed, cap) == 0 ? Py_None : NULL;
        Py_DECREF(cap);
    }
    Py_XINCREF(res);
    tsp_client_user_leave(&self->base.u);
    return res;
}

static PyObject *worker_flush(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &timeout_obj))
        return NULL;
    int timeout_ms;
    if (timeout_from_py(timeout_obj, TS_TIMEOUT_DEFAULT, &timeout_ms) < 0)
        return NULL;
    worker_object *self = (worker_object *)self_obj;
    ts_rl_worker_t *w = worker_enter(self);
    if (w == NULL)
        return NULL;
    int rc;
    ts_rl_worker_stats_t st;
    PyThreadState *nogil = PyEval_SaveThread();
    rc = ts_rl_worker_flush(w, timeout_ms);
    ts_rl_worker_stats(w, &st);
    PyEval_RestoreThread(nogil);
    if (st.in_flight == 0 && PyList_GET_SIZE(self->borrowed) > 0) {
        /* Every add was answered: the library reads none of the borrowed memory any more. */
        if (PyList_SetSlice(self->borrowed, 0, PyList_GET_SIZE(self->borrowed), NULL) < 0) {
            tsp_client_user_leave(&self->base.u);
            return NULL;
        }
    }
    tsp_client_user_leave(&self->base.u);
    if (rc != 0)
        return tsp_raise(rc);
    Py_RETURN_NONE;
}

static PyObject *worker_stats(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    worker_object *self = (worker_object *)self_obj;
    ts_rl_worker_t *w = worker_enter(self);
    if (w == NULL)
        return NULL;
    ts_rl_worker_stats_t st;
    PyThreadState *nogil = PyEval_SaveThread();
    ts_rl_worker_stats(w, &st);
    PyEval_RestoreThread(nogil);
    tsp_client_user_leave(&self->base.u);
    return Py_BuildValue(
        "{sLsLsKsKsKsKsKsIsKsKsO}", "version", (long long)st.version, "retrieved_version",
        (long long)st.retrieved_version, "updates", (unsigned long long)st.updates, "ignored_older",
        (unsigned long long)st.ignored_older, "params_failed", (unsigned long long)st.params_failed,
        "added", (unsigned long long)st.added, "add_failed", (unsigned long long)st.add_failed,
        "in_flight", st.in_flight, "disconnects", (unsigned long long)st.disconnects,
        "resubscribes", (unsigned long long)st.resubscribes, "connected",
        st.connected ? Py_True : Py_False);
}

static PyObject *worker_close(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    worker_object *self = (worker_object *)self_obj;
    if (self->event_thread != 0 && self->event_thread == PyThread_get_thread_ident())
        return tsp_raise_msg(TS_EDEADLK, "RLWorker.close() cannot be called from on_event");
    tsp_client_user_close(&self->base.u);
    if (self->base.u.handle == NULL && self->borrowed != NULL)
        (void)PyList_SetSlice(self->borrowed, 0, PyList_GET_SIZE(self->borrowed), NULL);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *worker_exit_method(PyObject *self_obj, PyObject *args)
{
    (void)args;
    PyObject *r = worker_close(self_obj, NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static void worker_dealloc(PyObject *self_obj)
{
    worker_object *self = (worker_object *)self_obj;
    PyObject_GC_UnTrack(self_obj);
    self->base.u.closing = 1;
    tsp_client_user_free(&self->base.u);
    /* In a child after fork the library may still hold the memory: leak it then. */
    if (self->base.u.fork_generation == tsp_fork_generation)
        Py_CLEAR(self->borrowed);
    Py_CLEAR(self->on_event);
    Py_TYPE(self_obj)->tp_free(self_obj);
}

static int worker_traverse(PyObject *self_obj, visitproc visit, void *arg)
{
    worker_object *self = (worker_object *)self_obj;
    Py_VISIT(self->on_event);
    Py_VISIT(self->borrowed);
    return tsp_client_user_traverse(self_obj, visit, arg);
}

static PyMethodDef worker_methods[] = {
    {"params", worker_params, METH_NOARGS,
     "params() -> (value, version) or None\n\nThe newest parameters, answered locally; marks "
     "their version as retrieved (later adds are tagged with it). None before any publish."},
    {"await_params", (PyCFunction)(void (*)(void))worker_await, METH_VARARGS | METH_KEYWORDS,
     "await_params(timeout=None) -> (value, version)\n\nWait up to timeout seconds (None: no "
     "limit) for parameters newer than the last retrieved; TimeoutError when none came."},
    {"add", (PyCFunction)(void (*)(void))worker_add, METH_VARARGS | METH_KEYWORDS,
     "add(data, *, copy=True, block=True)\n\nSend {data, version} without waiting for tensord."},
    {"flush", (PyCFunction)(void (*)(void))worker_flush, METH_VARARGS | METH_KEYWORDS,
     "flush(timeout=None)\n\nWait until every add was answered; raise the first failure."},
    {"stats", worker_stats, METH_NOARGS, "stats() -> dict of the worker's counters"},
    {"close", worker_close, METH_NOARGS,
     "close(): wait for the adds in flight up to the worker's timeout, free the worker"},
    {"__enter__", base_enter_method, METH_NOARGS, NULL},
    {"__exit__", worker_exit_method, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef worker_getset[] = {
    {"closed", tsp_client_user_get_closed, NULL, "True after close()", NULL},
    {"client", tsp_client_user_get_client, NULL, "the tensorshare.Client (None after close)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject worker_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare._RLWorker",
    .tp_basicsize = sizeof(worker_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The RL worker of rl.h (see tensorshare.RLWorker).",
    .tp_new = PyType_GenericNew,
    .tp_init = worker_init,
    .tp_dealloc = worker_dealloc,
    .tp_traverse = worker_traverse,
    .tp_methods = worker_methods,
    .tp_getset = worker_getset,
};

/* ---------------------------------------------------------------------------------------------
 * Registration
 */

int tsp_rl_init(PyObject *module)
{
    if (tsp_add_type(module, &trainer_type, "_RLTrainer") < 0 ||
        tsp_add_type(module, &worker_type, "_RLWorker") < 0)
        return -1;
    return PyModule_AddIntConstant(module, "RL_NO_FILTER", TS_RL_NO_FILTER);
}
