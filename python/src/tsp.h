/*
 * tsp.h: the internal header of the tensorshare Python extension (tensorshare._tensorshare).
 *
 * The extension is C over the public libtensorshare API only. This header is what every file of
 * the extension shares: the module state (exception classes, types), the conversions between
 * Python objects and ts_value_t records in both directions (with the zero-copy view machinery),
 * raising the exception for a TS_E* status, and how a binding reaches the ts_client_t of a
 * tensorshare.Client.
 *
 * Files: module.c (module init, exceptions, fork detection), convert.c (Python <-> records),
 * view.c (zero-copy views of received tensors), client.c (the Client type, and closing every
 * Client at exit: its atexit handler is registered before tsp_rl_init runs, so handlers the
 * bindings register run before it), rl.c and
 * predictor.c (the RL and predictor bindings, initialised by tsp_rl_init / tsp_predictor_init),
 * client_user.c (what those bindings share: opening an object on a Client and its life cycle),
 * stream.c (the Client's stream methods, the stream producer and consumer: tsp_stream_init).
 *
 * Rules that hold for every function below unless its comment says otherwise:
 * - The caller holds the GIL.
 * - A function returning int returns 0, or -1 with a Python exception set; one returning a
 *   pointer returns NULL with an exception set.
 * - The extension has one module state (a static struct): it supports one interpreter per
 *   process (no subinterpreters).
 *
 * The Python-level API of tensorshare.Client that the bindings and the pure-Python layers
 * (compat.py, rl.py, predictor.py) may rely on:
 *   Client(address="127.0.0.1:8000", *, token=None, token_file=None, timeout=None,
 *          connect_timeout=None, tensor_type=None)          timeouts in seconds (float)
 *   put(bin, value) -> int version          append(bin, value) -> int version
 *   get(bin, max_items=0, *, tensor_type=None) -> list of records (oldest first)
 *   peek(bin, max_items=0, *, tensor_type=None) -> list of records
 *   delete(bin) -> int n_removed            list() -> {name: BinInfo(n_items, bytes, version)}
 *   wait(bin, after_version=0, timeout=None) -> (version, n_items); None waits as long as the
 *       server allows; raises tensorshare.TimeoutError on timeout
 *   stats() -> dict                         ping() -> None          save() -> None
 *   listen(bin, callback) -> None: callback(Notification) on the client's I/O thread, where
 *       Notification is a struct sequence (bin, event, version, n_items, coalesced, error); event
 * is "put" | "append" | "get" | "delete" | "rows" | "disconnected" | "resubscribed" | "error" (the
 * subscription ended on an error, which is in .error; it is the last call) unlisten(bin) -> None
 *   create_tensor_bin(bin, dtype, shape) -> int version; write_rows(bin, start, rows) -> int
 *       version; read_rows(bin, start, end, *, item=0, key=None, tensor_type=None) -> tensor;
 *       gather_rows(bin, index, *, item=0, key=None, tensor_type=None) -> tensor (rows.c)
 *   stream_create, stream_append, stream_mark, stream_credit, stream_join, stream_read,
 *       stream_ack, stream_leave, stream_info, stream_range (stream.c; docs/PYTHON.md "Streams")
 *   put_async, append_async, get_async, peek_async, delete_async, list_async, wait_async,
 *       stats_async, ping_async: same arguments, return a concurrent.futures.Future (already
 *       running: it cannot be cancelled) completed on the I/O thread
 *   close(), closed (property), connected (property), __enter__/__exit__
 * Records: dict (str keys) / list / tuple (sent as a list) / int / float / str / bytes
 * (bytearray too), and tensors: torch.Tensor, numpy.ndarray (and numpy scalars, sent as 0-d
 * tensors, numpy.float64 included; numpy.str_ and numpy.bytes_ are a str and bytes), any other
 * buffer-protocol object (memoryview, array.array), or any object with
 * __dlpack__. bool is an int. Received tensors are torch tensors or numpy arrays
 * (tensor_type "torch" | "numpy"; the default is "torch" when torch can be imported).
 */
#ifndef TSP_H
#define TSP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include <tensorshare/tensorshare.h>

/* ---------------------------------------------------------------------------------------------
 * Module state
 */

/* How received tensors are handed to Python. */
typedef enum tsp_tensor_type_e {
    TSP_TENSOR_DEFAULT = 0, /* the client's setting (only as an argument; never stored) */
    TSP_TENSOR_TORCH = 1,   /* torch.Tensor through DLPack */
    TSP_TENSOR_NUMPY = 2    /* numpy.ndarray (read-only) through the buffer protocol */
} tsp_tensor_type_t;

/*
 * The exception classes (new references owned by the module state, created at module init).
 * Every one derives from Error, which carries .code (the TS_E* int, 0 for errors found locally
 * before anything was sent), .name ("ETIMEDOUT") and .message (the server's or the local
 * reason); the builtin base makes except clauses that know nothing of tensorshare work.
 */
