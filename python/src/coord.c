/*
 * The Client's coordination methods (include/tensorshare/coord.h; docs/PYTHON.md
 * "Coordination"): add, put_if, take, mget and barrier. Each is one blocking call of the C
 * client made without the GIL; errors become the module's exceptions (tsp_raise), a lost
 * compare-and-set becomes VersionMismatchError carrying the bin's current version.
 */
#include "tsp.h"

#include <string.h>

#include "tensorshare/coord.h"

/*
 * A timeout in ms: None (or absent) gives the client's request timeout, else 0..INT_MAX
 * (TS_TIMEOUT_INFINITE is not accepted by take and barrier). -1 with an exception.
 */
static int coord_timeout(PyObject *obj, int *out)
{
    return tsp_ms_arg(obj, "timeout_ms", TS_TIMEOUT_DEFAULT, out);
}

/* A max_items argument (absent: 0, all), as get's: 0..PY_SSIZE_T_MAX. -1 with an exception. */
static int max_items_arg(PyObject *obj, size_t *out)
{
    unsigned long long v = 0;
    if (tsp_uint_arg(obj, "max_items", 0, PY_SSIZE_T_MAX, &v) < 0)
        return -1;
    *out = (size_t)v;
    return 0;
}

PyObject *tsp_client_add(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "delta", NULL};
    const char *name;
    PyObject *delta_obj = NULL;
    long long delta = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|O:add", names, &name, &delta_obj) ||
        tsp_int_arg(delta_obj, "delta", INT64_MIN, INT64_MAX, &delta) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    int64_t value = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_add(c, name, (int64_t)delta, &value, NULL);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? PyLong_FromLongLong(value) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_put_if(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "expected_version", "value", NULL};
    const char *name;
    unsigned long long expected = 0;
    PyObject *expected_obj, *value;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO:put_if", names, &name, &expected_obj, &value) ||
        tsp_uint_arg(expected_obj, "expected_version", 0, UINT64_MAX, &expected) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, value) < 0) {
        tsp_client_leave(client);
        return NULL;
    }
    uint64_t version = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_put_if(c, name, (uint64_t)expected, s.value, &version);
    Py_END_ALLOW_THREADS tsp_send_clear(&s);
    PyObject *r = NULL;
    if (rc == 0) {
        r = PyLong_FromUnsignedLongLong(version);
    } else if (rc == TS_ECONFLICT) {
        /* The exception carries the version to retry with. */
        tsp_raise_versioned(rc, version);
    } else {
        r = tsp_raise(rc);
    }
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_take(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "max_items", "timeout_ms", "tensor_type", NULL};
    const char *name;
    size_t max_items = 0;
    PyObject *max_obj = NULL, *timeout_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|OO$O:take", names, &name, &max_obj, &timeout_obj,
                                     &tt_obj))
        return NULL;
    int timeout_ms;
    tsp_tensor_type_t tt;
    if (max_items_arg(max_obj, &max_items) < 0 || coord_timeout(timeout_obj, &timeout_ms) < 0 ||
        tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_items_t *items = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_take(c, name, max_items, timeout_ms, &items);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? tsp_taken_items_to_py(items, tt) : tsp_raise(rc);
    ts_items_free(items);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_mget(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"names", "max_items", "tensor_type", NULL};
    PyObject *seq_obj, *max_obj = NULL, *tt_obj = NULL;
    size_t max_items = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O$O:mget", names, &seq_obj, &max_obj, &tt_obj))
        return NULL;
    tsp_tensor_type_t tt;
    if (max_items_arg(max_obj, &max_items) < 0 ||
        tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(seq_obj, "names must be a sequence of str");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > TS_MGET_MAX) {
        Py_DECREF(seq);
        return tsp_raise_msg(TS_EINVAL, "mget takes 1 to 256 names");
    }
    const char *cn[TS_MGET_MAX];
    for (Py_ssize_t i = 0; i < n; i++) {
        cn[i] = tsp_c_string(PySequence_Fast_GET_ITEM(seq, i));
        if (cn[i] == NULL) {
            Py_DECREF(seq);
            return PyErr_Occurred()
                       ? NULL
                       : tsp_raise_msg(TS_EINVAL, "a bin name cannot contain NUL characters");
        }
    }
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    ts_items_t *out[TS_MGET_MAX];
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_mget(c, cn, (size_t)n, max_items, out);
    Py_END_ALLOW_THREADS PyObject *r = NULL;
    if (rc == 0) {
        /* {name: [records]} for the bins that exist, None for the others, in request order. */
        r = PyDict_New();
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = NULL;
            if (r != NULL) {
                if (out[i] != NULL) {
                    v = tsp_items_to_py(out[i], tt);
                } else {
                    Py_INCREF(Py_None);
                    v = Py_None;
                }
                if (v == NULL || PyDict_SetItem(r, PySequence_Fast_GET_ITEM(seq, i), v) < 0)
                    Py_CLEAR(r);
            }
            Py_XDECREF(v);
            ts_items_free(out[i]);
        }
    } else {
        r = tsp_raise(rc);
    }
    tsp_client_leave(client);
    Py_DECREF(seq);
    return r;
}

PyObject *tsp_client_barrier(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "parties", "timeout_ms", NULL};
    const char *name;
    unsigned long long parties = 0;
    PyObject *parties_obj, *timeout_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|O:barrier", names, &name, &parties_obj,
                                     &timeout_obj))
        return NULL;
    int timeout_ms;
    if (tsp_uint_arg(parties_obj, "parties", 0, UINT32_MAX, &parties) < 0 ||
        coord_timeout(timeout_obj, &timeout_ms) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    uint64_t gen = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_barrier(c, name, (uint32_t)parties, timeout_ms, &gen);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? PyLong_FromUnsignedLongLong(gen) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}
