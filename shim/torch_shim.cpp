/*
 * The libtorch shim (include/tensorshare/torch.h): TorchScript models, value <-> IValue
 * conversion, state dicts, and the batcher's model implementation.
 *
 * Every extern "C" function body runs inside TS_TORCH_GUARD, which turns any C++ exception into
 * an error code plus a thread-local message: no exception ever unwinds into C frames.
 * This is the project's only C++ and one translation unit, because each libtorch TU takes
 * about a minute to compile.
 */
#include "tensorshare/torch.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>
#include <torch/script.h>
#include <torch/version.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace
{

/*
 * Set the calling thread's ts_last_error() (tensorshare.h: the one message channel of every
 * module). ts_set_last_error copies at most TS_MAX_ERROR_LEN bytes and never throws.
 */
void set_error(const char *s) noexcept
{
    ts_set_last_error(s);
}

/* An error we raise ourselves, with its TS_E* code. */
struct ts_error : std::exception {
    int code;
    std::string msg;
    ts_error(int c, std::string m) : code(c), msg(std::move(m))
    {
    }
    const char *what() const noexcept override
    {
        return msg.c_str();
    }
};

/*
 * An error raised inside TorchScript comes with the interpreter's traceback first and the error
 * itself ("RuntimeError: AssertionError: ...") on the last line. Put that line first, so that a
 * message cut to a small buffer still says what went wrong; the traceback follows.
 */
std::string summarize(const char *what)
{
    std::string s = what != nullptr ? what : "";
    if (s.find("Traceback of TorchScript") == std::string::npos)
        return s;
    size_t end = s.find_last_not_of(" \n");
    if (end == std::string::npos)
        return s;
    size_t start = s.rfind('\n', end);
    start = start == std::string::npos ? 0 : start + 1;
    return s.substr(start, end - start + 1) + "\n" + s;
}

/*
 * Run f, turning exceptions into codes: bad_alloc gives TS_ENOMEM, ts_error its code, anything
 * else TS_ETORCH; the message goes to ts_last_error(). c10::Error is asked for its message without
 * the (long) C++ backtrace.
 */
template <class F> int guarded(F &&f) noexcept
{
    try {
        set_error(nullptr);
        return f();
    } catch (const std::bad_alloc &) {
        set_error("out of memory");
        return TS_ENOMEM;
    } catch (const ts_error &e) {
        set_error(e.msg.c_str());
        return e.code;
    } catch (const c10::Error &e) {
        try {
            set_error(summarize(e.what_without_backtrace()).c_str());
        } catch (...) {
            set_error(e.what_without_backtrace());
        }
        return TS_ETORCH;
    } catch (const std::exception &e) {
        try {
            set_error(summarize(e.what()).c_str());
        } catch (...) {
            set_error(e.what());
        }
        return TS_ETORCH;
    } catch (...) {
        set_error("unknown C++ exception");
        return TS_ETORCH;
    }
}

} // namespace

/* Every extern "C" body: TS_TORCH_GUARD(statements; return 0;) */
#define TS_TORCH_GUARD(...) return guarded([&]() -> int { __VA_ARGS__ })

/* ---------------------------------------------------------------------------------------------
 * Models
 */
struct ts_torch_model_s {
    ts_model_t base; /* for the batcher; base.data points back here */
    torch::jit::Module module;
    c10::Device device;
    std::string device_name;
    /*
     * A CUDA model's own stream (from libtorch's pool, made on first use): copies and kernels of
     * two models on one GPU (two replicas, "cuda:0*2") overlap instead of queueing on the
     * device's one default stream. Unset on CPU.
     */
    std::optional<c10::Stream> stream;
    /* ts_torch_set_autocast: the reduced dtype forwards run in, or kFloat for none. */
    c10::ScalarType autocast = c10::kFloat;
    c10::ScalarType out_dtype = c10::kFloat; /* what autocast outputs are cast back to */

    ts_torch_model_s(torch::jit::Module m, c10::Device d)
        : base{}, module(std::move(m)), device(d), device_name(d.str())
    {
        base.data = this;
    }
};

