/*
 * tsinfer end to end: a real tensord, tsinfer serving the generated MLP on two CPU replicas,
 * remote predictors comparing its answers with a local forward, a trainer publishing new
 * weights into the parameters bin, then SIGTERM and a clean exit; with --shm, a predictor on the
 * same host reaches tsinfer through a shared-memory slot (its shm counter counts every
 * prediction) and gets the local forward's answers; --shm with a slot count out of range is a
 * usage error.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "harness.h"
#include "tensorshare/batcher.h"
#include "tensorshare/service.h"
#include "tensorshare/torch.h"

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static ts_value_t *rows_of(int64_t rows, int seed)
{
    int64_t shape[2] = {rows, 8};
    ts_value_t *v = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(v);
    float *d = ts_value_tensor(v)->data;
    for (int64_t i = 0; i < rows * 8; i++)
        d[i] = (float)cos(0.3 * (double)i + seed);
    return v;
}

static int close_enough(const ts_value_t *a, const ts_value_t *b, float factor)
{
    const ts_tensor_t *x = ts_value_tensor(a), *y = ts_value_tensor(b);
    if (x == NULL || y == NULL || x->ndim != 2 || y->ndim != 2 || x->shape[0] != y->shape[0] ||
        x->shape[1] != 4 || y->shape[1] != 4)
        return 0;
    for (int64_t i = 0; i < x->shape[0] * 4; i++) {
        float u = ((const float *)x->data)[i], v = ((const float *)y->data)[i] * factor;
        if (fabsf(u - v) > 1e-5f + 1e-4f * fabsf(v))
            return 0;
    }
    return 1;
}

/* Start tsinfer with args, its stdout and stderr going to log (when not NULL); returns its pid. */
static pid_t start_tsinfer(const char *const *args, const char *log)
{
    pid_t pid = fork();
    if (pid == 0) {
        int fd = log != NULL ? open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600) : -1;
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(args[0], (char *const *)args);
        _exit(127);
    }
    return pid;
}

