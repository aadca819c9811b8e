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
#include "snapfile.h"

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
 * Bin name changed by a request (not by a step of its parameter): a sync step being formed for
 * a parameter whose bin no longer holds its tensor (deleted, or replaced by something else) is
 * answered with the error at once, and its accumulator starts over.
 */
void tsd_ps_bin_changed(tsd_server *srv, const uint8_t *name, size_t len);
/*
 * tensord is stopping: answer c's pending requests SHUTTING_DOWN (a sync push keeps its
 * contribution to the step being formed). Returns how many.
 */
size_t tsd_ps_conn_stop(tsd_server *srv, tsd_conn *c);
/*
 * At stop or exit: free every parameter and table (the pending requests were answered or their
 * connections are gone). No job of ps.c may be running: a snapshot (tsd_snapshot_final) waits
 * for them through tsd_ps_quiesce first.
 */
void tsd_ps_free(tsd_server *srv);

/*
 * Snapshots (format 4, docs/PS.md "Snapshots"). A job on the thread pool mutates a parameter's
 * slots or a table's arrays in place, so the state is taken only while none runs:
 * tsd_ps_quiesce stops starting jobs (requests queue) and says when the running ones are over;
 * tsd_ps_snapshot_take then records every setting in the same loop turn as the snapshot's view
 * begins and copies the large arrays on the thread pool, one job per parameter or table, while
 * jobs stay stopped; they start again when the copies are done. Loop thread, but for
 * tsd_ps_snapshot_wait. Added in 0.6.0.
 */
typedef struct tsd_ps_snap tsd_ps_snap;
/*
 * Stop starting jobs until tsd_ps_snapshot_take. 0 when none runs (take it now, in this loop
 * turn); 1 when some do: cb(arg) is called on the loop once the last one ended (once; a second
 * call replaces the first's cb).
 */
int tsd_ps_quiesce(tsd_server *srv, void (*cb)(void *arg), void *arg);
/*
 * Take the state after tsd_ps_quiesce said 0 (or called back). final: tensord is stopping and
 * frees the state right after, so the arrays are handed over rather than copied. Returns the
 * capture (NULL when there is no state: *rc 0) which the caller frees with
 * tsd_ps_snapshot_free; or NULL with *rc TS_ENOMEM. Either way jobs may start again once its
 * copies are done.
 */
tsd_ps_snap *tsd_ps_snapshot_take(tsd_server *srv, int final, int *rc);
/*
 * Writer thread: wait until every copy of snap is done, then hand out the state in the file's
 * terms (valid until tsd_ps_snapshot_free). 0, or TS_ENOMEM when a copy found no memory.
 */
int tsd_ps_snapshot_wait(tsd_ps_snap *snap, const tsd_snapfile_ps **out);
/* Writer thread, after tsd_ps_snapshot_wait and the write: free the copies there, not on the loop.
 */
void tsd_ps_snapshot_written(tsd_ps_snap *snap);
/* Drop the snapshot's hold on snap (loop thread); NULL is fine. */
void tsd_ps_snapshot_free(tsd_ps_snap *snap);

/*
 * Loading a snapshot at start, before the loop runs: snapfile.c's reader hands each parameter,
 * table and array (the sink's param, emb and ps_array); once the bins are in the store,
 * tsd_ps_restore_finish attaches the parameters to their bins and rebuilds the tables' id hashes,
 * charging everything to --max-memory. A failure leaves a message "snapshot PATH ..." in err;
 * the caller then frees everything with tsd_ps_free. Added in 0.6.0.
 */
int tsd_ps_restore_param(tsd_server *srv, const char *path, const tsd_snapfile_param *p, char *err,
                         size_t err_cap);
int tsd_ps_restore_emb(tsd_server *srv, const char *path, const tsd_snapfile_emb *t, char *err,
                       size_t err_cap);
void *tsd_ps_restore_array(tsd_server *srv, size_t len);
/* 0, or -1 (damaged: a missing bin, another numel or version, an id twice; or out of memory). */
int tsd_ps_restore_finish(tsd_server *srv, const char *path, size_t *n_params, size_t *n_embs,
                          char *err, size_t err_cap);

#endif /* TSD_PS_H */
