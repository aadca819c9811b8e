/*
 * Test support for sharded clusters: N real tensord processes on 127.0.0.1 (ephemeral ports),
 * shard i started with "--shard i/N", each stopped, killed and restarted by its PID; the address
 * list a cluster client opens, and map files. Every wait is bounded (the harness's bounds).
 */
#ifndef TS_TEST_CLUSTER_H
#define TS_TEST_CLUSTER_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"

/* shards; the most one test cluster holds (a daemon each, on two shared cores) */
#define TSC_MAX_SHARDS 8
/* bytes; "127.0.0.1:65535," per shard and a NUL */
#define TSC_LIST_MAX (TSC_MAX_SHARDS * 17 + 1)

typedef struct tsc_cluster {
    int n;                          /* shards */
    tsh_server srv[TSC_MAX_SHARDS]; /* srv[i].pid is 0 while shard i is not running */
    char list[TSC_LIST_MAX];        /* "127.0.0.1:P0,127.0.0.1:P1,..." in shard order */
} tsc_cluster;

/*
 * Start n shards (1..TSC_MAX_SHARDS): shard i runs "--shard i/n --log-level warn" plus extra
 * (NULL-terminated, may be NULL). 0, or -1 with whatever was started stopped again.
 */
int tsc_start(tsc_cluster *cl, int n, const char *const *extra);
/* SIGKILL shard i and reap it (its folder stays, so it can restart on the same port). */
void tsc_kill(tsc_cluster *cl, int i);
/* Start shard i again on its old port with "--shard i/n" and extra. 0 or -1. */
int tsc_restart(tsc_cluster *cl, int i, const char *const *extra);
/* Stop every running shard by PID (SIGTERM, bounded) and remove the folders. */
void tsc_stop(tsc_cluster *cl);
/*
 * The address list with the shards in the order order[0..n-1] (NULL: 0..n-1) into out (capacity
 * cap). 0 or -1.
 */
int tsc_list(const tsc_cluster *cl, const int *order, char *out, size_t cap);
/*
 * Write a map file at path: "epoch E" (when epoch > 0), then one line per shard with the address
 * of shard order[k] (order NULL: 0..n-1), without ranges (the default split). 0 or -1.
 */
int tsc_write_map(const tsc_cluster *cl, const char *path, uint64_t epoch, const int *order);
/* The shard of n that owns name under the default split (hash tags as the protocol says). */
int tsc_owner(const char *name, int n);
/*
 * Write into out (capacity cap) a name "PREFIX.k.j" (j the smallest that fits) that the default
 * split of n shards gives to shard. 0, or -1 when no j below 100000 fits.
 */
int tsc_name_for(char *out, size_t cap, const char *prefix, int k, int shard, int n);

#endif /* TS_TEST_CLUSTER_H */