typedef struct tsp_state_s {
    PyObject *module;                 /* borrowed: the module lives as long as the process */
    PyObject *Error;                  /* tensorshare.Error(Exception) */
    PyObject *TimeoutError;           /* (Error, builtins.TimeoutError): ETIMEDOUT */
    PyObject *ConnectionError;        /* (Error, builtins.ConnectionError): ENOTCONN, ESLOW,
                                         ESHUTDOWN, ETOOMANY, EPROTO, EVERSION */
    PyObject *ConnectionResetError;   /* (ConnectionError, builtins.ConnectionResetError) */
    PyObject *ConnectionRefusedError; /* (ConnectionError, builtins.ConnectionRefusedError) */
    PyObject *BinNotFoundError;       /* (Error, KeyError): ENOENT, a missing bin */
    PyObject *RecordError;            /* (Error, ValueError): EBADRECORD, ETYPE, ESCHEMA, and
                                         records refused before sending */
    PyObject *InvalidArgumentError;   /* (Error, ValueError): EINVAL, ENAMETOOLONG, EMSGSIZE */
    PyObject *AuthenticationError;    /* (Error, PermissionError): EACCES, EAUTH */
    PyObject *CancelledError;         /* (Error): ECANCELED (the client was closed) */
    PyObject *DeadlockError;          /* (Error, RuntimeError): EDEADLK (blocking call made from
                                         a callback on the client's I/O thread) */
    PyObject *ServerError;            /* (Error): EOOM, ESERVER, ESAVEFAIL, EUNKNOWNOP,
                                         EWRONGSHARD */
    PyObject *VersionMismatchError;   /* (Error): ECONFLICT (a put_if lost; .current_version) */
    PyObject *StaleGradientError;     /* (Error): ESTALE (a ps_push too stale; .current_version) */
    PyObject *BackpressureError;      /* (Error, builtins.BlockingIOError): EAGAIN (a stream's
                                         window is full; no room for an add) */
    PyObject *ServiceGoneError;       /* (Error): ESERVICE (service.c makes it) */
    PyTypeObject *ClientType;         /* tensorshare.Client */
    PyTypeObject *ViewType;           /* the owner of a received tensor's memory (view.c) */
    PyObject *BinInfoType;            /* struct sequence (n_items, bytes, version) */
    PyObject *NotificationType;       /* struct sequence, see above */
} tsp_state_t;

extern tsp_state_t tsp_state;

/*
 * Defined by rl.c and predictor.c: add their types and functions to the module. Called once
 * from the module's init, after everything in this header is ready. 0, or -1 with an exception.
 */
int tsp_rl_init(PyObject *module);
int tsp_predictor_init(PyObject *module);
/* Defined by stream.c: StreamEntry, StreamEntries, _StreamProducer, _StreamConsumer. */
int tsp_stream_init(PyObject *module);
/*
 * For the files' init functions (module.c): ready a static type and add it to module as name
 * (the module takes a reference of its own). 0, or -1 with an exception.
 */
int tsp_add_type(PyObject *module, PyTypeObject *type, const char *name);

/* ---------------------------------------------------------------------------------------------
 * Integer arguments
 *
 * An int argument is an int or another object with __index__ (a NumPy integer), never a bool
 * or a float (TypeError: "window must be an int, not float"). One out of its range raises
 * ValueError naming the argument and the range, "window must be an int from 0 to 4294967295,
 * not -1" (the 64-bit bounds are written 2**64-1, -2**63 and 2**63-1), so that no value is
 * silently cut to the width of the C type it is passed as.
 */

/* An int argument from min to max (obj NULL: *out unchanged); 0, or -1 with an exception. */
int tsp_uint_arg(PyObject *obj, const char *what, unsigned long long min, unsigned long long max,
                 unsigned long long *out);
/* As tsp_uint_arg, for a signed range. */
int tsp_int_arg(PyObject *obj, const char *what, long long min, long long max, long long *out);
/*
 * As tsp_uint_arg, raising InvalidArgumentError (a ValueError) for a value out of range, where
 * that is what the library would raise, or what docs/PYTHON.md says bad values raise (the
 * replay tables' arguments).
 */
int tsp_uint_arg_einval(PyObject *obj, const char *what, unsigned long long min,
                        unsigned long long max, unsigned long long *out);
/* A wait in ms: None (or obj NULL) gives none_ms, else an int from 0 to INT_MAX. */
int tsp_ms_arg(PyObject *obj, const char *what, int none_ms, int *out);

/* ---------------------------------------------------------------------------------------------
 * Errors
 */

/*
 * Raise the exception for status (a TS_E* code < 0) with ts_last_error() as its message, or
 * ts_strerror(status) when that is empty. Call it right after the failing ts_ call, on the same
 * thread (the message is thread-local; releasing and retaking the GIL around the call is fine).
 * Returns NULL, for `return tsp_raise(rc);`.
 */
PyObject *tsp_raise(int status);
/* As tsp_raise, with the message given (NULL: ts_strerror(status)). */
PyObject *tsp_raise_msg(int status, const char *message);
/*
 * The UTF-8 of a str that the library takes as a C string (valid while s lives): NULL with an
 * exception when s is not a str or cannot be encoded, NULL without one when it holds a NUL
 * character, which would silently cut the C string short (the caller raises its own error).
 */
