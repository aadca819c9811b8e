/*
 * The parameter server in tensord (ps.c): dense parameters (a bin holding one float32 tensor,
 * made a parameter by PS_CREATE with an optimizer and a mode) updated by PS_PUSH, read by PS_PULL
 * (only when newer than a version), and embedding tables (rows of floats by int64 id, created on
 * first use by a deterministic initializer) read by EMB_PULL and updated by EMB_PUSH.
 * docs/PROTOCOL.md 8.45 to 8.50 and docs/PS.md describe them.
 *
 * Thread: the requests arrive and are answered on the loop thread. The arithmetic runs on the
 * thread pool, one job per parameter or table at a time, on buffers the loop does not touch
 * while the job runs; a job's result is published on the loop as a new immutable item (so a
 * reader sees the old or the new tensor, never a mix) with a new version.
 */
#ifndef TSD_PS_H
#define TSD_PS_H

#include "server.h"

/* Handle a decoded PS_CREATE, PS_PULL or EMB_CREATE (tsd_op_dispatch). */
void tsd_ps_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);
/*
 * Finish a PS_PUSH, EMB_PULL or EMB_PUSH whose record arrived and was validated into item, with
 * the fixed fields kept by conn.c (fixed_len bytes): as tsd_op_store, the reference and the
 * store reservation of tsd_item_len(item) are the callee's. Exactly one reply, now or when the
 * work is done (a sync push: when its step is applied).
 */
void tsd_ps_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                   const uint8_t *fixed, size_t fixed_len, tsd_item *item);
/* A closing connection: its pending requests are finished without an answer. */
void tsd_ps_conn_gone(tsd_server *srv, tsd_conn *c);
/*
 * tensord is stopping: answer c's pending requests SHUTTING_DOWN (a sync push keeps its
 * contribution to the step being formed). Returns how many.
 */
size_t tsd_ps_conn_stop(tsd_server *srv, tsd_conn *c);
/* At exit, after the loop ran out (no job is in flight): free every parameter and table. */
void tsd_ps_free(tsd_server *srv);

#endif /* TSD_PS_H */
