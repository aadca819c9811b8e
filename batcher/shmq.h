/*
 * Same-host slots (shmq.c): the serving side (ts_batcher_serve_shm, through serve.c) and the
 * requesting side (a predictor's slot, through predictor.c). Not installed.
 */
#ifndef TS_BATCHER_SHMQ_H
#define TS_BATCHER_SHMQ_H

#include "batcher_internal.h"

/* ---------------------------------------------------------------------------------------------
 * The serving side
 */
typedef struct shm_server shm_server;

/*
 * Create the region, start the slot thread and put the descriptor into NAME/shm. 0 and *out, or
 * a TS_E* code with the reason set.
 */
int ts__shm_serve_start(ts_batcher_t *b, ts_client_t *client, const char *name,
                        const ts_batcher_shm_options_t *opts, shm_server **out);
/*
 * Close the slots (no request taken from now on; waiting requesters are woken), stop the slot
 * thread, delete the descriptor and the object's name, and drop the server's reference: the
 * mapping goes when the last request still in the batcher has been answered.
 */
void ts__shm_serve_stop(shm_server *s);

/* ---------------------------------------------------------------------------------------------
 * The requesting side
 */
typedef struct shm_client shm_client;

/*
 * Look NAME/shm up through client and map the region when it is on this host. 0 and *out;
 * TS_ENOENT when no server advertises slots, or they are not reachable from here (another
 * host, another /dev/shm, a stale record); another TS_E* on failure. Reason set.
 */
int ts__shm_attach(ts_client_t *client, const char *name, shm_client **out);
/*
 * Take a free slot (or one whose owner died), on the thread that will hold it until
 * ts__shm_release: the slot's owner lock is a robust process-shared mutex, so the thread must
 * live as long as the claim. 0, or TS_EAGAIN when every slot is held. *reclaimed tells whether
 * its previous owner had died.
 */
int ts__shm_claim(shm_client *c, int *reclaimed);
/* Give the slot back (same thread as the claim). */
void ts__shm_release(shm_client *c);
/* Unmap. */
void ts__shm_detach(shm_client *c);

/*
 * One blocking request through the claimed slot (one caller at a time). Returns the answer's
 * status (0: *output is the caller's, *version set). *sent is 0 when nothing reached the server
 * (then the caller may call the service): TS_EMSGSIZE (the input does not fit the request area),
 * TS_ENOTSUP (an input the slots cannot carry: lists, strings, bytes), TS_ECONNRESET (the
 * server is closed or gone). With *sent 1: TS_ETIMEDOUT at the deadline, TS_ECONNRESET when the
 * server died while the request was in the slot, or the server's answer.
 */
int ts__shm_predict(shm_client *c, const ts_value_t *input, int timeout_ms, ts_value_t **output,
                    int64_t *version, int *sent);
/* Nonzero once the server closed its slots or died: the predictor calls the service from then. */
int ts__shm_gone(shm_client *c);

#endif /* TS_BATCHER_SHMQ_H */