const char *tsp_c_string(PyObject *s);
/*
 * Raise the exception for a status that carries a version (TS_ECONFLICT of a lost put_if,
 * TS_ESTALE of a too stale ps_push), with ts_last_error() as its message and its
 * current_version set to version, the one to read and retry with. Returns NULL.
 */
PyObject *tsp_raise_versioned(int status, uint64_t version);
/*
 * The exception instance for status and message (not raised), for futures and callbacks; a new
 * reference, or NULL with an exception set.
 */
PyObject *tsp_exception_new(int status, const char *message);
/*
 * As tsp_exception_new, of class cls (one of tsp_state's); status 0 leaves the instance the
 * class's code and name (an error the package found itself).
 */
PyObject *tsp_exception_make(PyObject *cls, int status, const char *message);
/*
 * Make the exception class tensorshare.<name> (a subclass of Error, whose instances carry code
 * by default), add it to module and put it in *out (a new reference). 0, or -1.
 */
int tsp_exception_subclass(PyObject *module, const char *name, const char *doc, int code,
                           PyObject **out);
/* The class for a status (borrowed; Error for codes without a class of their own). */
PyObject *tsp_exception_class(int status);

/* ---------------------------------------------------------------------------------------------
 * Python -> record (sending)
 *
 * The record borrows the memory of the caller's tensors (no copy): tsp_send_t keeps the Python
 * objects that own that memory alive in pins (a DLPack capsule for torch and __dlpack__
 * objects, a memoryview for buffer-protocol objects such as numpy arrays, a contiguous copy of a
 * non-contiguous input). Strings and byte strings are copied into the record (TS_COPY), so the
 * record does not depend on objects another thread could replace in a dict meanwhile.
 *
 * Refused with RecordError (a ValueError): unsupported dtypes (uint16/32/64, float128, object,
 * datetime, structured other than tensorshare.numpy_bfloat16 exactly, big-endian), more than
 * TS_MAX_NDIM dimensions, nesting deeper than TS_MAX_DEPTH with the leaves counted (also
 * catches self-referencing containers), non-str dict keys or keys with NUL, ints outside int64,
 * None and any other type, CUDA (or other non-CPU) tensors: they are not copied to the host
 * behind the caller's back; the message says to call .cpu() first. A tensor its exporter
 * refuses (sparse, meta, quantized torch tensors; a failing __dlpack__) is a RecordError with
 * the exporter's exception as __cause__ (MemoryError stays a MemoryError).
 * Non-contiguous tensors are made contiguous (one copy, pinned until the send is done), and so
 * are torch tensors whose conjugation or negation is a lazy flag (resolved: the values sent are
 * the tensor's).
 */
typedef struct tsp_send_s {
    ts_value_t *value; /* the record; owned; NULL after tsp_send_clear */
    PyObject *pins;    /* a list of the objects whose memory value borrows, or NULL */
} tsp_send_t;

/*
 * Convert obj into s->value (s is overwritten). The record and its pins stay valid until
 * tsp_send_clear. Keep s alive until the library no longer reads the memory: the return of a
 * blocking call, or the callback of an asynchronous one (where the callback, on the I/O thread,
 * takes the GIL and calls tsp_send_clear).
 */
int tsp_send_init(tsp_send_t *s, PyObject *obj);
/*
 * Free the record and release the pins. Idempotent. The GIL must be held (the pins are Python
 * objects); the record itself may be freed by tsp_send_clear only.
 */
void tsp_send_clear(tsp_send_t *s);
/*
 * The recursive conversion behind tsp_send_init, for bindings that build a record of their own
 * around a Python value: a new value (owned by the caller), whose borrowed memory's owners are
 * appended to pins (a list). depth is the nesting level of obj (1 for a root).
 */
ts_value_t *tsp_value_from_py(PyObject *obj, PyObject *pins, int depth);

/* ---------------------------------------------------------------------------------------------
 * Record -> Python (receiving)
 *
 * Tensors become views of the memory they were received in, never copies: a torch tensor made
 * with torch's from_dlpack over a DLManagedTensor, or a read-only numpy array over a View object
 * (buffer protocol). Each tensor holds its own reference on the receive buffer (through
 * ts_value_to_dlpack), so the buffer lives exactly as long as some view of it does: freeing the
 * ts_items_t (or closing the client) right after the conversion is fine. Views release their
 * reference from whatever thread drops them, without needing the GIL. bool tensors reach torch
 * as uint8 and are reinterpreted (torch 1.13's DLPack import has no bool); bfloat16 reaches
 * numpy as the structured dtype tensorshare.numpy_bfloat16 (numpy has no bfloat16), which a put
 * accepts back as bfloat16. ints, floats, strings and byte strings are copied into Python
 * objects (strings are decoded as UTF-8 with surrogateescape).
 */

