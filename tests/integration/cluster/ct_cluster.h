/*
 * Helpers of the cluster failure tests: three (or N) sharded tensord processes on 127.0.0.1
 * (ephemeral ports), each stopped, killed, frozen, thawed and restarted by its PID; map files;
 * bin names chosen per shard; per-shard tallies of what clients saw. Every wait is bounded.
 *
 * The slot function here is a second, independent implementation of docs/PROTOCOL.md section 14
 * (CRC-16/XMODEM of the hash key, mod 16384): the tests decide which shard must hold a bin from
 * the document, not from the code under test.
 */
#ifndef TS_CT_CLUSTER_H
#define TS_CT_CLUSTER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "harness.h"

/* shards; the most a test starts (the tests use 3). */
#define CT_MAX_SHARDS 4
/* slots; docs/PROTOCOL.md section 14. */
#define CT_SLOTS 16384

/* The slot of a bin name (hash tags as the protocol says). */
uint16_t ct_slot(const char *name);
/* The shard that owns slot under the default split of n shards. */
int ct_default_owner(uint16_t slot, int n);
/*
 * Write into out (capacity cap) the k-th name "PREFIX.k.j" (j the smallest that fits) whose
 * slot the default split of n gives to shard. 0, or -1 when no j below 100000 fits.
 */
int ct_name_for_shard(char *out, size_t cap, const char *prefix, int k, int shard, int n);

typedef struct ct_cluster {
    int n;                             /* shards */
    char dir[256];                     /* private temporary folder: snapshots, map files */
    tsh_server srv[CT_MAX_SHARDS];     /* srv[i].pid 0 while shard i is not running */
    int save[CT_MAX_SHARDS];           /* 1: shard i runs with --save dir/snap-i.tsd */
    int stopped[CT_MAX_SHARDS];        /* 1 while shard i is SIGSTOPped */
    char list[CT_MAX_SHARDS * 32 + 8]; /* "127.0.0.1:P0,127.0.0.1:P1,..." in shard order */
} ct_cluster;

/*
 * Start n shards, shard i with "--shard i/n" (and --save into the cluster's folder when
 * save_mask has bit i), --log-level warn. 0, or -1 with everything started stopped again.
 */
int ct_cluster_start(ct_cluster *cl, int n, unsigned save_mask);
/*
 * Restart shard i on its old port with "--shard SHARD_ARG" (e.g. "1/3", or "2/3" for a
 * misconfigured one) plus extra (NULL-terminated, may be NULL), and its --save as at start.
 * The shard must not be running. 0 or -1.
 */
int ct_shard_restart(ct_cluster *cl, int i, const char *shard_arg, const char *const *extra);
/* SIGKILL shard i and reap it (its snapshot stays). */
void ct_shard_kill(ct_cluster *cl, int i);
/* SIGTERM shard i (a clean stop: it writes its snapshot), bounded wait. Exit status or -1. */
int ct_shard_stop(ct_cluster *cl, int i);
/* SIGSTOP / SIGCONT shard i (a hung process, not a dead one). */
void ct_shard_freeze(ct_cluster *cl, int i);
void ct_shard_thaw(ct_cluster *cl, int i);
/* Stop every running shard by PID (thawing frozen ones first) and remove the folders. */
void ct_cluster_free(ct_cluster *cl);
/* Path of a file in the cluster's folder. */
void ct_cluster_path(const ct_cluster *cl, char *out, size_t cap, const char *file);
/*
 * Write a map file: an "epoch" line, then one line per shard with the address of
 * cl->srv[order[k]] (order NULL: 0..n-1). 0 or -1.
 */
int ct_write_map(const ct_cluster *cl, const char *path, uint64_t epoch, const int *order);

/* Per-shard counts of what the calls routed to that shard returned. */
#define CT_MAX_CODES 8
typedef struct ct_tally {
    pthread_mutex_t mu;
    long ok[CT_MAX_SHARDS];
    long failed[CT_MAX_SHARDS];
    uint64_t max_fail_ms[CT_MAX_SHARDS]; /* the slowest failing call */
    uint64_t max_ok_ms[CT_MAX_SHARDS];   /* the slowest successful call */
    int codes[CT_MAX_SHARDS][CT_MAX_CODES];
    long code_count[CT_MAX_SHARDS][CT_MAX_CODES];
} ct_tally;

void ct_tally_init(ct_tally *t);
void ct_tally_destroy(ct_tally *t);
/* Count one call: rc 0 ok, else a failure with its code; ms the call's duration. Thread-safe. */
void ct_tally_add(ct_tally *t, int shard, int rc, uint64_t ms);
/* How many calls routed to shard failed with code. */
long ct_tally_code(ct_tally *t, int shard, int code);
/* Print one line per shard ("label shard 1: ok 120, failed 30 (ENOTCONN 30), slowest ..."). */
void ct_tally_print(ct_tally *t, const char *label, int n);

#endif /* TS_CT_CLUSTER_H */