/* SIGTERM and wait up to 20 s; returns the exit status, or -1 when it had to be killed. */
static int stop_tsinfer(pid_t pid)
{
    kill(pid, SIGTERM);
    for (int i = 0; i < 2000; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid)
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static const char *slurp(const char *path);

static void test_tsinfer(void **state)
{
    (void)state;
    const char *exe = getenv("TS_TSINFER");
    const char *dir = getenv("TS_MODELS_DIR");
    assert_non_null(exe);
    assert_non_null(dir);
    char model[600];
    snprintf(model, sizeof(model), "%s/mlp.pt", dir);

    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    const char *args[] = {exe,
                          "--server",
                          srv.addr,
                          "--model",
                          model,
                          "--name",
                          "policy",
                          "--input",
                          ":float32:8",
                          "--output",
                          ":float32:4",
                          "--max-batch",
                          "16",
                          "--max-delay-us",
                          "1000",
                          "--device",
                          "cpu:2",
                          "--params",
                          "policy/params",
                          "--timeout-ms",
                          "-1", /* no deadline for relayed requests that name none */
                          "--threads",
                          "1",
                          "--stats-s",
                          "1",
                          NULL};
    char log[600];
    snprintf(log, sizeof(log), "%s/tsinfer.log", srv.dir);
    pid_t pid = start_tsinfer(args, log);
    assert_true(pid > 0);

    ts_torch_model_t *local = NULL;
    assert_int_equal(ts_torch_load_file(&local, model, "cpu"), 0);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, c, "policy"), 0);

    /* Requests queue in tensord until tsinfer is up: the first answer may take its start-up. */
    for (int i = 0; i < 20; i++) {
        ts_value_t *x = rows_of(1 + i % 4, i), *y = NULL, *want = NULL;
        int64_t version = -1;
        int rc = ts_predictor_predict(p, x, 60000, &y, &version);
        if (rc != 0)
            print_error("predict: %s: %s\n", ts_strerror(rc), ts_last_error());
        assert_int_equal(rc, 0);
        assert_int_equal(version, 0);
        assert_int_equal(ts_torch_forward(local, x, &want), 0);
        assert_true(close_enough(y, want, 1.0f));
        ts_value_free(want);
        ts_value_free(y);
        ts_value_free(x);
    }

    /* Malformed requests: not a map, no reply bin, no input. Each is counted and logged; the
       predictions below come after them in the bin, so tsinfer has seen them by its exit. */
    ts_value_t *bad = ts_int_new(7);
    assert_int_equal(ts_append(c, "policy/requests", bad, NULL), 0);
    ts_value_free(bad);
    bad = ts_map_new();
    assert_int_equal(ts_map_set(bad, "id", ts_int_new(5)), 0);
    assert_int_equal(ts_append(c, "policy/requests", bad, NULL), 0);
    assert_int_equal(ts_map_set(bad, "reply", ts_string_new("policy/reply/x", 14)), 0);
    assert_int_equal(ts_append(c, "policy/requests", bad, NULL), 0);
    ts_value_free(bad);
    /* A malformed call of the service: answered with ESCHEMA, logged as a call of the service. */
    bad = ts_map_new();
    assert_int_equal(ts_map_set(bad, "x", ts_int_new(1)), 0);
    ts_value_t *reply = NULL;
    assert_int_equal(ts_call(c, "policy", bad, 30000, 0, &reply), 0);
    int64_t call_status = 0;
    assert_int_equal(ts_map_get_int(reply, "status", &call_status), 0);
    assert_int_equal(call_status, TS_ESCHEMA);
    ts_value_free(reply);
    ts_value_free(bad);

    /* The trainer publishes weights with out_scale 2 as version 1. */
    ts_value_t *sd = NULL;
    assert_int_equal(ts_torch_state_dict(local, &sd), 0);
    float two[4] = {2, 2, 2, 2};
    int64_t four = 4;
    assert_int_equal(ts_map_set(sd, "out_scale", ts_tensor_new(TS_FLOAT32, 1, &four, two, TS_COPY)),
                     0);
    ts_value_t *rec = ts_map_new();
    assert_int_equal(ts_map_set(rec, "params", sd), 0);
    assert_int_equal(ts_map_set(rec, "version", ts_int_new(1)), 0);
    assert_int_equal(ts_put(c, "policy/params", rec, NULL), 0);
    ts_value_free(rec);
    int64_t version = 0;
    for (int i = 0; i < 500 && version != 1; i++) {
        ts_value_t *x = rows_of(2, 100 + i), *y = NULL, *want = NULL;
        assert_int_equal(ts_predictor_predict(p, x, 30000, &y, &version), 0);
        assert_int_equal(ts_torch_forward(local, x, &want), 0);
        assert_true(close_enough(y, want, version == 1 ? 2.0f : 1.0f));
        ts_value_free(want);
        ts_value_free(y);
        ts_value_free(x);
        if (version != 1)
            sleep_ms(20);
    }
    assert_int_equal(version, 1);

    /* A state dict the model refuses (out_scale of 3, not 4), then an item without params: each
       is logged, and the replicas keep version 1. */
    assert_int_equal(ts_torch_state_dict(local, &sd), 0);
    int64_t three = 3;
    assert_int_equal(
        ts_map_set(sd, "out_scale", ts_tensor_new(TS_FLOAT32, 1, &three, two, TS_COPY)), 0);
    rec = ts_map_new();
    assert_int_equal(ts_map_set(rec, "params", sd), 0);
    assert_int_equal(ts_map_set(rec, "version", ts_int_new(2)), 0);
    assert_int_equal(ts_put(c, "policy/params", rec, NULL), 0);
    ts_value_free(rec);
    const char *refused = "tsinfer: --params policy/params: version 2 not loaded: replica ";
    for (int i = 0; i < 1000 && strstr(slurp(log), refused) == NULL; i++)
        sleep_ms(10);
    if (strstr(slurp(log), refused) == NULL)
        print_error("tsinfer's output:\n%s\n", slurp(log));
    assert_non_null(strstr(slurp(log), refused));
    assert_non_null(strstr(slurp(log), "shape mismatch: out_scale [3] (model [4])"));
    rec = ts_map_new();
    assert_int_equal(ts_map_set(rec, "version", ts_int_new(3)), 0);
    assert_int_equal(ts_put(c, "policy/params", rec, NULL), 0);
    ts_value_free(rec);
    const char *ignored = "is not {params, version}: ignored";
    for (int i = 0; i < 1000 && strstr(slurp(log), ignored) == NULL; i++)
        sleep_ms(10);
    assert_non_null(strstr(slurp(log), ignored));
    ts_value_t *x1 = rows_of(2, 900), *y1 = NULL;
    assert_int_equal(ts_predictor_predict(p, x1, 30000, &y1, &version), 0);
    assert_int_equal(version, 1);
    ts_value_free(y1);
    ts_value_free(x1);

    sleep_ms(1100); /* at least one periodic statistics line (--stats-s 1) */
    assert_int_equal(stop_tsinfer(pid), 0);
    static char out[65536];
    FILE *f = fopen(log, "r");
    assert_non_null(f);
    out[fread(out, 1, sizeof(out) - 1, f)] = '\0';
    fclose(f);
    if (strstr(out, "4 malformed") == NULL)
        print_error("tsinfer's output:\n%s\n", out);
    assert_non_null(strstr(out, "tsinfer: serving the service policy (and the relay's bin "
                                "policy/requests) on "));
    assert_non_null(strstr(out, "tsinfer: running: "));
    assert_non_null(strstr(out, "tsinfer: stopped: "));
    assert_non_null(strstr(out, "0 failed, 4 malformed"));
    /* Per replica: the time split and the batch sizes (Triton's statistics). */
    assert_non_null(strstr(out, "tsinfer:   replica 0 (cpu): "));
    assert_non_null(strstr(out, "us per request, input "));
    assert_non_null(strstr(out, " submitted, 0 timed out, 0 cancelled, 0 refused"));
    assert_non_null(strstr(out, "malformed request in policy/requests: not a map"));
    assert_non_null(strstr(out, "request 5: no 'reply' bin name"));
    assert_non_null(strstr(out, "request 5: no 'input'"));
    assert_non_null(strstr(out, "malformed call of the service policy: call "));
    assert_null(strstr(out, "malformed request in policy/requests: call "));
    /* The request that named a reply bin was answered with the reason. */
    ts_items_t *answer = NULL;
    assert_int_equal(ts_get(c, "policy/reply/x", 0, &answer), 0);
    int64_t status = 0;
    assert_int_equal(ts_map_get_int(ts_items_at(answer, 0), "status", &status), 0);
    assert_int_equal(status, TS_ESCHEMA);
    ts_items_free(answer);
    ts_predictor_free(p);
    ts_client_free(c);
    ts_torch_model_free(local);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* Run tsinfer with args until it exits (at most 30 s); its exit status, or -1. */