/* Parse a tensor_type argument: None -> dflt, "torch", "numpy"; else ValueError. */
int tsp_tensor_type_from_py(PyObject *obj, tsp_tensor_type_t dflt, tsp_tensor_type_t *out);
/*
 * The process-wide default: "torch" when torch can be imported, "numpy" when importing it
 * raises ImportError (ModuleNotFoundError included); decided once, by the first call that gets
 * an answer. Any other exception of the import (KeyboardInterrupt, MemoryError) decides
 * nothing: TSP_TENSOR_DEFAULT with that exception set, and the next call imports again.
 */
tsp_tensor_type_t tsp_tensor_type_default(void);
/*
 * Import what tensors of type tt need (torch, or numpy) if that was not done yet: 0, or -1
 * with the ImportError. Call it before an operation that takes items out of a bin (get), so
 * that a missing module fails the call before anything is removed.
 */
int tsp_tensor_type_ready(tsp_tensor_type_t tt);

/*
 * Keeps memory that views point into alive, for values that do not hold a reference on a
 * receive buffer themselves (values a binding built, such as a batcher's output, or values
 * owned by another library object). Reference counted with atomics: any thread may drop a
 * reference without the GIL, so release must not need the GIL either.
 */
typedef struct tsp_owner_s tsp_owner_t;

/* An owner with one reference that calls release(arg) when the last one goes; NULL: no memory. */
tsp_owner_t *tsp_owner_new(void (*release)(void *arg), void *arg);
/* Drop a reference (NULL is a no-op). Any thread, with or without the GIL. */
void tsp_owner_unref(tsp_owner_t *o);

/*
 * A received value (a record, or any value inside one) as a Python object: dict, list, int,
 * float, str, bytes, or a tensor view. tt must not be TSP_TENSOR_DEFAULT.
 */
PyObject *tsp_value_to_py(const ts_value_t *v, tsp_tensor_type_t tt);
/*
 * As tsp_value_to_py, for any value: every tensor view takes a reference on owner (may be NULL
 * for received values, which hold their receive buffer themselves). The caller keeps its own
 * reference and drops it when it is done with v. tt may be TSP_TENSOR_DEFAULT: the process
 * default (tsp_tensor_type_default; NULL with its exception when it cannot be decided).
 */
PyObject *tsp_value_to_py_ex(const ts_value_t *v, tsp_tensor_type_t tt, tsp_owner_t *owner);
/*
 * Take a value the caller owns (built, or transferred by the library, such as a batcher output)
 * and return it as Python objects; v is freed with ts_value_free once the last view of its
 * memory is gone (at once when it has no tensors, and on failure). tt as for _ex.
 */
PyObject *tsp_value_to_py_owned(ts_value_t *v, tsp_tensor_type_t tt);
/* The items of a get or peek as a list of records; items stays the caller's to free. tt as for
 * tsp_value_to_py_ex. */
PyObject *tsp_items_to_py(const ts_items_t *items, tsp_tensor_type_t tt);
/*
 * As tsp_items_to_py, for items that were taken out of their bin (a get): nothing may be lost
 * silently. When a conversion fails, the exception raised is the first failure's, with the
 * attribute items: the list of every item taken, oldest first, each converted on its own (None
 * for those that could not be; None is never a record), and a note (Python 3.11+) saying so.
 */
PyObject *tsp_taken_items_to_py(const ts_items_t *items, tsp_tensor_type_t tt);
/* Makes the i-th item handed over: a new reference, or NULL with an exception. */
typedef PyObject *(*tsp_item_fn)(void *arg, size_t i);
/*
 * After the conversion of n items already taken out of their bin failed (the current
 * exception), so that none is lost silently: make each on its own with item(arg, i) and hand
 * them over on the exception as .items, oldest first, None for one that could not be made,
 * with a note (Python 3.11+) made of note_fmt, whose two %zu are n and the number lost. When
 * even the list cannot be made the exception goes on alone. The exception stays set.
 */
void tsp_hand_over_items(size_t n, tsp_item_fn item, void *arg, const char *note_fmt);

/* ---------------------------------------------------------------------------------------------
 * The Client
 */

/*
 * Enter a call on a tensorshare.Client: returns its ts_client_t, and counts the caller as a
 * user of it until tsp_client_leave. While any user is counted, close() only marks the Client
 * closed, and the last tsp_client_leave frees the ts_client_t; so the handle stays valid
 * between enter and leave even if another thread closes the Client meanwhile (the blocking call
 * then runs to its own end: bounded by the request timeout). Release the GIL around blocking ts_
 * calls made in between (Py_BEGIN_ALLOW_THREADS). NULL with an exception: obj is not a Client
 * (TypeError), the Client is closed (tensorshare.CancelledError) or was opened by the parent of
 * a fork (tensorshare.ConnectionError).
 *
 * An object that uses the client for its whole life (an RL worker, a predictor) enters once
 * when it is created and leaves when it is closed, keeping a reference to the Client object
 * too; closing the Client then takes effect when the last such object is closed.
 */
