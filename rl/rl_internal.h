/*
 * What the files of the RL helpers (rl/) share: defaults, the bin record layout and a few
 * helpers on the monotonic clock. Not installed. The helpers are built on the public API only
 * (include/tensorshare/) plus the allocation hooks (hooks.h).
 *
 * The files: rl.c holds these helpers and the options, trainer.c the trainer (publish, collect,
 * batches), worker.c the parameter snapshots and the worker (follow, await, add, flush).
 */
#ifndef TS_RL_INTERNAL_H
#define TS_RL_INTERNAL_H

#include "tensorshare/rl.h"

#include <pthread.h>
#include <stdint.h>

#include "hooks.h"

#define RL_WAIT_SLICE_MS 10000 /* ms; one server-side wait, kept below any request timeout */

#define RL_DEFAULT_IN_FLIGHT       16u
#define RL_DEFAULT_IN_FLIGHT_BYTES ((size_t)64 << 20)
#define RL_DEFAULT_TIMEOUT_MS      30000 /* ms; what TS_TIMEOUT_DEFAULT means by default */

/*
 * Write prefix + name into out (TS_MAX_NAME_LEN + 1 bytes). Returns 0, TS_EINVAL for an empty
 * name, or TS_ENAMETOOLONG.
 */
int ts__rl_bin_name(char *out, const char *prefix, const char *name);
/* Monotonic milliseconds; deadlines are computed on this clock. */
int64_t ts__rl_now_ms(void);
/* Wait on cond (monotonic) until woken or until deadline_ms (< 0: none). 0 or ETIMEDOUT. */
int ts__rl_cond_wait_until(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t deadline_ms);
/* The deadline for a timeout in ms: -1 for "no limit" (timeout_ms < 0). */
int64_t ts__rl_deadline(int timeout_ms);
/*
 * Resolve a public timeout parameter (tensorshare.h "Timeouts") against dflt, the options'
 * timeout_ms (already resolved): *out is then >= 0 milliseconds or -1 for no limit. 0, or
 * TS_EINVAL with the message set.
 */
int ts__rl_timeout(int timeout_ms, int dflt, int *out);
/*
 * The end of a public RL call that cleared the thread's message on entry: a failure that set
 * no message of its own (a client call sets the server's) gets "what: ts_strerror(rc)".
 * Returns rc.
 */
int ts__rl_done(int rc, const char *what);
/*
 * Build {key: <borrowed view of payload>, "version": version}, the record layout of both bins.
 * Returns NULL on allocation failure (or when payload cannot be wrapped).
 */
ts_value_t *ts__rl_wrap(const char *key, const ts_value_t *payload, int64_t version);
/*
 * Read {key: <value>, "version": int} from a received record. Returns 0 with *payload and
 * *version set, or TS_EBADRECORD when the record does not have that shape.
 */
int ts__rl_unwrap(const ts_value_t *rec, const char *key, const ts_value_t **payload,
                  int64_t *version);

#endif /* TS_RL_INTERNAL_H */
