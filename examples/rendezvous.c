/*
 * rendezvous: N processes agree on ranks and exchange addresses through tensord, as a
 * distributed job does before it starts (what torch.distributed's TCPStore rendezvous does).
 * Each process takes a rank with ADD on a counter, publishes its address in a bin of its rank,
 * waits at a BARRIER for the others, reads every address with one MGET, and meets at the
 * barrier again before it leaves. Rank 0 prints the table.
 *
 *   tensord --port 8000 &
 *   for i in 0 1 2 3; do ./rendezvous 127.0.0.1:8000 4 job1 & done; wait
 *
 * Arguments: the server, the world size (1 to TS_MGET_MAX), and a job name (distinct per run:
 * the rank counter lives in the bin <job>/rank). Exits 0 when every step worked. Build outside
 * the tree with: cc rendezvous.c $(pkg-config --cflags --libs tensorshare) -o rendezvous
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <tensorshare/coord.h>
#include <tensorshare/tensorshare.h>

/* ms; how long a process waits for the others at the barrier */
#define RDZV_TIMEOUT_MS 30000
/* bytes; room for a bin name "<job>/addr/<rank>" and an address */
#define RDZV_NAME_CAP 256

static int fail(const char *what, int rc)
{
    fprintf(stderr, "rendezvous: %s: %s (%s)\n", what, ts_strerror(rc), ts_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: rendezvous HOST:PORT WORLD_SIZE JOB\n");
        return 2;
    }
    const char *addr = argv[1], *job = argv[3];
    long world = strtol(argv[2], NULL, 10);
    if (world < 1 || world > TS_MGET_MAX || strlen(job) > 200) {
        fprintf(stderr, "rendezvous: WORLD_SIZE must be 1 to %d, JOB at most 200 bytes\n",
                TS_MGET_MAX);
        return 2;
    }
    ts_client_t *c;
    int rc = ts_client_open(&c, addr, NULL);
    if (rc != 0)
        return fail("connect", rc);

    /* 1. A rank: the counter's value after our ADD, minus one, is ours alone. */
    char name[RDZV_NAME_CAP], barrier[RDZV_NAME_CAP];
    snprintf(name, sizeof(name), "%s/rank", job);
    snprintf(barrier, sizeof(barrier), "%s/barrier", job);
    int64_t value;
    if ((rc = ts_add(c, name, 1, &value, NULL)) != 0)
        return fail("ADD", rc);
    long rank = (long)value - 1;
    if (rank >= world) {
        fprintf(stderr, "rendezvous: rank %ld: more than %ld processes joined\n", rank, world);
        return 1;
    }

    /* 2. Our address, in the bin of our rank. */
    char host[64], me[128];
    if (gethostname(host, sizeof(host)) != 0)
        snprintf(host, sizeof(host), "localhost");
    host[sizeof(host) - 1] = '\0';
    int n = snprintf(me, sizeof(me), "%s pid %ld", host, (long)getpid());
    snprintf(name, sizeof(name), "%s/addr/%ld", job, rank);
    ts_value_t *v = ts_string_new(me, (size_t)n);
    rc = v != NULL ? ts_put(c, name, v, NULL) : TS_ENOMEM;
    ts_value_free(v);
    if (rc != 0)
        return fail("PUT", rc);

    /* 3. Everybody has published once everybody has arrived. */
    uint64_t gen;
    if ((rc = ts_barrier(c, barrier, (uint32_t)world, RDZV_TIMEOUT_MS, &gen)) != 0)
        return fail("BARRIER", rc);

    /* 4. The whole table in one round trip. */
    static char names[TS_MGET_MAX][RDZV_NAME_CAP];
    const char *ptrs[TS_MGET_MAX];
    ts_items_t *out[TS_MGET_MAX];
    for (long r = 0; r < world; r++) {
        snprintf(names[r], sizeof(names[r]), "%s/addr/%ld", job, r);
        ptrs[r] = names[r];
    }
    if ((rc = ts_mget(c, ptrs, (size_t)world, 1, out)) != 0)
        return fail("MGET", rc);
    int missing = 0;
    for (long r = 0; r < world; r++) {
        const char *s = NULL;
        size_t len = 0;
        if (out[r] == NULL || ts_value_string(ts_items_at(out[r], 0), &s, &len) != 0) {
            missing++;
            continue;
        }
        if (rank == 0)
            printf("rank %ld: %.*s\n", r, (int)len, s);
        ts_items_free(out[r]);
    }
    if (missing > 0) {
        fprintf(stderr, "rendezvous: %d addresses missing after the barrier\n", missing);
        return 1;
    }

    /* 5. Nobody leaves before everybody has read the table (generation gen + 1). */
    uint64_t gen2;
    if ((rc = ts_barrier(c, barrier, (uint32_t)world, RDZV_TIMEOUT_MS, &gen2)) != 0)
        return fail("BARRIER", rc);
    if (rank == 0)
        printf("rendezvous: %ld processes, barrier generations %llu and %llu\n", world,
               (unsigned long long)gen, (unsigned long long)gen2);
    ts_client_free(c);
    return gen2 == gen + 1 ? 0 : 1;
}
