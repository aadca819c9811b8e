/*
 * tensorshare coordination primitives: counters, compare-and-set, a work queue that hands each
 * item to one taker, reads of many bins at once and barriers (the feature set of
 * torch.distributed's TCPStore). docs/COORDINATION.md says what each guarantees; the wire form
 * is docs/PROTOCOL.md 8.39 to 8.43.
 *
 * A counter is a plain bin holding one item whose record is an int: ts_add creates it (at
 * 0 + delta), ts_peek and ts_get read it like any bin, ts_wait and ts_listen see its changes.
 *
 * Conventions are those of tensorshare.h: 0 or a negative TS_E* code with its reason in
 * ts_last_error(), out-parameters written only on success (they may be NULL) except where a
 * function says otherwise, borrowed pointer parameters, and timeouts as tensorshare.h describes.
 * Every call blocks: it may be made from any thread (one client may be shared), never from a
 * client callback (TS_EDEADLK), and is bounded by the client's request timeout (plus its own
 * wait, where it has one). Bin names are NUL-terminated strings of at most 255 bytes (NULL:
 * TS_EINVAL; longer: TS_ENAMETOOLONG). Server errors common to all: TS_EINVAL for a name that is
 * a stream (nothing changed), TS_EOOM, TS_ESAVEFAIL for the changes while snapshots fail,
 * TS_ESHUTDOWN. Added in 0.4.0.
 */
#ifndef TENSORSHARE_COORD_H
#define TENSORSHARE_COORD_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Add delta to the counter bin name, atomically (the server applies ADDs one at a time): a
 * missing bin is created holding 0 + delta. *value: the counter's new value; *version: the bin's
 * version after the change (both may be NULL). Listeners get a put notification. TS_EINVAL: the
 * bin holds something other than one int record, or the sum leaves int64 (nothing changed).
 * Added in 0.4.0.
 */
TS_EXTERN int ts_add(ts_client_t *c, const char *name, int64_t delta, int64_t *value,
                     uint64_t *version);

/*
 * Compare-and-set: replace bin name's items with item (like ts_put) only when the bin's version
 * is expected_version; 0 means the bin must not exist. On success *version is the new version.
 * When the version differs, nothing changes and TS_ECONFLICT is returned with *version set to the
 * bin's current version (0: it does not exist), so that the caller can read and retry: the one
 * out-parameter written on an error. item is borrowed (its tensors are sent from the caller's
 * memory during the call). Added in 0.4.0.
 */
TS_EXTERN int ts_put_if(ts_client_t *c, const char *name, uint64_t expected_version,
                        const ts_value_t *item, uint64_t *version);

/*
 * Take up to max_items items (0 = all) from bin name, waiting up to timeout_ms for the bin to
 * have some: a blocking ts_get that gives each item to exactly one taker. Takers waiting on one
 * bin are served in the order their requests arrived, and an item that arrives wakes only the
 * first of them. *out: the items, transferred (ts_items_free). TS_ETIMEDOUT when none came in
 * time (0: do not wait; TS_TIMEOUT_DEFAULT: the request timeout; TS_TIMEOUT_INFINITE:
 * TS_EINVAL). A DELETE of the bin leaves takers waiting. A wait counts against the server's
 * --max-watch. A TS_ETIMEDOUT that tensord answered took nothing; one the client gave when no
 * reply came within timeout_ms plus the request timeout (ts_last_error_no_reply() 1: the server
 * paused or unreachable) may still be carried out when the server reads the request, and the
 * items it takes then are lost (docs/COORDINATION.md). Added in 0.4.0.
 */
TS_EXTERN int ts_take(ts_client_t *c, const char *name, size_t max_items, int timeout_ms,
                      ts_items_t **out);

/* Names one ts_mget takes at most. Added in 0.4.0. */
#define TS_MGET_MAX 256

/*
 * Read n bins (1 to TS_MGET_MAX) in one round trip, as ts_peek reads each (up to max_items
 * items per bin, 0 = all; nothing is removed). out[i] receives bin names[i]'s items, transferred
 * (ts_items_free), or NULL when that bin does not exist. The request must also fit the server's
 * control body limit (4096 bytes: 8 + the names and a byte each): TS_EMSGSIZE otherwise. A name
 * of a stream or a replay table gives TS_EINVAL (as ts_peek does) and nothing is returned
 * (Changed in 0.5.0: it read as missing before). On an error no out[i] is written.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_mget(ts_client_t *c, const char *const *names, size_t n, size_t max_items,
                      ts_items_t **out);

/*
 * Wait at barrier name until parties callers (this one included) have arrived, then return in
 * all of them with the same *generation (1 for a barrier's first release, then 2, ...). The
 * barrier is reusable: arrivals after a release form the next generation. Every arrival must
 * give the same parties (1 to 65536; else TS_EINVAL, nothing changed). TS_ETIMEDOUT when the
 * others did not come within timeout_ms (TS_TIMEOUT_DEFAULT: the request timeout;
 * TS_TIMEOUT_INFINITE: TS_EINVAL): this arrival is withdrawn (but when the client gave up
 * because no reply came, ts_last_error_no_reply() 1, the arrival may still count once the server
 * reads it: docs/COORDINATION.md). Barriers live in the server's
 * memory only: a restart forgets them and the callers waiting get TS_ESHUTDOWN or lose their
 * connection. Added in 0.4.0.
 */
TS_EXTERN int ts_barrier(ts_client_t *c, const char *name, uint32_t parties, int timeout_ms,
                         uint64_t *generation);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_COORD_H */
