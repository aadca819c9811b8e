/* Helpers of the cluster failure tests (ct_cluster.h). */
#include "ct_cluster.h"

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensorshare/tensorshare.h"

uint16_t ct_slot(const char *name)
{
    size_t len = strlen(name);
    const char *key = name;
    size_t klen = len;
    const char *open = memchr(name, '{', len);
    if (open != NULL) {
        const char *close = memchr(open + 1, '}', len - (size_t)(open + 1 - name));
        if (close != NULL && close > open + 1) {
            key = open + 1;
            klen = (size_t)(close - key);
        }
    }
    /* CRC-16/XMODEM bit by bit: polynomial 0x1021, initial value 0, no reflection. */
    uint16_t crc = 0;
    for (size_t i = 0; i < klen; i++) {
        crc ^= (uint16_t)((uint16_t)(unsigned char)key[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (crc & 0x8000u) != 0 ? (uint16_t)((crc << 1) ^ 0x1021u) : (uint16_t)(crc << 1);
    }
    return (uint16_t)(crc % CT_SLOTS);
}

int ct_default_owner(uint16_t slot, int n)
{
    /* Shard i owns [floor(i * 16384 / n), floor((i + 1) * 16384 / n) - 1]. */
    for (int i = 0; i < n; i++)
        if ((long)slot < (long)(i + 1) * CT_SLOTS / n)
            return i;
    return n - 1;
}

/* names; how far ct_name_for_shard searches (a shard of 3 takes a third of all names). */
#define CT_NAME_SEARCH 100000

int ct_name_for_shard(char *out, size_t cap, const char *prefix, int k, int shard, int n)
{
    for (int j = 0; j < CT_NAME_SEARCH; j++) {
        snprintf(out, cap, "%s.%d.%d", prefix, k, j);
        if (ct_default_owner(ct_slot(out), n) == shard)
            return 0;
    }
    return -1;
}

void ct_cluster_path(const ct_cluster *cl, char *out, size_t cap, const char *file)
{
    snprintf(out, cap, "%s/%s", cl->dir, file);
}

/* The arguments of shard i: --shard, --log-level, --save when asked, then extra. */
static int shard_spawn(ct_cluster *cl, int i, const char *shard_arg, const char *const *extra,
                       int restart)
{
    char snap[320];
    char name[32];
    snprintf(name, sizeof(name), "snap-%d.tsd", i);
    ct_cluster_path(cl, snap, sizeof(snap), name);
    const char *argv[40];
    int n = 0;
    argv[n++] = "--shard";
    argv[n++] = shard_arg;
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    if (cl->save[i]) {
        argv[n++] = "--save";
        argv[n++] = snap;
        /* Snapshots only on SAVE and shutdown, so a test knows what a SIGKILL loses. */
        argv[n++] = "--save-interval";
        argv[n++] = "0";
    }
    for (int k = 0; extra != NULL && extra[k] != NULL && n < 38; k++)
        argv[n++] = extra[k];
    argv[n] = NULL;
    cl->stopped[i] = 0;
    if (restart)
        return tsh_server_restart(&cl->srv[i], argv);
    return tsh_server_start(&cl->srv[i], argv);
}

static void build_list(ct_cluster *cl)
{
    size_t off = 0;
    cl->list[0] = '\0';
    for (int i = 0; i < cl->n; i++)
        off += (size_t)snprintf(cl->list + off, sizeof(cl->list) - off, "%s%s", i > 0 ? "," : "",
                                cl->srv[i].addr);
}

int ct_cluster_start(ct_cluster *cl, int n, unsigned save_mask)
{
    memset(cl, 0, sizeof(*cl));
    if (n < 1 || n > CT_MAX_SHARDS)
        return -1;
    cl->n = n;
    const char *tmp = getenv("TMPDIR");
    snprintf(cl->dir, sizeof(cl->dir), "%s/tsct.XXXXXX", tmp != NULL ? tmp : "/tmp");
    if (mkdtemp(cl->dir) == NULL)
        return -1;
    for (int i = 0; i < n; i++) {
        cl->save[i] = (save_mask >> i) & 1u;
        char arg[16];
        snprintf(arg, sizeof(arg), "%d/%d", i, n);
        if (shard_spawn(cl, i, arg, NULL, 0) != 0) {
            fprintf(stderr, "ct: shard %d did not start\n", i);
            ct_cluster_free(cl);
            return -1;
        }
    }
    build_list(cl);
    return 0;
}

int ct_shard_restart(ct_cluster *cl, int i, const char *shard_arg, const char *const *extra)
{
    if (i < 0 || i >= cl->n || cl->srv[i].pid > 0)
        return -1;
    return shard_spawn(cl, i, shard_arg, extra, 1);
}

void ct_shard_kill(ct_cluster *cl, int i)
{
    if (cl->stopped[i])
        ct_shard_thaw(cl, i);
    tsh_server_kill(&cl->srv[i]);
}

int ct_shard_stop(ct_cluster *cl, int i)
{
    if (cl->stopped[i])
        ct_shard_thaw(cl, i);
    return tsh_server_stop(&cl->srv[i]);
}

void ct_shard_freeze(ct_cluster *cl, int i)
{
    if (cl->srv[i].pid > 0 && kill(cl->srv[i].pid, SIGSTOP) == 0)
        cl->stopped[i] = 1;
}

void ct_shard_thaw(ct_cluster *cl, int i)
{
    if (cl->srv[i].pid > 0)
        kill(cl->srv[i].pid, SIGCONT);
    cl->stopped[i] = 0;
}

/* Remove every file of the cluster's own folder (snapshots, locks, map files), then the folder. */
static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d != NULL) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            char path[600];
            snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
            unlink(path);
        }
        closedir(d);
    }
    rmdir(dir);
}