static int run_tsinfer(const char *const *args, const char *log)
{
    pid_t pid = start_tsinfer(args, log);
    int st = 0, exited = 0;
    for (int i = 0; i < 3000 && !exited; i++) {
        exited = waitpid(pid, &st, WNOHANG) == pid;
        if (!exited)
            sleep_ms(10);
    }
    if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Bytes of a log file read back at most. */
#define LOG_CAP 65536

/* The file's text (at most LOG_CAP - 1 bytes) in a static buffer. */
static const char *slurp(const char *path)
{
    static char out[LOG_CAP];
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        out[fread(out, 1, sizeof(out) - 1, f)] = '\0';
        fclose(f);
    }
    return out;
}

/* Completions of test_tsinfer_counts's asynchronous predictions. */
static atomic_int counts_done;

static void counts_cb(ts_predictor_t *p, int status, ts_value_t *output, int64_t version, void *arg)
{
    (void)p;
    (void)status;
    (void)version;
    (void)arg;
    ts_value_free(output);
    atomic_fetch_add(&counts_done, 1);
}

/*
 * tsinfer's "failed" is the model's failures and the deadlines passed, not the cancellations
 * (counted apart): a slow MLP (1024 wide, built here) whose output never matches --output fails
 * every forward; a flood of calls is still queued when SIGTERM comes, so those are cancelled.
 * Once serving stopped every call is answered or cancelled, so the "stopped" lines add up:
 * submitted = answered + failed + cancelled.
 */
