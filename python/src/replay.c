/*
 * The Client's replay table methods (include/tensorshare/replay.h; docs/PYTHON.md "Replay
 * tables"): table_create, table_insert, table_sample, table_update, table_remove, table_info.
 * Each is one blocking call of the library with the GIL released; samples come back as a list
 * of dicts whose tensors are views of the reply's memory (kept until the last view goes).
 */
#include "tsp.h"

#include <math.h>
#include <stdio.h>

#include "tensorshare/replay.h"

/* A wait in ms: None (or absent) gives the request timeout, else 0..INT_MAX. */
static int wait_arg(PyObject *obj, int *out)
{
    return tsp_ms_arg(obj, "timeout_ms", TS_TIMEOUT_DEFAULT, out);
}

/* Index of s in names[0..n), or -1 with ValueError. */
static int choice_arg(const char *s, const char *const *names, int n, const char *what)
{
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    PyErr_Format(PyExc_ValueError, "unknown %s '%s'", what, s);
    return -1;
}

static PyObject *state_to_py(const ts_table_state_t *st)
{
    return Py_BuildValue("{sKsKsKsKsIsI}", "key", (unsigned long long)st->key, "size",
                         (unsigned long long)st->size, "inserts", (unsigned long long)st->inserts,
                         "samples", (unsigned long long)st->samples, "done", (unsigned int)st->done,
                         "skipped", (unsigned int)st->skipped);
}

PyObject *tsp_client_table_create(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name",
                            "capacity",
                            "sampler",
                            "remover",
                            "priority_exponent",
                            "max_times_sampled",
                            "min_size_to_sample",
                            "samples_per_insert",
                            "error_buffer",
                            NULL};
    static const char *const samplers[] = {"uniform", "prioritized", "fifo", "lifo"};
    static const char *const removers[] = {"fifo", "lifo", "lowest_priority"};
    const char *name, *sampler = "uniform", *remover = "fifo";
    PyObject *capacity_obj = NULL, *max_times_obj = NULL, *min_size_obj = NULL;
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    unsigned long long capacity = cfg.capacity, min_size = cfg.min_size_to_sample;
    unsigned long long max_times = cfg.max_times_sampled;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|OssdOOdd:table_create", names, &name,
                                     &capacity_obj, &sampler, &remover, &cfg.priority_exponent,
                                     &max_times_obj, &min_size_obj, &cfg.samples_per_insert,
                                     &cfg.error_buffer) ||
        tsp_uint_arg_einval(capacity_obj, "capacity", 1, TS_TABLE_CAPACITY_MAX, &capacity) < 0 ||
        tsp_uint_arg_einval(max_times_obj, "max_times_sampled", 0, UINT32_MAX, &max_times) < 0 ||
        tsp_uint_arg_einval(min_size_obj, "min_size_to_sample", 1, UINT64_MAX, &min_size) < 0)
        return NULL;
    int si = choice_arg(sampler, samplers, 4, "sampler");
    int ri = si < 0 ? -1 : choice_arg(remover, removers, 3, "remover");
    if (ri < 0)
        return NULL;
    cfg.capacity = capacity;
    cfg.min_size_to_sample = min_size;
    cfg.max_times_sampled = (uint32_t)max_times;
    cfg.sampler = (ts_table_sampler_t)si;
    cfg.remover = (ts_table_remover_t)ri;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_table_state_t st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_table_create(c, name, &cfg, &st);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? state_to_py(&st) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_table_insert(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "value", "priority", "timeout_ms", NULL};
    const char *name;
    PyObject *value, *timeout_obj = NULL;
    double priority = 1.0;
    int timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|dO:table_insert", names, &name, &value,
                                     &priority, &timeout_obj) ||
        wait_arg(timeout_obj, &timeout_ms) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, value) < 0) {
        tsp_client_leave(client);
        return NULL;
    }
    uint64_t key = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_table_insert(c, name, s.value, priority, timeout_ms, &key);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? PyLong_FromUnsignedLongLong(key) : tsp_raise(rc);
    tsp_send_clear(&s);
    tsp_client_leave(client);
    return r;
}

static void sample_release(void *arg)
{
    ts_table_sample_free(arg);
}