namespace
{

/* Parse and check a device name. Throws ts_error with a clear message. */
c10::Device parse_device(const char *name)
{
    std::string s = name != nullptr && *name ? name : "cpu";
    c10::Device d(c10::kCPU);
    try {
        d = c10::Device(s);
    } catch (const c10::Error &) {
        throw ts_error(TS_EINVAL, "device '" + s + "': expected cpu, cuda or cuda:N");
    }
    if (d.is_cpu())
        return c10::Device(c10::kCPU);
    if (!d.is_cuda())
        throw ts_error(TS_ENOTSUP, "device '" + s + "': only cpu and cuda are supported");
    if (!torch::cuda::is_available())
        throw ts_error(TS_ENOTSUP, "device '" + s +
                                       "': CUDA is not available (this libtorch build has no "
                                       "CUDA support, or no GPU is visible); use cpu");
    int n = static_cast<int>(torch::cuda::device_count());
    int index = d.has_index() ? d.index() : 0;
    if (index >= n)
        throw ts_error(TS_EINVAL,
                       "device '" + s + "': only " + std::to_string(n) + " CUDA device(s) visible");
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
}

/* The batcher's model operations (defined at the end). */
int op_forward(ts_model_t *mm, const ts_value_t *input, int64_t rows, ts_value_t **output);
int op_load(ts_model_t *mm, const ts_value_t *params);
void op_free(ts_model_t *mm);

const ts_model_ops_t torch_ops = {op_forward, op_load, op_free};

/* Set TS_TORCH_STREAMS=0 to run CUDA models on the device's current stream instead. */
bool streams_enabled()
{
    const char *e = std::getenv("TS_TORCH_STREAMS");
    return e == nullptr || std::strcmp(e, "0") != 0;
}

/*
 * Wait for the work queued on the device's current stream: a module moved or a state dict copied
 * to the GPU from pageable memory may still be in flight there, and a model's own stream
 * (created non-blocking) does not wait for it.
 */
void sync_current_stream(c10::Device d)
{
    if (!d.is_cuda())
        return;
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    impl.getStream(d).synchronize();
}

ts_torch_model_t *wrap_module(torch::jit::Module m, c10::Device d)
{
    m.eval();
    sync_current_stream(d);
    auto *tm = new ts_torch_model_s(std::move(m), d);
    tm->base.ops = &torch_ops;
    for (const auto &p : tm->module.parameters(true)) {
        if (p.is_floating_point()) {
            tm->out_dtype = p.scalar_type();
            break;
        }
    }
    return tm;
}

/* The model's stream as the current one for the scope (CUDA models only). */
struct model_stream {
    std::optional<c10::StreamGuard> guard;
    explicit model_stream(ts_torch_model_t *m)
    {
        if (!m->device.is_cuda() || !streams_enabled())
            return;
        if (!m->stream) {
            c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
            m->stream = impl.getStreamFromGlobalPool(m->device);
        }
        guard.emplace(*m->stream);
    }
};

/*
 * The thread's autocast switch and dtype for a device type. libtorch 2.4 replaced the per-device
 * functions (set_cpu_enabled, set_autocast_gpu_dtype, ...) with ones that take the device type,
 * and deprecated the old ones.
 */
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool autocast_enabled(bool cpu)
{
    return at::autocast::is_autocast_enabled(cpu ? at::kCPU : at::kCUDA);
}
void autocast_set(bool cpu, bool enabled, c10::ScalarType dtype)
{
    at::autocast::set_autocast_dtype(cpu ? at::kCPU : at::kCUDA, dtype);
    at::autocast::set_autocast_enabled(cpu ? at::kCPU : at::kCUDA, enabled);
}
c10::ScalarType autocast_dtype(bool cpu)
{
    return at::autocast::get_autocast_dtype(cpu ? at::kCPU : at::kCUDA);
}
#else
bool autocast_enabled(bool cpu)
{
    return cpu ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
void autocast_set(bool cpu, bool enabled, c10::ScalarType dtype)
{
    if (cpu) {
        at::autocast::set_autocast_cpu_dtype(dtype);
        at::autocast::set_cpu_enabled(enabled);
    } else {
        at::autocast::set_autocast_gpu_dtype(dtype);
        at::autocast::set_enabled(enabled);
    }
}
c10::ScalarType autocast_dtype(bool cpu)
{
    return cpu ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
}
#endif

/*
 * Autocast for the scope, as torch.autocast(device_type, dtype) does in Python: the thread's
 * autocast state for the model's device type is saved, set and restored.
 */
struct autocast_scope {
    bool on = false, cpu = false, was_enabled = false;
    c10::ScalarType was_dtype = c10::kFloat;
    explicit autocast_scope(const ts_torch_model_t *m)
    {
        if (m->autocast == c10::kFloat)
            return;
        cpu = m->device.is_cpu();
        if (cpu && m->autocast == c10::kHalf)
            throw ts_error(TS_ENOTSUP,
                           "autocast to float16 runs on CUDA only (use bfloat16 on CPU)");
        on = true;
        was_enabled = autocast_enabled(cpu);
        was_dtype = autocast_dtype(cpu);
        autocast_set(cpu, true, m->autocast);
        at::autocast::increment_nesting();
    }
    ~autocast_scope()
    {
        if (!on)
            return;
        /* The casts of the weights are cached while autocast is on: drop them when it ends. */
        if (at::autocast::decrement_nesting() == 0)
            at::autocast::clear_cache();
        autocast_set(cpu, was_enabled, was_dtype);
    }
    autocast_scope(const autocast_scope &) = delete;
    autocast_scope &operator=(const autocast_scope &) = delete;
};

/* ---------------------------------------------------------------------------------------------
 * dtypes
 */
c10::ScalarType to_scalar(ts_dtype_t t)
{
    switch (t) {
    case TS_BOOL:
        return c10::kBool;
    case TS_UINT8:
        return c10::kByte;
    case TS_INT8:
        return c10::kChar;
    case TS_INT16:
        return c10::kShort;
    case TS_INT32:
        return c10::kInt;
    case TS_INT64:
        return c10::kLong;
    case TS_FLOAT16:
        return c10::kHalf;
    case TS_BFLOAT16:
        return c10::kBFloat16;
    case TS_FLOAT32:
        return c10::kFloat;
    case TS_FLOAT64:
        return c10::kDouble;
    case TS_COMPLEX64:
        return c10::kComplexFloat;
    case TS_COMPLEX128:
        return c10::kComplexDouble;
    default:
        throw ts_error(TS_EINVAL, "unknown dtype " + std::to_string(static_cast<int>(t)));
    }
}

ts_dtype_t from_scalar(c10::ScalarType t)
{
    switch (t) {
    case c10::kBool:
        return TS_BOOL;
    case c10::kByte:
        return TS_UINT8;
    case c10::kChar:
        return TS_INT8;
    case c10::kShort:
        return TS_INT16;
    case c10::kInt:
        return TS_INT32;
    case c10::kLong:
        return TS_INT64;
    case c10::kHalf:
        return TS_FLOAT16;
    case c10::kBFloat16:
        return TS_BFLOAT16;
    case c10::kFloat:
        return TS_FLOAT32;
    case c10::kDouble:
        return TS_FLOAT64;
    case c10::kComplexFloat:
        return TS_COMPLEX64;
    case c10::kComplexDouble:
        return TS_COMPLEX128;
    default:
        throw ts_error(TS_ENOTSUP, std::string("tensor dtype ") + c10::toString(t) +
                                       " has no tensorshare dtype");
    }
}

/* ---------------------------------------------------------------------------------------------
 * Values -> IValues
 */

/*
 * Keeps a caller's input alive while libtorch holds tensors over its memory: one reference for
 * the call itself and one per wrapping tensor; release runs when the last one goes.
 */
struct keepalive {
    std::atomic<int> refs{1};
    void (*release)(void *) = nullptr;
    void *arg = nullptr;

    void ref()
    {
        refs.fetch_add(1);
    }
    void unref()
    {
        if (refs.fetch_sub(1) == 1) {
            if (release != nullptr)
                release(arg);
            delete this;
        }
    }
};

struct to_ctx {
    c10::Device device;
    keepalive *keep;
};

/* A tensor over the value's memory (no copy on CPU; pinned staging then an async copy on GPU). */
at::Tensor wrap_tensor(const ts_tensor_t *t, to_ctx &ctx)
{
    std::vector<int64_t> sizes(t->shape, t->shape + t->ndim);
    auto opts = torch::TensorOptions().dtype(to_scalar(t->dtype));
    at::Tensor cpu;
    if (t->data == nullptr || ts_tensor_numel(t) == 0) {
        cpu = torch::empty(sizes, opts);
    } else {
        keepalive *keep = ctx.keep;
        keep->ref();
        try {
            cpu = torch::from_blob(
                t->data, sizes, [keep](void *) { keep->unref(); }, opts);
        } catch (...) {
            keep->unref();
            throw;
        }
    }
    if (ctx.device.is_cpu())
        return cpu;
    /* Page-locked staging lets the host-to-device copy run asynchronously on the stream. */
    at::Tensor pinned = torch::empty(sizes, opts.pinned_memory(true));
    pinned.copy_(cpu);
    return pinned.to(ctx.device, /*non_blocking=*/true);
}

c10::IValue to_ivalue(const ts_value_t *v, to_ctx &ctx, int depth);

/* The common type of a container's entries: their unification, or Any. */
c10::TypePtr unify_all(const std::vector<c10::IValue> &items)
{
    if (items.empty())
        return c10::TensorType::get();
    /* Unshaped: containers are invariant, so Dict[str, Float(8, 16)] would not pass where
       TorchScript expects Dict[str, Tensor]. */
    c10::TypePtr t = c10::unshapedType(items[0].type());
    for (size_t i = 1; i < items.size(); i++) {
        auto u = c10::unifyTypes(t, c10::unshapedType(items[i].type()));
        if (!u)
            return c10::AnyType::get();
        t = *u;
    }
    return t;
}

c10::IValue to_ivalue(const ts_value_t *v, to_ctx &ctx, int depth)
{
    if (depth > 64)
        throw ts_error(TS_EINVAL, "value nested too deeply");
    switch (ts_value_type(v)) {
    case TS_TYPE_TENSOR:
        return wrap_tensor(ts_value_tensor(v), ctx);
    case TS_TYPE_INT: {
        int64_t x = 0;
        ts_value_int(v, &x);
        return x;
    }
    case TS_TYPE_FLOAT: {
        double x = 0;
        ts_value_float(v, &x);
        return x;
    }
    case TS_TYPE_STRING: {
        const char *s = nullptr;
        size_t n = 0;
        ts_value_string(v, &s, &n);
        return std::string(s, n);
    }
    case TS_TYPE_BYTES: {
        const void *p = nullptr;
        size_t n = 0;
        ts_value_bytes(v, &p, &n);
        ts_tensor_t t{};
        t.data = const_cast<void *>(p);
        t.dtype = TS_UINT8;
        t.ndim = 1;
        t.shape[0] = static_cast<int64_t>(n);
        return wrap_tensor(&t, ctx);
    }
    case TS_TYPE_LIST: {
        std::vector<c10::IValue> items;
        for (size_t i = 0; i < ts_value_len(v); i++)
            items.push_back(to_ivalue(ts_list_at(v, i), ctx, depth + 1));
        c10::impl::GenericList list(unify_all(items));
        for (auto &x : items)
            list.push_back(std::move(x));
        return list;
    }
    case TS_TYPE_MAP: {
        std::vector<c10::IValue> items;
        for (size_t i = 0; i < ts_value_len(v); i++)
            items.push_back(to_ivalue(ts_map_value_at(v, i), ctx, depth + 1));
        c10::impl::GenericDict dict(c10::StringType::get(), unify_all(items));
        for (size_t i = 0; i < items.size(); i++)
            dict.insert(std::string(ts_map_key_at(v, i)), std::move(items[i]));
        return dict;
    }
    default:
        throw ts_error(TS_EINVAL, "value of unknown type");
    }
}

/* ---------------------------------------------------------------------------------------------
 * IValues -> values (built values the caller owns)
 */
struct value_ptr {
    ts_value_t *v = nullptr;
    explicit value_ptr(ts_value_t *x) : v(x)
    {
        if (v == nullptr)
            throw std::bad_alloc();
    }
    value_ptr(const value_ptr &) = delete;
    value_ptr &operator=(const value_ptr &) = delete;
    ~value_ptr()
    {
        ts_value_free(v);
    }
    ts_value_t *release()
    {
        ts_value_t *r = v;
        v = nullptr;
        return r;
    }
};

/*
 * The output's dtype under autocast: a tensor in the reduced dtype goes back to the model's own
 * floating dtype (kFloat: no autocast, nothing to cast). Set for the conversion of one output.
 */
thread_local c10::ScalarType tls_cast_from = c10::kFloat;
thread_local c10::ScalarType tls_cast_to = c10::kFloat;

ts_value_t *tensor_value(const at::Tensor &in)
{
    at::Tensor src = in;
    if (tls_cast_from != c10::kFloat && src.scalar_type() == tls_cast_from)
        src = src.to(tls_cast_to);
    at::Tensor t;
    if (src.is_cuda()) {
        /* Page-locked memory makes the device-to-host copy a direct DMA on the current stream. */
        t = torch::empty(src.sizes(), src.options().device(c10::kCPU).pinned_memory(true));
        t.copy_(src);
    } else {
        t = src.to(c10::kCPU).contiguous();
    }
    if (t.dim() > TS_MAX_NDIM)
        throw ts_error(TS_ENOTSUP, "an output tensor has " + std::to_string(t.dim()) +
                                       " dimensions, more than " + std::to_string(TS_MAX_NDIM));
    int64_t shape[TS_MAX_NDIM] = {0};
    for (int64_t i = 0; i < t.dim(); i++)
        shape[i] = t.size(i);
    ts_dtype_t dt = from_scalar(t.scalar_type());
    const void *data = t.numel() > 0 ? t.data_ptr() : nullptr;
    ts_value_t *v = ts_tensor_new(dt, static_cast<int>(t.dim()), shape, data, TS_COPY);
    if (v == nullptr)
        throw std::bad_alloc();
    return v;
}

ts_value_t *from_ivalue(const c10::IValue &iv, int depth)
{
    if (depth > 64)
        throw ts_error(TS_ENOTSUP, "output nested too deeply");
    if (iv.isTensor())
        return tensor_value(iv.toTensor());
    if (iv.isInt())
        return value_ptr(ts_int_new(iv.toInt())).release();
    if (iv.isBool())
        return value_ptr(ts_int_new(iv.toBool() ? 1 : 0)).release();
    if (iv.isDouble())
        return value_ptr(ts_float_new(iv.toDouble())).release();
    if (iv.isString()) {
        const std::string &s = iv.toStringRef();
        return value_ptr(ts_string_new(s.data(), s.size())).release();
    }
    if (iv.isList() || iv.isTuple()) {
        value_ptr list(ts_list_new());
        auto push = [&](const c10::IValue &x) {
            int rc = ts_list_push(list.v, from_ivalue(x, depth + 1));
            if (rc != 0)
                throw ts_error(rc, "cannot build the output list");
        };
        if (iv.isList()) {
            for (const c10::IValue &x : iv.toListRef())
                push(x);
        } else {
            for (const c10::IValue &x : iv.toTupleRef().elements())
                push(x);
        }
        return list.release();
    }
    if (iv.isGenericDict()) {
        value_ptr map(ts_map_new());
        for (const auto &kv : iv.toGenericDict()) {
            if (!kv.key().isString())
                throw ts_error(TS_ENOTSUP,
                               "output dict keys must be strings, not " + kv.key().type()->str());
            int rc = ts_map_set(map.v, kv.key().toStringRef().c_str(),
                                from_ivalue(kv.value(), depth + 1));
            if (rc != 0)
                throw ts_error(rc, "cannot build the output map");
        }
        return map.release();
    }
    throw ts_error(TS_ENOTSUP, "output of type " + iv.type()->str() + " has no tensorshare form");
}

/* Run the module's forward on input; release as in ts_torch_forward_retained. */
ts_value_t *forward(ts_torch_model_t *m, const ts_value_t *input, void (*release)(void *),
                    void *arg)
{
    keepalive *keep;
    try {
        keep = new keepalive;
    } catch (...) {
        if (release != nullptr)
            release(arg);
        throw;
    }
    keep->release = release;
    keep->arg = arg;
    struct cast_reset {
        ~cast_reset()
        {
            tls_cast_from = c10::kFloat;
        }
    } reset;
    try {
        c10::InferenceMode inference;
        model_stream stream(m);
        to_ctx ctx{m->device, keep};
        std::vector<c10::IValue> args;
        args.push_back(to_ivalue(input, ctx, 0));
        c10::IValue out;
        {
            autocast_scope amp(m);
            out = m->module.forward(std::move(args));
        }
        args.clear();
        tls_cast_from = m->autocast;
        tls_cast_to = m->out_dtype;
        ts_value_t *v = from_ivalue(out, 0);
        keep->unref();
        return v;
    } catch (...) {
        keep->unref();
        throw;
    }
}

/* ---------------------------------------------------------------------------------------------
 * State dicts
 */

/* Flatten nested maps into dotted names. Throws on a leaf that is not a tensor. */
void flatten(const ts_value_t *v, const std::string &prefix,
             std::vector<std::pair<std::string, const ts_tensor_t *>> &out, int depth)
{
    if (depth > 64)
        throw ts_error(TS_EINVAL, "state dict nested too deeply");
    if (ts_value_type(v) == TS_TYPE_TENSOR) {
        out.emplace_back(prefix, ts_value_tensor(v));
        return;
    }
    if (ts_value_type(v) != TS_TYPE_MAP)
        throw ts_error(TS_EINVAL, "state dict entry '" + prefix + "' is not a tensor or a map");
    for (size_t i = 0; i < ts_value_len(v); i++) {
        std::string name =
            prefix.empty() ? std::string(ts_map_key_at(v, i)) : prefix + "." + ts_map_key_at(v, i);
        flatten(ts_map_value_at(v, i), name, out, depth + 1);
    }
}

std::string shape_str(c10::IntArrayRef s)
{
    std::string r = "[";
    for (size_t i = 0; i < s.size(); i++)
        r += (i ? "," : "") + std::to_string(s[i]);
    return r + "]";
}

/* The module's parameters and buffers by dotted name, in module order. */
std::vector<std::pair<std::string, at::Tensor>> named_state(const torch::jit::Module &m)
{
    std::vector<std::pair<std::string, at::Tensor>> r;
    for (const auto &p : m.named_parameters(true))
        r.emplace_back(p.name, p.value);
    for (const auto &b : m.named_buffers(true))
        r.emplace_back(b.name, b.value);
    return r;
}

/* Append a list of names to msg, at most 8 of them, then how many more. */
void list_names(std::string &msg, const char *what, const std::vector<std::string> &names)
{
    if (names.empty())
        return;
    if (!msg.empty())
        msg += "; ";
    msg += what;
    msg += ": ";
    for (size_t i = 0; i < names.size() && i < 8; i++)
        msg += (i ? ", " : "") + names[i];
    if (names.size() > 8)
        msg += " and " + std::to_string(names.size() - 8) + " more";
}

void load_state(ts_torch_model_t *m, const ts_value_t *sd, unsigned flags)
{
    std::vector<std::pair<std::string, const ts_tensor_t *>> given;
    flatten(sd, "", given, 0);
    auto own = named_state(m->module);
    std::unordered_map<std::string, at::Tensor *> by_name;
    for (auto &p : own)
        by_name.emplace(p.first, &p.second);
    std::vector<std::string> unexpected, mismatched, missing;
    std::vector<std::pair<at::Tensor *, const ts_tensor_t *>> copies;
    std::unordered_map<std::string, bool> seen;
    for (const auto &g : given) {
        auto it = by_name.find(g.first);
        if (it == by_name.end()) {
            unexpected.push_back(g.first);
            continue;
        }
        seen[g.first] = true;
        const ts_tensor_t *t = g.second;
        c10::IntArrayRef want = it->second->sizes();
        bool same = static_cast<size_t>(t->ndim) == want.size();
        for (size_t d = 0; same && d < want.size(); d++)
            same = t->shape[d] == want[d];
        if (!same) {
            mismatched.push_back(g.first + " " +
                                 shape_str(c10::IntArrayRef(t->shape, t->shape + t->ndim)) +
                                 " (model " + shape_str(want) + ")");
            continue;
        }
        to_scalar(t->dtype); /* throws on an unknown dtype */
        copies.emplace_back(it->second, t);
    }
    for (const auto &p : own)
        if (seen.find(p.first) == seen.end())
            missing.push_back(p.first);
    std::string msg;
    if (!(flags & TS_TORCH_NONSTRICT)) {
        list_names(msg, "missing", missing);
        list_names(msg, "unexpected", unexpected);
    }
    list_names(msg, "shape mismatch", mismatched);
    if (!msg.empty())
        throw ts_error(TS_EINVAL, "state dict does not match the model: " + msg);
    torch::NoGradGuard no_grad;
    model_stream stream(m);
    for (auto &c : copies) {
        const ts_tensor_t *t = c.second;
        std::vector<int64_t> sizes(t->shape, t->shape + t->ndim);
        auto opts = torch::TensorOptions().dtype(to_scalar(t->dtype));
        if (ts_tensor_numel(t) == 0)
            continue;
        at::Tensor src = torch::from_blob(t->data, sizes, opts);
        c.first->copy_(src);
    }
    /* The caller may free the state dict as soon as this returns: the copies must be done. */
    if (m->stream)
        m->stream->synchronize();
    else
        sync_current_stream(m->device);
}

ts_value_t *export_state(ts_torch_model_t *m)
{
    value_ptr map(ts_map_new());
    for (const auto &p : named_state(m->module)) {
        int rc = ts_map_set(map.v, p.first.c_str(), tensor_value(p.second.detach()));
        if (rc != 0)
            throw ts_error(rc, "cannot build the state dict");
    }
    return map.release();
}

/* The batcher's model operations; a failure's message is in ts_last_error() (guarded). */
int op_forward(ts_model_t *mm, const ts_value_t *input, int64_t rows, ts_value_t **output)
{
    (void)rows;
    auto *m = static_cast<ts_torch_model_t *>(mm->data);
    return guarded([&]() -> int {
        *output = forward(m, input, nullptr, nullptr);
        return 0;
    });
}

int op_load(ts_model_t *mm, const ts_value_t *params)
{
    auto *m = static_cast<ts_torch_model_t *>(mm->data);
    return guarded([&]() -> int {
        load_state(m, params, 0);
        return 0;
    });
}

void op_free(ts_model_t *mm)
{
    ts_torch_model_free(static_cast<ts_torch_model_t *>(mm->data));
}

} // namespace

/* ---------------------------------------------------------------------------------------------
 * The C API
 */
extern "C" {

int ts_torch_load_file(ts_torch_model_t **out, const char *path, const char *device)
{
    TS_TORCH_GUARD({
        if (out == nullptr || path == nullptr)
            throw ts_error(TS_EINVAL, "ts_torch_load_file: no path");
        c10::Device d = parse_device(device);
        std::ifstream f(path, std::ios::binary);
        if (!f)
            throw ts_error(TS_ENOENT, std::string("cannot open model file '") + path + "'");
        torch::jit::Module mod = torch::jit::load(f, d);
        *out = wrap_module(std::move(mod), d);
        return 0;
    });
}

int ts_torch_load_bytes(ts_torch_model_t **out, const void *data, size_t len, const char *device)
{
    TS_TORCH_GUARD({
        if (out == nullptr || (data == nullptr && len > 0))
            throw ts_error(TS_EINVAL, "ts_torch_load_bytes: no data");
        c10::Device d = parse_device(device);
        std::istringstream in(std::string(static_cast<const char *>(data), len));
        torch::jit::Module mod = torch::jit::load(in, d);
        *out = wrap_module(std::move(mod), d);
        return 0;
    });
}

int ts_torch_clone(ts_torch_model_t **out, const ts_torch_model_t *src, const char *device)
{
    TS_TORCH_GUARD({
        if (out == nullptr || src == nullptr)
            throw ts_error(TS_EINVAL, "ts_torch_clone: no model");
        c10::Device d = device != nullptr ? parse_device(device) : src->device;
        torch::jit::Module mod = src->module.clone();
        mod.to(d);
        ts_torch_model_t *m = wrap_module(std::move(mod), d);
        m->autocast = src->autocast;
        if (m->autocast == c10::kHalf && d.is_cpu()) {
            delete m;
            throw ts_error(TS_ENOTSUP,
                           "autocast to float16 runs on CUDA only (use bfloat16 on CPU)");
        }
        *out = m;
        return 0;
    });
}

void ts_torch_model_free(ts_torch_model_t *m)
{
    /* Destructors of libtorch objects do not throw; the guard is there all the same. */
    (void)guarded([&]() -> int {
        delete m;
        return 0;
    });
}

const char *ts_torch_model_device(const ts_torch_model_t *m)
{
    return m->device_name.c_str();
}

int ts_torch_forward(ts_torch_model_t *m, const ts_value_t *input, ts_value_t **output)
{
    TS_TORCH_GUARD({
        if (m == nullptr || input == nullptr || output == nullptr)
            throw ts_error(TS_EINVAL, "ts_torch_forward: missing argument");
        *output = forward(m, input, nullptr, nullptr);
        return 0;
    });
}

int ts_torch_forward_retained(ts_torch_model_t *m, const ts_value_t *input, void (*release)(void *),
                              void *arg, ts_value_t **output)
{
    if (m == nullptr || input == nullptr || output == nullptr) {
        if (release != nullptr)
            release(arg);
        TS_TORCH_GUARD(
            { throw ts_error(TS_EINVAL, "ts_torch_forward_retained: missing argument"); });
    }
    /* From here forward() owns the duty to call release. */
    TS_TORCH_GUARD({
        *output = forward(m, input, release, arg);
        return 0;
    });
}

int ts_torch_load_state_dict(ts_torch_model_t *m, const ts_value_t *state_dict, unsigned flags)
{
    TS_TORCH_GUARD({
        if (m == nullptr || state_dict == nullptr)
            throw ts_error(TS_EINVAL, "ts_torch_load_state_dict: missing argument");
        load_state(m, state_dict, flags);
        return 0;
    });
}

int ts_torch_state_dict(ts_torch_model_t *m, ts_value_t **out)
{
    TS_TORCH_GUARD({
        if (m == nullptr || out == nullptr)
            throw ts_error(TS_EINVAL, "ts_torch_state_dict: missing argument");
        *out = export_state(m);
        return 0;
    });
}

int ts_torch_set_autocast(ts_torch_model_t *m, ts_dtype_t dtype)
{
    TS_TORCH_GUARD({
        if (m == nullptr)
            throw ts_error(TS_EINVAL, "ts_torch_set_autocast: no model");
        if (dtype == TS_FLOAT32) {
            m->autocast = c10::kFloat;
            return 0;
        }
        if (dtype != TS_FLOAT16 && dtype != TS_BFLOAT16)
            throw ts_error(TS_EINVAL, "autocast runs in float16 or bfloat16 (float32: off)");
        m->autocast = to_scalar(dtype);
        return 0;
    });
}

int ts_torch_cuda_device_count(void)
{
    int n = 0;
    (void)guarded([&]() -> int {
        n = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
        return 0;
    });
    return n;
}

void ts_torch_set_num_threads(int n)
{
    if (n < 1)
        return;
    (void)guarded([&]() -> int {
        at::set_num_threads(n);
        return 0;
    });
}

int ts_torch_model_create(const char *device, int replica, ts_model_t **out, void *prototype)
{
    (void)replica;
    ts_torch_model_t *m = nullptr;
    /* ts_torch_clone leaves its message in ts_last_error(), where the batcher reads it. */
    int rc = ts_torch_clone(&m, static_cast<const ts_torch_model_t *>(prototype), device);
    if (rc != 0)
        return rc;
    *out = &m->base;
    return 0;
}

} /* extern "C" */