static void test_tsinfer_counts(void **state)
{
    (void)state;
    const char *exe = getenv("TS_TSINFER");
    const char *make_models = getenv("TS_MAKE_MODELS");
    assert_non_null(exe);
    assert_non_null(make_models);
    tsh_server srv;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    char model[600];
    snprintf(model, sizeof(model), "%s/slow.pt", srv.dir);
    const char *make[] = {make_models, "--mlp", "8,1024,1024,1024,4", model, NULL};
    assert_int_equal(run_tsinfer(make, NULL), 0);
    const char *args[] = {exe,          "--server",  srv.addr,     "--model",
                          model,        "--name",    "counts",     "--input",
                          ":float32:8", "--output",  ":float32:5", "--max-batch",
                          "1",          "--threads", "1",          NULL};
    char log[600];
    snprintf(log, sizeof(log), "%s/tsinfer.log", srv.dir);
    pid_t pid = start_tsinfer(args, log);
    assert_true(pid > 0);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    ts_predictor_t *p = NULL;
    assert_int_equal(ts_predictor_open(&p, c, "counts"), 0);
    ts_value_t *x = rows_of(1, 0), *y = NULL;
    /* Waits for tsinfer's start-up; the output has 4 columns, not 5. */
    assert_int_equal(ts_predictor_predict(p, x, 60000, &y, NULL), TS_EMODEL);
    assert_non_null(strstr(ts_last_error(), "per-row shape [4], expected [5]"));
    atomic_store(&counts_done, 0);
    int sent = 0;
    for (int i = 0; i < 200; i++)
        sent += ts_predictor_predict_async(p, x, 60000, counts_cb, NULL) == 0;
    /* Stop once tsinfer works through them (at most 10 s on): most are still queued there. */
    for (int i = 0; i < 1000 && atomic_load(&counts_done) < 2; i++)
        sleep_ms(10);
    assert_int_equal(stop_tsinfer(pid), 0);
    ts_predictor_free(p); /* completes whatever is still outstanding */
    assert_int_equal(atomic_load(&counts_done), sent);
    const char *out = slurp(log);
    const char *line1 = strstr(out, "tsinfer: stopped: ");
    const char *line2 = line1 != NULL ? strstr(line1 + 1, "tsinfer: stopped: ") : NULL;
    if (line2 == NULL)
        print_error("tsinfer's output:\n%s\n", out);
    assert_non_null(line2);
    unsigned long long answered = 0, failed = 0, malformed = 0;
    unsigned long long submitted = 0, timed_out = 0, cancelled = 0;
    assert_int_equal(sscanf(line1,
                            "tsinfer: stopped: %llu requests answered, %llu failed, %llu "
                            "malformed",
                            &answered, &failed, &malformed),
                     3);
    assert_int_equal(sscanf(line2,
                            "tsinfer: stopped: %llu submitted, %llu timed out, %llu cancelled",
                            &submitted, &timed_out, &cancelled),
                     3);
    print_message("%llu submitted, %llu failed, %llu cancelled\n", submitted, failed, cancelled);
    assert_int_equal(answered, 0);
    assert_true(failed >= 1);
    assert_int_equal(timed_out, 0);
    assert_int_equal(submitted, answered + failed + cancelled);
    ts_value_free(x);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* test_tsinfer_shm's tensord and tsinfer, stopped by PID by the teardown when it fails. */
static tsh_server shm_srv;
static pid_t shm_pid;

static int shm_teardown(void **state)
{
    (void)state;
    if (shm_pid > 0) {
        kill(shm_pid, SIGKILL);
        waitpid(shm_pid, NULL, 0);
    }
    shm_pid = 0;
    if (shm_srv.pid > 0)
        (void)tsh_server_stop(&shm_srv);
    if (shm_srv.dir[0] != '\0')
        tsh_server_cleanup(&shm_srv);
    memset(&shm_srv, 0, sizeof(shm_srv));
    return 0;
}

/*
 * tsinfer --shm 4 over TCP: a predictor on this host that insists on a slot (TS_PREDICTOR_SHM)
 * gets one, every prediction goes through it (its shm counter, nothing through the service),
 * and each answer is the local model's.
 */
static void test_tsinfer_shm(void **state)
{
    (void)state;
    const char *exe = getenv("TS_TSINFER");
    const char *dir = getenv("TS_MODELS_DIR");
    assert_non_null(exe);
    assert_non_null(dir);
    char model[600];
    snprintf(model, sizeof(model), "%s/mlp.pt", dir);
    tsh_server *srv = &shm_srv;
    assert_int_equal(tsh_server_start(srv, NULL), 0);
    const char *args[] = {exe,          "--server",    srv->addr, "--model",    model,
                          "--name",     "policy",      "--input", ":float32:8", "--output",
                          ":float32:4", "--max-batch", "16",      "--device",   "cpu:1",
                          "--threads",  "1",           "--shm",   "4",          "--answer-threads",
                          "1",          "--overlap",   NULL};
    char log[600];
    snprintf(log, sizeof(log), "%s/tsinfer.log", shm_srv.dir);
    shm_pid = start_tsinfer(args, log);
    assert_true(shm_pid > 0);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv->addr, NULL), 0);
    /* The slots are advertised in policy/shm once tsinfer is up (its start-up loads the model). */
    int up = 0;
    for (int i = 0; i < 3000 && !up; i++) {
        ts_items_t *d = NULL;
        up = ts_peek(c, "policy/shm", 1, &d) == 0 && ts_items_count(d) == 1;
        ts_items_free(d);
        if (!up)
            sleep_ms(10);
    }
    if (!up)
        print_error("tsinfer's output:\n%s\n", slurp(log));
    assert_true(up);
    ts_predictor_options_t po;
    ts_predictor_options_init(&po);
    po.transport = TS_PREDICTOR_SHM;
    ts_predictor_t *p = NULL;
    int rc = ts_predictor_open_with(&p, c, "policy", &po);
    if (rc != 0)
        print_error("open: %s: %s\n", ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    ts_torch_model_t *local = NULL;
    assert_int_equal(ts_torch_load_file(&local, model, "cpu"), 0);
    for (int i = 0; i < 20; i++) {
        ts_value_t *x = rows_of(1 + i % 4, 300 + i), *y = NULL, *want = NULL;
        int64_t version = -1;
        rc = ts_predictor_predict(p, x, 60000, &y, &version);
        if (rc != 0)
            print_error("predict: %s: %s\n", ts_strerror(rc), ts_last_error());
        assert_int_equal(rc, 0);
        assert_int_equal(version, 0);
        assert_int_equal(ts_torch_forward(local, x, &want), 0);
        assert_true(close_enough(y, want, 1.0f));
        ts_value_free(want);
        ts_value_free(y);
        ts_value_free(x);
    }
    ts_predictor_stats_t ps;
    ts_predictor_stats(p, &ps);
    assert_int_equal(ps.shm, 20);
    assert_int_equal(ps.service, 0);
    assert_int_equal(ps.relayed, 0);
    assert_int_equal(ps.transport, TS_PREDICTOR_SHM);
    ts_predictor_free(p);
    int st = stop_tsinfer(shm_pid);
    shm_pid = 0;
    assert_int_equal(st, 0);
    const char *out = slurp(log);
    if (strstr(out, "4 shared-memory slots in policy/shm") == NULL)
        print_error("tsinfer's output:\n%s\n", out);
    assert_non_null(strstr(out, "4 shared-memory slots in policy/shm"));
    assert_non_null(strstr(out, "tsinfer: stopped: 20 requests answered, 0 failed"));
    /* Stopping took the advertisement away. */
    ts_items_t *d = NULL;
    assert_int_equal(ts_peek(c, "policy/shm", 1, &d), TS_ENOENT);
    ts_client_free(c);
    ts_torch_model_free(local);
    assert_int_equal(tsh_server_stop(srv), 0);
}

