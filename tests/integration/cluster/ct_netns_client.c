/*
 * The client side of netns_test.sh: a cluster client in its own network namespace, talking to
 * three shards that each live in a namespace of their own (hosts, as far as TCP can tell).
 *
 *   ct_netns_client LIST VICTIM PARTITION_CMD HEAL_CMD
 *
 * LIST is "A0,A1,A2" (shard order, the default split). The program checks that bins land on
 * their owners, then runs PARTITION_CMD (the script takes one shard's link down: a partition,
 * not a crash) and keeps two threads busy for PARTITION_MS: one on the cut-off shard's bins,
 * one on the other shards' bins. It records what every call returned and how long it took,
 * runs HEAL_CMD, measures how long the cut-off shard takes to answer again, and checks routing
 * once more. Lines starting "netns:" are the record; exit status 0 when every check held, 1
 * otherwise (each failed check printed as "FAIL: ..."). Every loop is bounded in count and time.
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ct_cluster.h"
#include "tensorshare/tensorshare.h"

#define NS_SHARDS 3
/* bins per shard that the load touches */
#define NS_BINS 8
/* ms; the cluster client's request timeout: a call to the cut-off shard ends by then */
#define NS_REQ_TIMEOUT_MS 1000
/* ms; slack on top of the request timeout for a loaded machine (sanitizers, two cores) */
#define NS_SLACK_MS 2000
/* ms; how long the partition lasts while the load runs */
#define NS_PARTITION_MS 4000
/* ms; the longest the cut-off shard may take to answer again once the link is back */
#define NS_RECOVER_MS 20000
/* ms; a pause between calls of one load thread, so the load is bounded on two cores */
#define NS_PAUSE_MS 5
/* calls; the most one load thread makes in one phase, whatever the clock says */
#define NS_MAX_CALLS 20000
/* ms; the longest a hook command (ip link set ...) may run */
#define NS_HOOK_MS 10000

static int g_failures;
static char g_names[NS_SHARDS][NS_BINS][64];

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            printf("FAIL: " __VA_ARGS__);                                                          \
            printf("\n");                                                                          \
            g_failures++;                                                                          \
        }                                                                                          \
    } while (0)

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Run a shell command, bounded: killed (by its PID) after NS_HOOK_MS. 0 when it exited 0. */
static int run_hook(const char *cmd)
{
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    uint64_t t0 = now_ms();
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid)
            return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
        if (now_ms() - t0 > NS_HOOK_MS) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
            return -1;
        }
        sleep_ms(10);
    }
}

/* Events one listener saw, in order (the first NS_MAX_EVENTS). */
#define NS_MAX_EVENTS 64
typedef struct ns_listener {
    pthread_mutex_t mu;
    int events[NS_MAX_EVENTS];
    uint64_t versions[NS_MAX_EVENTS];
    int n;
    int final_status; /* 1 until the final call */
} ns_listener;

static void on_notify(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    ns_listener *l = arg;
    pthread_mutex_lock(&l->mu);
    if (status < 0) {
        l->final_status = status;
    } else if (l->n < NS_MAX_EVENTS) {
        l->events[l->n] = (int)n->event;
        l->versions[l->n] = n->version;
        l->n++;
    }
    pthread_mutex_unlock(&l->mu);
}

/* 1 when the listener saw event ev at index >= from; *at gets the index. */
static int saw_event(ns_listener *l, int from, int ev, int *at)
{
    int found = 0;
    pthread_mutex_lock(&l->mu);
    for (int k = from; k < l->n && !found; k++)
        if (l->events[k] == ev) {
            found = 1;
            if (at != NULL)
                *at = k;
        }
    pthread_mutex_unlock(&l->mu);
    return found;
}

static void print_events(ns_listener *l, int shard)
{
    char buf[512];
    size_t off = 0;
    buf[0] = '\0';
    pthread_mutex_lock(&l->mu);
    for (int k = 0; k < l->n && off < sizeof(buf) - 16; k++)
        off +=
            (size_t)snprintf(buf + off, sizeof(buf) - off, "%s%d", k > 0 ? " " : "", l->events[k]);
    pthread_mutex_unlock(&l->mu);
    printf("netns: listener on shard %d saw events [%s] (100 DISCONNECTED, 101 RESUBSCRIBED)\n",
           shard, buf);
}

/* One call on bin (put of an int, or peek), counted for its shard. */
static int one_call(ts_client_t *c, ct_tally *t, int shard, int b, int k)
{
    uint64_t t0 = now_ms();
    int rc;
    if (k % 2 == 0) {
        ts_value_t *v = ts_int_new(k);
        rc = ts_put(c, g_names[shard][b], v, NULL);
        ts_value_free(v);
    } else {
        ts_items_t *items = NULL;
        rc = ts_peek(c, g_names[shard][b], 0, &items);
        ts_items_free(items);
    }
    ct_tally_add(t, shard, rc, now_ms() - t0);
    return rc;
}