/* A sample as a list of dicts. Takes s (its memory lives while a tensor view does). */
static PyObject *sample_to_py(ts_table_sample_t *s, tsp_tensor_type_t tt)
{
    tsp_owner_t *owner = tsp_owner_new(sample_release, s);
    if (owner == NULL) {
        ts_table_sample_free(s);
        return PyErr_NoMemory();
    }
    size_t n = ts_table_sample_count(s);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list != NULL && i < n; i++) {
        PyObject *value = tsp_value_to_py_ex(ts_table_sample_value(s, i), tt, owner);
        if (value == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyObject *d =
            Py_BuildValue("{sKsdsIsKsN}", "key", (unsigned long long)ts_table_sample_key(s, i),
                          "probability", ts_table_sample_probability(s, i), "times_sampled",
                          (unsigned int)ts_table_sample_times_sampled(s, i), "age_ms",
                          (unsigned long long)ts_table_sample_age_ms(s, i), "value", value);
        if (d == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, d);
    }
    tsp_owner_unref(owner);
    return list;
}

PyObject *tsp_client_table_sample(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "n", "timeout_ms", "tensor_type", NULL};
    const char *name;
    unsigned long long n = 1;
    PyObject *n_obj = NULL, *timeout_obj = NULL, *tt_obj = NULL;
    int timeout_ms;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|OO$O:table_sample", names, &name, &n_obj,
                                     &timeout_obj, &tt_obj) ||
        tsp_uint_arg_einval(n_obj, "n", 1, TS_TABLE_SAMPLE_MAX, &n) < 0 ||
        wait_arg(timeout_obj, &timeout_ms) < 0)
        return NULL;
    tsp_tensor_type_t tt;
    if (tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_table_sample_t *s = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_table_sample(c, name, (size_t)n, timeout_ms, &s);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? sample_to_py(s, tt) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

/* A sequence of keys (ints from 0 to 2**64-1) as a new array (PyMem_Free it). NULL with an
 * exception. */
static uint64_t *keys_arg(PyObject *obj, size_t *n)
{
    PyObject *seq = PySequence_Fast(obj, "keys must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    uint64_t *keys = PyMem_Malloc(len > 0 ? (size_t)len * sizeof(*keys) : 1);
    if (keys == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        char what[32];
        unsigned long long k = 0;
        snprintf(what, sizeof(what), "keys[%zd]", i);
        if (tsp_uint_arg_einval(PySequence_Fast_GET_ITEM(seq, i), what, 0, UINT64_MAX, &k) < 0) {
            PyMem_Free(keys);
            Py_DECREF(seq);
            return NULL;
        }
        keys[i] = k;
    }
    Py_DECREF(seq);
    *n = (size_t)len;
    return keys;
}

PyObject *tsp_client_table_update(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "keys", "priorities", NULL};
    const char *name;
    PyObject *keys_obj, *prio_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO:table_update", names, &name, &keys_obj,
                                     &prio_obj))
        return NULL;
    size_t n = 0;
    uint64_t *keys = keys_arg(keys_obj, &n);
    if (keys == NULL)
        return NULL;
    PyObject *seq = PySequence_Fast(prio_obj, "priorities must be a sequence of floats");
    double *prio = seq != NULL ? PyMem_Malloc(n > 0 ? n * sizeof(*prio) : 1) : NULL;
    if (seq != NULL && (size_t)PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and priorities differ in length");
        PyMem_Free(prio);
        prio = NULL;
    }
    for (size_t i = 0; prio != NULL && i < n; i++) {
        prio[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)i));
        if (PyErr_Occurred()) {
            PyMem_Free(prio);
            prio = NULL;
        }
    }
    Py_XDECREF(seq);
    ts_client_t *c = prio != NULL ? tsp_client_enter(client) : NULL;
    if (c == NULL) {
        if (prio != NULL && !PyErr_Occurred())
            PyErr_NoMemory();
        PyMem_Free(keys);
        PyMem_Free(prio);
        return NULL;
    }
    ts_table_state_t st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_table_update(c, name, n, keys, prio, &st);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? state_to_py(&st) : tsp_raise(rc);
    tsp_client_leave(client);
    PyMem_Free(keys);
    PyMem_Free(prio);
    return r;
}

PyObject *tsp_client_table_remove(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "keys", NULL};
    const char *name;
    PyObject *keys_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO:table_remove", names, &name, &keys_obj))
        return NULL;
    size_t n = 0;
    uint64_t *keys = keys_arg(keys_obj, &n);
    if (keys == NULL)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL) {
        PyMem_Free(keys);
        return NULL;
    }
    ts_table_state_t st;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_table_remove(c, name, n, keys, &st);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? state_to_py(&st) : tsp_raise(rc);
    tsp_client_leave(client);
    PyMem_Free(keys);
    return r;
}

PyObject *tsp_client_table_info(PyObject *client, PyObject *args, PyObject *kw)
{
    return tsp_client_info(client, args, kw, "s:table_info", ts_table_info);
}