ts_client_t *tsp_client_enter(PyObject *obj);
/* Pair of tsp_client_enter (with the GIL held; may release it while freeing the client). */
void tsp_client_leave(PyObject *obj);
/*
 * Keep item (a new reference is taken) until the Client's ts_client_t is freed, after which no
 * request of it reads memory any more: for memory that requests still in flight borrow when
 * their owner goes (an RL worker's copy=False adds). obj must be entered. 0, or -1.
 */
int tsp_client_keep(PyObject *obj, PyObject *item);
/*
 * For a call that waits in slices between tsp_client_enter and tsp_client_leave: 1 with
 * tensorshare.CancelledError raised when close() was called on the Client meanwhile (the wait
 * must stop), else 0.
 */
int tsp_client_cancelled(PyObject *obj);
/*
 * The tensor_type a Client hands received tensors in (TSP_TENSOR_TORCH or _NUMPY), or
 * TSP_TENSOR_DEFAULT with an exception when the process default cannot be decided
 * (tsp_tensor_type_default).
 */
tsp_tensor_type_t tsp_client_tensor_type(PyObject *obj);
/*
 * A tensor_type argument (NULL or None: the Client's) with its module imported, so that a
 * missing module fails the call before it asks the server (tsp_tensor_type_ready). 0, or -1
 * with an exception.
 */
int tsp_client_tensor_type_arg(PyObject *obj, PyObject *client, tsp_tensor_type_t *out);
/* A library call that describes the object called name (ts_stream_info, ts_table_info). */
typedef int (*tsp_info_fn)(ts_client_t *c, const char *name, ts_value_t **out);
/*
 * The body of a Client method that takes a name and returns info's description of it as Python
 * values: format parses the one argument ("s:stream_info"), info runs with the GIL released.
 * NULL with an exception.
 */
PyObject *tsp_client_info(PyObject *client, PyObject *args, PyObject *kw, const char *format,
                          tsp_info_fn info);
/*
 * Opens the C object of something that uses a Client for its whole life: called with the GIL
 * released and with the entered client; arg is the caller's. A ts_ status (0: opened).
 */
typedef int (*tsp_open_fn)(ts_client_t *c, void *arg);
/*
 * Create such an object (client_user.c): enter client (tsp_client_enter), parse the tensor_type
 * argument tt_obj into *tt (the Client's own as the default), then call open_fn(c, arg) without
 * the GIL. 0 with the client entered (the caller leaves it when the object is freed and keeps
 * its own reference to client), or -1 with an exception and the client not entered.
 */
int tsp_client_open(PyObject *client, PyObject *tt_obj, tsp_open_fn open_fn, void *arg,
                    tsp_tensor_type_t *tt);
/*
 * The head of such an object's Python type (the RL trainer and worker, the Predictor): the
 * Client it keeps entered and the accounting of the calls running on its C object. Several
 * threads may call it: each call counts itself (with the GIL held) between the type's own enter
 * function and tsp_client_user_leave, and close() frees the C object only when the last user
 * has left. The functions below are client_user.c's; each takes the GIL held.
 */
typedef struct tsp_client_user {
    PyObject_HEAD PyObject *client; /* the tensorshare.Client, entered while open */
    void *handle;                   /* the C object; NULL once freed */
    int users;                      /* calls running on handle */
    int closing;                    /* close() was called; the last user frees handle */
    unsigned long fork_generation;  /* tsp_fork_generation when created */
    tsp_tensor_type_t tensor_type;  /* how received tensors are handed out */
    void (*free_handle)(void *h);   /* frees handle (called without the GIL) */
    /* optional: called with the GIL and h (the handle) right before free_handle(h) */
    void (*before_free)(struct tsp_client_user *u, void *h);
} tsp_client_user;
/*
 * Free the C object (GIL released meanwhile) and leave the Client; in a child after fork only
 * the Client's reference is dropped (the library's threads are gone). Idempotent.
 */
void tsp_client_user_free(tsp_client_user *u);
/* End a call: the last one out after close() frees the C object. */
void tsp_client_user_leave(tsp_client_user *u);
/* Mark u closed, freeing the C object now when no call runs on it. Idempotent. */
void tsp_client_user_close(tsp_client_user *u);
/* close() -> None, __exit__(...) -> False (closes), and the closed and client getters. */
PyObject *tsp_client_user_close_method(PyObject *self, PyObject *unused);
PyObject *tsp_client_user_exit_method(PyObject *self, PyObject *args);
PyObject *tsp_client_user_get_closed(PyObject *self, void *closure);
PyObject *tsp_client_user_get_client(PyObject *self, void *closure);
/* tp_traverse: visits the Client. */
int tsp_client_user_traverse(PyObject *self, visitproc visit, void *arg);

/*
 * Run Python code from a library callback on a thread the interpreter did not start (the
 * client's I/O thread, a batcher or predictor thread): take the GIL, or return 0 without it
 * when the interpreter is finalizing (the callback must then drop its work without touching
 * Python objects: it leaks them rather than crash). Returns 1 with the GIL taken; pair with
 * tsp_gil_release(state).
 */