/* --shm with a slot count that is not 1..TS_BATCHER_SHM_MAX_SLOTS: exit status 2 and why. */
static void test_tsinfer_shm_usage(void **state)
{
    (void)state;
    const char *exe = getenv("TS_TSINFER");
    assert_non_null(exe);
    char log[] = "/tmp/ts-tsinfer-shm-XXXXXX";
    int fd = mkstemp(log);
    assert_true(fd >= 0);
    close(fd);
    static const char *const bad[] = {"0", "1025", "x", "-3", "4s"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *args[] = {exe,      "--server", "127.0.0.1:1", "--model", "m.pt", "--name",
                              "policy", "--input",  ":float32:8",  "--shm",   bad[i], NULL};
        assert_int_equal(run_tsinfer(args, log), 2);
        const char *out = slurp(log);
        if (strstr(out, "SLOTS is a number of slots from 1 to 1024") == NULL)
            print_error("--shm %s: %s\n", bad[i], out);
        assert_non_null(strstr(out, "SLOTS is a number of slots from 1 to 1024"));
    }
    /* --help names the option and what it needs. */
    const char *help[] = {exe, "--help", NULL};
    assert_int_equal(run_tsinfer(help, log), 0);
    assert_non_null(strstr(slurp(log), "--shm [SLOTS]"));
    assert_non_null(strstr(slurp(log), "--answer-threads N [--overlap]"));
    assert_non_null(strstr(slurp(log), "or -1 for none"));
    assert_non_null(strstr(slurp(log), "Exit status: 0 after SIGINT or SIGTERM; 2 for"));
    unlink(log);
}