void ct_cluster_free(ct_cluster *cl)
{
    for (int i = 0; i < cl->n; i++) {
        if (cl->srv[i].pid > 0)
            ct_shard_stop(cl, i);
        if (cl->srv[i].dir[0] != '\0')
            tsh_server_cleanup(&cl->srv[i]);
    }
    if (cl->dir[0] != '\0')
        remove_dir(cl->dir);
    cl->dir[0] = '\0';
    cl->n = 0;
}

int ct_write_map(const ct_cluster *cl, const char *path, uint64_t epoch, const int *order)
{
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return -1;
    fprintf(f, "# written by the cluster failure tests\nepoch %llu\n", (unsigned long long)epoch);
    for (int k = 0; k < cl->n; k++)
        fprintf(f, "%s\n", cl->srv[order != NULL ? order[k] : k].addr);
    return fclose(f) == 0 ? 0 : -1;
}

void ct_tally_init(ct_tally *t)
{
    memset(t, 0, sizeof(*t));
    pthread_mutex_init(&t->mu, NULL);
}

void ct_tally_destroy(ct_tally *t)
{
    pthread_mutex_destroy(&t->mu);
}

void ct_tally_add(ct_tally *t, int shard, int rc, uint64_t ms)
{
    if (shard < 0 || shard >= CT_MAX_SHARDS)
        return;
    pthread_mutex_lock(&t->mu);
    if (rc == 0) {
        t->ok[shard]++;
        if (ms > t->max_ok_ms[shard])
            t->max_ok_ms[shard] = ms;
    } else {
        t->failed[shard]++;
        if (ms > t->max_fail_ms[shard])
            t->max_fail_ms[shard] = ms;
        for (int k = 0; k < CT_MAX_CODES; k++) {
            if (t->code_count[shard][k] == 0 || t->codes[shard][k] == rc) {
                t->codes[shard][k] = rc;
                t->code_count[shard][k]++;
                break;
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
}

long ct_tally_code(ct_tally *t, int shard, int code)
{
    long n = 0;
    pthread_mutex_lock(&t->mu);
    for (int k = 0; k < CT_MAX_CODES; k++)
        if (t->code_count[shard][k] > 0 && t->codes[shard][k] == code)
            n = t->code_count[shard][k];
    pthread_mutex_unlock(&t->mu);
    return n;
}

void ct_tally_print(ct_tally *t, const char *label, int n)
{
    pthread_mutex_lock(&t->mu);
    for (int s = 0; s < n; s++) {
        char codes[256];
        size_t off = 0;
        codes[0] = '\0';
        for (int k = 0; k < CT_MAX_CODES && t->code_count[s][k] > 0; k++)
            off += (size_t)snprintf(codes + off, sizeof(codes) - off, "%s%s %ld", k > 0 ? ", " : "",
                                    ts_err_name(t->codes[s][k]), t->code_count[s][k]);
        printf("%s shard %d: ok %ld (slowest %llu ms), failed %ld (%s; slowest %llu ms)\n", label,
               s, t->ok[s], (unsigned long long)t->max_ok_ms[s], t->failed[s], codes,
               (unsigned long long)t->max_fail_ms[s]);
    }
    pthread_mutex_unlock(&t->mu);
}
