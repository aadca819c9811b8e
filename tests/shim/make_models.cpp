/*
 * Builds the TorchScript test models from source (no binary blobs in the repository) and saves
 * them into the directory given as the only argument:
 *   mlp.pt      x [N,8] -> [N,4]: fc2(relu(fc1(x))) * out_scale (submodules fc1, fc2; a buffer)
 *   dict.pt     {x: [N,16], y: [N,16]} -> {output: [N,1], sum: [N,16]} (Torch Spread's example)
 *   raising.pt  x -> 2x, raising an error when x has a negative value
 *   identity.pt Dict[str, Tensor] -> the same dict
 *   listy.pt    List[Tensor] -> (x0 + x1, [2 x0], len, 1.5, "ok", True)
 *   keeper.pt   x -> x + 1, keeping x in an attribute until the next call
 *   plain.pt    x [N,8] -> [N,4]: l1(relu(l0(x))), 64 wide, ending on a linear layer (autocast
 *               makes its output reduced-precision, which the shim converts back)
 *
 * "make_models --mlp 8,2048,2048,2048,4 FILE" saves one MLP of those widths instead (ReLU between
 * the layers, float32, seed 0): batcher_bench builds its big model this way.
 */
#include <torch/script.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace
{

torch::jit::Module linear(const std::string &cls, int64_t in, int64_t out)
{
    torch::jit::Module m(c10::QualifiedName("__torch__." + cls));
    m.register_parameter("weight", torch::randn({out, in}) / std::sqrt(static_cast<double>(in)),
                         false);
    m.register_parameter("bias", torch::randn({out}) * 0.1, false);
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    return torch.addmm(self.bias, x, self.weight.t())
)JIT");
    return m;
}

torch::jit::Module mlp()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.MLP"));
    m.register_module("fc1", linear("Linear8x32", 8, 32));
    m.register_module("fc2", linear("Linear32x4", 32, 4));
    m.register_buffer("out_scale", torch::ones({4}));
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    return self.fc2.forward(torch.relu(self.fc1.forward(x))) * self.out_scale
)JIT");
    return m;
}

torch::jit::Module dict_model()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.SmallNetwork"));
    m.register_module("linear", linear("Linear16x1", 16, 1));
    m.define(R"JIT(
def forward(self, inp: Dict[str, Tensor]) -> Dict[str, Tensor]:
    x = inp["x"]
    y = inp["y"]
    return {"output": self.linear.forward(x), "sum": x + y}
)JIT");
    return m;
}

torch::jit::Module raising()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Raising"));
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    assert not bool((x < 0).any()), "negative input"
    return x * 2.0
)JIT");
    return m;
}

torch::jit::Module identity()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Identity"));
    m.define(R"JIT(
def forward(self, inp: Dict[str, Tensor]) -> Dict[str, Tensor]:
    return inp
)JIT");
    return m;
}

torch::jit::Module listy()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Listy"));
    m.define(R"JIT(
def forward(self, xs: List[Tensor]) -> Tuple[Tensor, List[Tensor], int, float, str, bool]:
    return (xs[0] + xs[1], [xs[0] * 2], len(xs), 1.5, "ok", True)
)JIT");
    return m;
}

torch::jit::Module keeper()
{
    torch::jit::Module m(c10::QualifiedName("__torch__.Keeper"));
    m.register_attribute("last", c10::TensorType::get(), torch::zeros({1}));
    m.define(R"JIT(
def forward(self, x: Tensor) -> Tensor:
    self.last = x
    return x + 1
)JIT");
    return m;
}

/*
 * x [N, widths[0]] -> [N, widths.back()]: linear layers l0, l1, ... with a ReLU after each but
 * the last, unrolled in the TorchScript source (a ModuleList cannot be defined from C++).
 */
torch::jit::Module mlp_of(const std::vector<int64_t> &widths)
{
    torch::jit::Module m(c10::QualifiedName("__torch__.BenchMLP"));
    std::string body = "def forward(self, x: Tensor) -> Tensor:\n";
    for (size_t i = 0; i + 1 < widths.size(); i++) {
        std::string name = "l" + std::to_string(i);
        m.register_module(
            name, linear("Linear" + std::to_string(widths[i]) + "x" + std::to_string(widths[i + 1]),
                         widths[i], widths[i + 1]));
        body += "    x = self." + name + ".forward(x)\n";
        if (i + 2 < widths.size())
            body += "    x = torch.relu(x)\n";
    }
    body += "    return x\n";
    m.define(body);
    return m;
}

/* "8,2048,4" -> {8, 2048, 4}; at least two widths, each 1 to 1 << 20. Empty on error. */
std::vector<int64_t> parse_widths(const char *s)
{
    std::vector<int64_t> w;
    std::stringstream in(s);
    std::string item;
    while (std::getline(in, item, ',')) {
        char *end = nullptr;
        long long v = std::strtoll(item.c_str(), &end, 10);
        if (item.empty() || *end != '\0' || v < 1 || v > (1 << 20))
            return {};
        w.push_back(v);
    }
    return w.size() >= 2 ? w : std::vector<int64_t>{};
}

} // namespace

int main(int argc, char **argv)
{
    if (argc == 4 && std::string(argv[1]) == "--mlp") {
        std::vector<int64_t> widths = parse_widths(argv[2]);
        if (widths.empty()) {
            std::fprintf(stderr, "make_models: --mlp wants widths like 8,2048,2048,2048,4\n");
            return 2;
        }
        try {
            torch::manual_seed(0);
            mlp_of(widths).save(argv[3]);
        } catch (const std::exception &e) {
            std::fprintf(stderr, "make_models: %s\n", e.what());
            return 1;
        }
        return 0;
    }
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s OUTDIR | %s --mlp W0,W1,...,WN FILE\n", argv[0], argv[0]);
        return 2;
    }
    std::string dir = argv[1];
    try {
        std::filesystem::create_directories(dir); /* docs/BATCHER.md names a fresh directory */
        torch::manual_seed(0);
        mlp().save(dir + "/mlp.pt");
        dict_model().save(dir + "/dict.pt");
        raising().save(dir + "/raising.pt");
        identity().save(dir + "/identity.pt");
        listy().save(dir + "/listy.pt");
        keeper().save(dir + "/keeper.pt");
        mlp_of({8, 64, 4}).save(dir + "/plain.pt");
    } catch (const c10::Error &e) {
        std::fprintf(stderr, "make_models: %s\n", e.what_without_backtrace());
        return 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "make_models: %s\n", e.what());
        return 1;
    }
    std::printf("models written to %s\n", dir.c_str());
    return 0;
}