typedef struct ns_load {
    ts_client_t *c;
    ct_tally *t;
    int victim;
    int on_victim; /* 1: this thread calls the victim's bins; 0: the others' */
    uint64_t until;
} ns_load;

static void *load_thread(void *arg)
{
    ns_load *ld = arg;
    for (int k = 0; k < NS_MAX_CALLS && now_ms() < ld->until; k++) {
        int shard = ld->on_victim ? ld->victim : (ld->victim + 1 + k % (NS_SHARDS - 1)) % NS_SHARDS;
        one_call(ld->c, ld->t, shard, k % NS_BINS, k);
        sleep_ms(NS_PAUSE_MS);
    }
    return NULL;
}

/* Every bin each shard lists is one it owns, and every test bin is listed by its owner. */
static void check_routing(ts_client_t *plain[NS_SHARDS], const char *when)
{
    int found[NS_SHARDS][NS_BINS] = {{0}};
    for (int s = 0; s < NS_SHARDS; s++) {
        ts_bin_list_t *list = NULL;
        int rc = ts_list(plain[s], &list);
        CHECK(rc == 0, "%s: LIST on shard %d: %s (%s)", when, s, ts_err_name(rc), ts_last_error());
        if (rc != 0)
            continue;
        for (size_t i = 0; i < list->count; i++) {
            const char *name = list->bins[i].name;
            int owner = ct_default_owner(ct_slot(name), NS_SHARDS);
            CHECK(owner == s, "%s: bin %s is on shard %d but shard %d owns it", when, name, s,
                  owner);
            for (int b = 0; b < NS_BINS; b++)
                if (strcmp(name, g_names[s][b]) == 0)
                    found[s][b] = 1;
        }
        ts_bin_list_free(list);
    }
    for (int s = 0; s < NS_SHARDS; s++)
        for (int b = 0; b < NS_BINS; b++)
            CHECK(found[s][b], "%s: bin %s missing from its owner, shard %d", when, g_names[s][b],
                  s);
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s A0,A1,A2 VICTIM PARTITION_CMD HEAL_CMD\n", argv[0]);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *list = argv[1];
    int victim = (int)strtol(argv[2], NULL, 10);
    if (victim < 0 || victim >= NS_SHARDS) {
        fprintf(stderr, "bad victim %s\n", argv[2]);
        return 2;
    }
    char addrs[NS_SHARDS][128];
    {
        const char *p = list;
        for (int s = 0; s < NS_SHARDS; s++) {
            const char *comma = strchr(p, ',');
            size_t len = comma != NULL ? (size_t)(comma - p) : strlen(p);
            if (len == 0 || len >= sizeof(addrs[s]) || (s < NS_SHARDS - 1 && comma == NULL)) {
                fprintf(stderr, "bad list %s\n", list);
                return 2;
            }
            memcpy(addrs[s], p, len);
            addrs[s][len] = '\0';
            p = comma != NULL ? comma + 1 : p + len;
        }
    }
    for (int s = 0; s < NS_SHARDS; s++)
        for (int b = 0; b < NS_BINS; b++)
            if (ct_name_for_shard(g_names[s][b], sizeof(g_names[s][b]), "net", b, s, NS_SHARDS) !=
                0)
                return 2;

    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = NS_REQ_TIMEOUT_MS;
    o.request_timeout_ms = NS_REQ_TIMEOUT_MS;
    o.reconnect_max_ms = 500;
    ts_client_t *c = NULL;
    uint64_t t0 = now_ms();
    int rc = ts_client_open(&c, list, &o);
    printf("netns: cluster open of %s: %s in %llu ms\n", list, ts_err_name(rc),
           (unsigned long long)(now_ms() - t0));
    if (rc != 0) {
        printf("FAIL: cluster open: %s\n", ts_last_error());
        return 1;
    }
    ts_client_t *plain[NS_SHARDS] = {NULL};
    for (int s = 0; s < NS_SHARDS; s++) {
        rc = ts_client_open(&plain[s], addrs[s], &o);
        if (rc != 0) {
            printf("FAIL: plain open of shard %d (%s): %s\n", s, addrs[s], ts_last_error());
            return 1;
        }
    }

    /* Routing: every bin put through the cluster client is on its owner, and only there. */
    for (int s = 0; s < NS_SHARDS; s++)
        for (int b = 0; b < NS_BINS; b++) {
            ts_value_t *v = ts_int_new(b);
            rc = ts_put(c, g_names[s][b], v, NULL);
            ts_value_free(v);
            CHECK(rc == 0, "put %s: %s (%s)", g_names[s][b], ts_err_name(rc), ts_last_error());
        }
    check_routing(plain, "before the partition");

    ns_listener lis[NS_SHARDS];
    for (int s = 0; s < NS_SHARDS; s++) {
        memset(&lis[s], 0, sizeof(lis[s]));
        pthread_mutex_init(&lis[s].mu, NULL);
        lis[s].final_status = 1;
        rc = ts_listen(c, g_names[s][0], on_notify, &lis[s]);
        CHECK(rc == 0, "listen on %s: %s", g_names[s][0], ts_err_name(rc));
    }

    /* The partition: two load threads, one on the cut-off shard, one on the others. */
    CHECK(run_hook(argv[3]) == 0, "partition command failed: %s", argv[3]);
    printf("netns: shard %d cut off (%s)\n", victim, argv[3]);
    ct_tally part;
    ct_tally_init(&part);
    ns_load loads[2] = {
        {c, &part, victim, 1, now_ms() + NS_PARTITION_MS},
        {c, &part, victim, 0, now_ms() + NS_PARTITION_MS},
    };
    pthread_t th[2];
    for (int k = 0; k < 2; k++)
        pthread_create(&th[k], NULL, load_thread, &loads[k]);
    for (int k = 0; k < 2; k++)
        pthread_join(th[k], NULL);
    ct_tally_print(&part, "netns: partition:", NS_SHARDS);
    for (int s = 0; s < NS_SHARDS; s++) {
        if (s == victim)
            continue;
        CHECK(part.failed[s] == 0 && part.ok[s] > 0,
              "shard %d (reachable) during the partition: %ld ok, %ld failed", s, part.ok[s],
              part.failed[s]);
    }
    CHECK(part.failed[victim] > 0, "the cut-off shard %d failed no call", victim);
    CHECK(part.max_fail_ms[victim] <= NS_REQ_TIMEOUT_MS + NS_SLACK_MS,
          "a call to the cut-off shard took %llu ms (request timeout %d ms)",
          (unsigned long long)part.max_fail_ms[victim], NS_REQ_TIMEOUT_MS);
    /* A routing check through the other shards' plain clients: nothing moved to them. */
    for (int s = 0; s < NS_SHARDS; s++) {
        if (s == victim)
            continue;
        ts_bin_list_t *bl = NULL;
        if (ts_list(plain[s], &bl) == 0) {
            for (size_t i = 0; i < bl->count; i++)
                CHECK(ct_default_owner(ct_slot(bl->bins[i].name), NS_SHARDS) == s,
                      "during the partition bin %s landed on shard %d", bl->bins[i].name, s);
            ts_bin_list_free(bl);
        }
    }

    /* The link comes back: how long until the cut-off shard's bins answer again. */
    CHECK(run_hook(argv[4]) == 0, "heal command failed: %s", argv[4]);
    uint64_t healed = now_ms();
    int back = 0;
    ct_tally rec;
    ct_tally_init(&rec);
    for (int k = 0; k < NS_MAX_CALLS && now_ms() - healed < NS_RECOVER_MS; k++) {
        if (one_call(c, &rec, victim, 0, 1) == 0) {
            back = 1;
            break;
        }
        sleep_ms(50);
    }
    uint64_t recover_ms = now_ms() - healed;
    ct_tally_print(&rec, "netns: after the link came back:", NS_SHARDS);
    printf("netns: shard %d answered again %llu ms after the link came back (%s)\n", victim,
           (unsigned long long)recover_ms, back ? "ok" : "never");
    CHECK(back, "the cut-off shard did not answer within %d ms of the link coming back",
          NS_RECOVER_MS);

    /* Everything works again, and the victim's listener hears a new change. */
    ct_tally after;
    ct_tally_init(&after);
    for (int s = 0; s < NS_SHARDS; s++)
        for (int b = 0; b < NS_BINS; b++)
            one_call(c, &after, s, b, 0);
    ct_tally_print(&after, "netns: healed:", NS_SHARDS);
    for (int s = 0; s < NS_SHARDS; s++)
        CHECK(after.failed[s] == 0, "shard %d after healing: %ld calls failed", s, after.failed[s]);
    int mark;
    pthread_mutex_lock(&lis[victim].mu);
    mark = lis[victim].n;
    pthread_mutex_unlock(&lis[victim].mu);
    ts_value_t *v = ts_int_new(7);
    rc = ts_put(c, g_names[victim][0], v, NULL);
    ts_value_free(v);
    CHECK(rc == 0, "put on the healed shard: %s", ts_err_name(rc));
    int heard = 0;
    for (int k = 0; k < 200 && !heard; k++) {
        heard = saw_event(&lis[victim], mark, TS_EV_PUT, NULL);
        if (!heard)
            sleep_ms(50);
    }
    CHECK(heard, "the healed shard's listener heard no PUT within 10 s");
    for (int s = 0; s < NS_SHARDS; s++)
        print_events(&lis[s], s);
    check_routing(plain, "after healing");

    for (int s = 0; s < NS_SHARDS; s++)
        ts_client_free(plain[s]);
    ts_client_free(c);
    for (int s = 0; s < NS_SHARDS; s++)
        pthread_mutex_destroy(&lis[s].mu);
    ct_tally_destroy(&part);
    ct_tally_destroy(&rec);
    ct_tally_destroy(&after);
    printf("netns: %s (%d failed checks)\n", g_failures == 0 ? "PASS" : "FAIL", g_failures);
    return g_failures == 0 ? 0 : 1;
}