int tsp_gil_acquire(PyGILState_STATE *state);
void tsp_gil_release(PyGILState_STATE state);
/*
 * Report an exception raised by a user callback (the current exception) without losing it or
 * letting it escape: sys.unraisablehook with a message naming what was called. Clears it.
 */
void tsp_report_callback_error(const char *what, PyObject *callable);

/*
 * Counts the fork() calls this process descends from (incremented in the child): an object that
 * records it when it is created and finds another value later is being used in a child process,
 * where the library threads it relies on do not exist (raise ConnectionError, never touch them).
 */
extern volatile unsigned long tsp_fork_generation;

/*
 * A request whose concurrent.futures.Future a library thread completes, linked (under the GIL)
 * in a list of the outstanding ones while it is in flight, so that a child process after fork(),
 * where those threads do not exist, can fail the futures instead of leaving them pending forever.
 * Embedded in each binding's request as its member pend (client.c).
 */
typedef struct tsp_pending {
    PyObject *future; /* owned; NULL once handed to a child's fork hook */
    struct tsp_pending *prev, *next;
} tsp_pending;

/* Link p at the head of *head / unlink it (a no-op when it is not linked). Under the GIL. */
void tsp_pending_link(tsp_pending **head, tsp_pending *p);
void tsp_pending_unlink(tsp_pending **head, tsp_pending *p);
/*
 * In a child after fork(): take every request off *head and return [(future, ConnectionError
 * carrying message), ...] for the package's fork hook to complete. The requests belong to the
 * parent's library state and are left alone (never freed here).
 */
PyObject *tsp_pending_take(tsp_pending **head, const char *message);

/* ---------------------------------------------------------------------------------------------
 * Same-host zero copy (shm.c): the SharedBuffer type and the Client methods that use it
 */
/* Add SharedBuffer to the module. 0, or -1 with an exception. */
int tsp_shm_init(PyObject *module);
/* Client.shared(layout, *, tensor_type=None), put_shared(bin, buf), append_shared(bin, buf). */
PyObject *tsp_client_shared(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames);
PyObject *tsp_client_put_shared(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);
PyObject *tsp_client_append_shared(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames);
/* Their entries in the Client's method table. */
#define TSP_SHM_CLIENT_METHODS                                                                     \
    {"shared", (PyCFunction)(void (*)(void))tsp_client_shared, METH_FASTCALL | METH_KEYWORDS,      \
     "shared(layout, *, tensor_type=None) -> SharedBuffer\n\nA record in shared memory to fill "   \
     "in place: layout is a dict/list tree whose (dtype, shape) pairs become zeroed tensors."},    \
        {"put_shared", (PyCFunction)(void (*)(void))tsp_client_put_shared,                         \
         METH_FASTCALL | METH_KEYWORDS,                                                            \
         "put_shared(bin, buffer) -> int\n\nReplace the bin's content with the buffer's record, "  \
         "handing its memory to the server (unix sockets; a put over TCP)."},                      \
        {"append_shared", (PyCFunction)(void (*)(void))tsp_client_append_shared,                   \
         METH_FASTCALL | METH_KEYWORDS,                                                            \
         "append_shared(bin, buffer) -> int\n\nAs put_shared, adding an item."},

/*
 * rows.c: Client.create_tensor_bin, read_rows, gather_rows and write_rows (METH_VARARGS |
 * METH_KEYWORDS methods of the Client type; client.c lists them in its method table).
 */