/*
 * Configuration errors: tsinfer exits with status 2 and says why, before it loads the model or
 * connects (the server here does not exist).
 */
static void test_tsinfer_config_errors(void **state)
{
    (void)state;
    const char *exe = getenv("TS_TSINFER");
    const char *dir = getenv("TS_MODELS_DIR");
    assert_non_null(exe);
    assert_non_null(dir);
    char model[600];
    snprintf(model, sizeof(model), "%s/mlp.pt", dir);
    char log[] = "/tmp/ts-tsinfer-config-XXXXXX";
    int fd = mkstemp(log);
    assert_true(fd >= 0);
    close(fd);
    /* NAME/requests must be a bin name: NAME has at most 255 - 9 bytes. */
    static char long_name[248];
    memset(long_name, 'n', sizeof(long_name) - 1);
    /* Each case: its arguments after the required ones (which an argument here replaces), and
       a piece of the message. */
    static const struct {
        const char *argv[4];
        const char *message;
    } bad[] = {
        {{"--input", "x:float32:4x"}, "field 'x': bad dimensions"},
        {{"--input", "x:float32:4x4x"}, "field 'x': bad dimensions"},
        {{"--input", "x:float32: 4"}, "field 'x': bad dimensions"},
        {{"--input", "x:float32:+4"}, "field 'x': bad dimensions"},
        {{"--output", "y:float32:4x"}, "field 'y': bad dimensions"},
        {{"--name", ""}, "--name '': 1 to 246 bytes"},
        {{"--name", long_name}, ": 1 to 246 bytes"},
        {{"--params", ""}, "--params '': a bin name of 1 to 255 bytes"},
        {{"--overlap"}, "overlap_answers needs answer_threads >= 1"},
        {{"--min-delay-us", "600", "--max-delay-us", "500"}, "min_delay_us 600: 0..max_delay_us"},
        {{"--timeout-ms", "0"}, "timeout_ms must be positive"},
        {{"--input", "a:float32:2,a.b:float32:2"}, "fields 'a' and 'a.b' overlap"},
        {{"--device", "gpu"}, "placement 'gpu'"},
        {{"--timeout-ms", "-2"}, "bad argument '--timeout-ms'"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *args[16] = {exe,      "--server", "127.0.0.1:1", "--model",   model,
                                "--name", "policy",   "--input",     ":float32:8"};
        int n = 9;
        for (int k = 0; k < 4 && bad[i].argv[k] != NULL; k++)
            args[n++] = bad[i].argv[k];
        int st = run_tsinfer(args, log);
        const char *out = slurp(log);
        if (st != 2 || strstr(out, bad[i].message) == NULL)
            print_error("case %zu (%s %s): exit %d: %s\n", i, bad[i].argv[0],
                        bad[i].argv[1] != NULL ? bad[i].argv[1] : "", st, out);
        assert_int_equal(st, 2);
        assert_non_null(strstr(out, bad[i].message));
        /* Refused before serving: no statistics lines. */
        assert_null(strstr(out, "stopped:"));
    }
    unlink(log);
}

/* --overlap needs answer helpers: tsinfer says so and exits with status 2 (a configuration
   error). */
static void test_tsinfer_overlap_usage(void **state)
{
    (void)state;
    const char *exe = getenv("TS_TSINFER");
    const char *dir = getenv("TS_MODELS_DIR");
    char model[600];
    snprintf(model, sizeof(model), "%s/mlp.pt", dir);
    char log[] = "/tmp/ts-tsinfer-overlap-XXXXXX";
    int fd = mkstemp(log);
    assert_true(fd >= 0);
    close(fd);
    const char *args[] = {exe,      "--server", "127.0.0.1:1", "--model",   model, "--name",
                          "policy", "--input",  ":float32:8",  "--overlap", NULL};
    assert_int_equal(run_tsinfer(args, log), 2);
    const char *out = slurp(log);
    if (strstr(out, "overlap_answers needs answer_threads") == NULL)
        print_error("tsinfer's output:\n%s\n", out);
    assert_non_null(strstr(out, "overlap_answers needs answer_threads"));
    unlink(log);
}

/* tsinfer refuses a CUDA device on this CPU-only build with a clear message. */
static void test_tsinfer_cuda(void **state)
{
    (void)state;
    if (ts_torch_cuda_device_count() > 0)
        skip(); /* the refusal only exists without CUDA */
    const char *exe = getenv("TS_TSINFER");
    const char *dir = getenv("TS_MODELS_DIR");
    char model[600];
    snprintf(model, sizeof(model), "%s/mlp.pt", dir);
    const char *args[] = {exe,      "--server", "127.0.0.1:1", "--model",  model,    "--name",
                          "policy", "--input",  ":float32:8",  "--device", "cuda:0", NULL};
    /* It exits by itself (run_tsinfer gives -1 otherwise), with status 2: a configuration
       error. */
    assert_int_equal(run_tsinfer(args, NULL), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tsinfer),
        cmocka_unit_test(test_tsinfer_cuda),
        cmocka_unit_test_teardown(test_tsinfer_shm, shm_teardown),
        cmocka_unit_test(test_tsinfer_shm_usage),
        cmocka_unit_test(test_tsinfer_overlap_usage),
        cmocka_unit_test(test_tsinfer_config_errors),
        cmocka_unit_test(test_tsinfer_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