PyObject *tsp_client_create_tensor_bin(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_read_rows(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_gather_rows(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_write_rows(PyObject *client, PyObject *args, PyObject *kw);

/*
 * stream.c: the Client's stream methods (METH_VARARGS | METH_KEYWORDS; client.c lists them in
 * its method table through TSP_STREAM_CLIENT_METHODS).
 */
PyObject *tsp_client_stream_create(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_append(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_mark(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_credit(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_join(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_read(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_ack(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_leave(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_info(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_stream_range(PyObject *client, PyObject *args, PyObject *kw);
#define TSP_STREAM_METHOD(name, doc)                                                               \
    {#name, (PyCFunction)(void (*)(void))tsp_client_##name, METH_VARARGS | METH_KEYWORDS, doc},
#define TSP_STREAM_CLIENT_METHODS                                                                  \
    TSP_STREAM_METHOD(stream_create,                                                               \
                      "stream_create(name, max_entries=1024, max_bytes=0, max_age_ms=0, "          \
                      "window=0, lease_ms=0) -> dict\n\nCreate the stream (or change its "         \
                      "settings) and return its state.")                                           \
    TSP_STREAM_METHOD(stream_append,                                                               \
                      "stream_append(name, value) -> int\n\nAppend a record; returns its id. "     \
                      "BackpressureError when the window is full (nothing stored).")               \
    TSP_STREAM_METHOD(stream_mark, "stream_mark(name, tag) -> int\n\nAppend an end-of-epoch "      \
                                   "marker with tag (never refused for credit); returns its id.")  \
    TSP_STREAM_METHOD(stream_credit,                                                               \
                      "stream_credit(name, timeout_ms=None) -> dict\n\nWait until an append "      \
                      "would be accepted; returns the state. TimeoutError after timeout_ms.")      \
    TSP_STREAM_METHOD(stream_join,                                                                 \
                      "stream_join(name, group, member, start='oldest', lease_ms=0) -> dict\n\n"   \
                      "Join group as member (creating either); returns the group's position.")     \
    TSP_STREAM_METHOD(stream_read,                                                                 \
                      "stream_read(name, group, member, ack_through=0, max_entries=64, "           \
                      "timeout_ms=0, *, tensor_type=None) -> StreamEntries\n\nHand out entries "   \
                      "to member (empty after timeout_ms; None: no limit).")                       \
    TSP_STREAM_METHOD(stream_ack,                                                                  \
                      "stream_ack(name, group, member, first, last=None, rows=0) -> dict\n\n"      \
                      "Acknowledge the member's entries [first, last], or record rows consumed.")  \
    TSP_STREAM_METHOD(stream_leave,                                                                \
                      "stream_leave(name, group, member=None) -> dict\n\nmember leaves group; "    \
                      "member None removes the group.")                                            \
    TSP_STREAM_METHOD(stream_info, "stream_info(name) -> dict\n\nSettings, ids, groups, members.") \
    TSP_STREAM_METHOD(stream_range,                                                                \
                      "stream_range(name, after_id=0, max_entries=64, timeout_ms=0, *, "           \
                      "tensor_type=None) -> StreamEntries\n\nThe kept entries after after_id, "    \
                      "without a cursor.")

/*
 * ps.c: the Client's parameter-server methods (METH_VARARGS | METH_KEYWORDS; client.c lists
 * them through TSP_PS_CLIENT_METHODS). Added in 0.5.0.
 */
PyObject *tsp_client_ps_create(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_ps_push(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_ps_pull(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_emb_create(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_emb_pull(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_emb_push(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_emb_versions(PyObject *client, PyObject *args, PyObject *kw);
#define TSP_PS_CLIENT_METHODS                                                                      \
    TSP_STREAM_METHOD(ps_create,                                                                   \
                      "ps_create(name, optimizer=1, mode=0, lr=0.01, beta1=0.9, "                  \
                      "beta2=0.999, eps=1e-8, sync_k=1, tolerance=0, "                             \
                      "lr_staleness=False, keep=False) -> int\n\nMake bin name a parameter "       \
                      "(keep: leave one with the same settings as it is).")                        \
    TSP_STREAM_METHOD(ps_push, "ps_push(name, grad, base_version=0, scale=1.0) -> int\n\nPush a "  \
                               "float32 gradient; StaleGradientError (.current_version).")         \
    TSP_STREAM_METHOD(ps_pull, "ps_pull(name, if_newer_than=0, *, tensor_type=None) -> "           \
                               "(version, value) or None")                                         \
    TSP_STREAM_METHOD(emb_create, "emb_create(name, dim, optimizer=1, init=1, seed=0, num_ids=0, " \
                                  "lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, init_scale=0.05)")   \
    TSP_STREAM_METHOD(emb_pull, "emb_pull(name, ids, out) -> int\n\nRows of int64 ids into "       \
                                "float32 out [n, dim]; returns the table's version.")              \
    TSP_STREAM_METHOD(emb_push, "emb_push(name, ids, grads, scale=1.0) -> int\n\nRow gradients.")  \
    TSP_STREAM_METHOD(emb_versions, "emb_versions(name) -> list of int\n\nThe table's version "    \
                                    "on each shard (one entry for a client of one daemon).")

/*
 * coord.c: the Client's coordination methods (METH_VARARGS | METH_KEYWORDS; client.c lists them
 * in its method table through TSP_COORD_CLIENT_METHODS).
 */
PyObject *tsp_client_add(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_put_if(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_take(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_mget(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_barrier(PyObject *client, PyObject *args, PyObject *kw);
#define TSP_COORD_CLIENT_METHODS                                                                   \
    TSP_STREAM_METHOD(add, "add(name, delta=1) -> int\n\nAdd delta to the counter (created at "    \
                           "0); returns its new value. InvalidArgumentError: not a counter.")      \
    TSP_STREAM_METHOD(put_if,                                                                      \
                      "put_if(name, expected_version, value) -> int\n\nput only if the bin's "     \
                      "version is expected_version (0: the bin must not exist); returns the new "  \
                      "version. VersionMismatchError (.current_version) otherwise.")               \
    TSP_STREAM_METHOD(take,                                                                        \
                      "take(name, max_items=0, timeout_ms=None, *, tensor_type=None) -> list\n\n"  \
                      "A blocking get: each item goes to exactly one taker, first come first "     \
                      "served. TimeoutError after timeout_ms (None: the request timeout).")        \
    TSP_STREAM_METHOD(mget,                                                                        \
                      "mget(names, max_items=0, *, tensor_type=None) -> dict\n\nPeek up to 256 "   \
                      "bins in one round trip: {name: [records] or None when missing}.")           \
    TSP_STREAM_METHOD(barrier,                                                                     \
                      "barrier(name, parties, timeout_ms=None) -> int\n\nWait until parties "      \
                      "callers arrived; returns the generation (1, 2, ...).")

/*
 * replay.c: the Client's replay table methods (METH_VARARGS | METH_KEYWORDS; client.c lists them
 * in its method table through TSP_REPLAY_CLIENT_METHODS).
 */
PyObject *tsp_client_table_create(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_table_insert(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_table_sample(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_table_update(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_table_remove(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_table_info(PyObject *client, PyObject *args, PyObject *kw);
#define TSP_REPLAY_CLIENT_METHODS                                                                  \
    TSP_STREAM_METHOD(                                                                             \
        table_create,                                                                              \
        "table_create(name, capacity=100000, sampler='uniform', remover='fifo', "                  \
        "priority_exponent=1.0, max_times_sampled=0, min_size_to_sample=1, "                       \
        "samples_per_insert=1.0, error_buffer=0.0) -> dict\n\nCreate a replay "                    \
        "table (samplers: uniform, prioritized, fifo, lifo; removers: fifo, lifo, "                \
        "lowest_priority; error_buffer 0: no rate limit beyond min_size_to_sample).")              \
    TSP_STREAM_METHOD(table_insert,                                                                \
                      "table_insert(name, value, priority=1.0, timeout_ms=None) -> int\n\n"        \
                      "Insert a record; returns its key. Waits for the rate limiter "              \
                      "(TimeoutError after timeout_ms; None: the request timeout).")               \
    TSP_STREAM_METHOD(table_sample,                                                                \
                      "table_sample(name, n=1, timeout_ms=None, *, tensor_type=None) -> list\n\n"  \
                      "Draw 1..n items (as many as the rate limiter allows): dicts with key, "     \
                      "probability, times_sampled, age_ms, value.")                                \
    TSP_STREAM_METHOD(table_update,                                                                \
                      "table_update(name, keys, priorities) -> dict\n\nSet priorities by key "     \
                      "(unknown keys skipped and counted).")                                       \
    TSP_STREAM_METHOD(table_remove, "table_remove(name, keys) -> dict\n\nRemove items by key.")    \
    TSP_STREAM_METHOD(table_info, "table_info(name) -> dict\n\nSettings, counters and the rate "   \
                                  "limiter's state.")

/*
 * Defined by service.c: Client.call and Client._serve (the registration behind Client.serve,
 * tensorshare/service.py), the _ServiceHandle type and ServiceGoneError. Added in 0.6.0.
 */
int tsp_service_init(PyObject *module);
PyObject *tsp_client_call(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client__serve(PyObject *client, PyObject *args, PyObject *kw);
PyObject *tsp_client_serve(PyObject *client, PyObject *args, PyObject *kw);
#define TSP_SERVICE_CLIENT_METHODS                                                                 \
    TSP_STREAM_METHOD(call, "call(service, request, timeout=None, wait_for_server=False, *, "      \
                            "tensor_type=None) -> answer\n\nCall a service and wait for its "      \
                            "answer (docs/PYTHON.md, Services).")                                  \
    TSP_STREAM_METHOD(serve, "serve(service, handler, concurrency=64, workers=None) -> Service"    \
                             "\n\nServe service: handler(request) -> answer runs on worker "       \
                             "threads (docs/PYTHON.md, Services).")                                \
    TSP_STREAM_METHOD(_serve, "_serve(service, concurrency=64) -> _ServiceHandle")

/* ---------------------------------------------------------------------------------------------
 * Buffer-protocol exports of one dense tensor (view.c; used by view.c's View and shm.c's
 * segments). Added in 0.6.0.
 */
/* The memory layout of a C-contiguous tensor, as a Py_buffer describes it. */
typedef struct tsp_layout {
    Py_ssize_t shape[TS_MAX_NDIM];
    Py_ssize_t strides[TS_MAX_NDIM]; /* bytes, C order */
    Py_ssize_t len;                  /* bytes of the whole tensor */
    Py_ssize_t itemsize;             /* bytes of one element */
    int ndim;
    ts_dtype_t dtype;
} tsp_layout;
/* Fill l for a tensor of dtype with ndim (0..TS_MAX_NDIM) dimensions shape. */
void tsp_layout_init(tsp_layout *l, ts_dtype_t dtype, int ndim, const int64_t *shape);
/* How many dimensions of l are > 1 (the memory is Fortran-ordered too when at most one is). */
int tsp_layout_big_dims(const tsp_layout *l);
/*
 * Fill b for a getbuffer of obj over buf laid out as l, as flags ask (shape, strides, format);
 * b->obj takes a new reference on obj. The caller has refused what it cannot give.
 */
void tsp_layout_export(const tsp_layout *l, Py_buffer *b, PyObject *obj, void *buf, int readonly,
                       int flags);
/*
 * Import numpy once (kept for the process); 0 with numpy.asarray in *asarray and the bfloat16
 * dtype of received arrays in *bfloat16 (borrowed; either may be NULL), or -1 with an exception.
 */
int tsp_numpy_ready(PyObject **asarray, PyObject **bfloat16);

#endif /* TSP_H */
